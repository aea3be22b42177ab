// Streams, events, copies, fills, host functions and kernel launches of the emulated runtime.
//
// A stream is a FIFO of operations run by its own worker thread, one at a time, each after the operations it
// depends on (other streams' sequence numbers) have completed. Operations of different streams run concurrently,
// so P virtual ranks' kernels, each on its stream, are on the device together, as on a GPU.
//
// The legacy default stream (handle 0 or cudaStreamLegacy) follows CUDA's implicit synchronisation: an operation
// on it waits for all work queued before it on every blocking stream of the device, and an operation on a
// blocking stream waits for the legacy stream's work queued before it. Streams created with
// cudaStreamNonBlocking take no part; cudaStreamPerThread is a blocking stream of the calling thread.
//
// Events are (stream, sequence number) snapshots: cudaEventRecord queues an empty operation and the event is
// complete once its stream completed it; cudaStreamWaitEvent queues an empty operation depending on it (the wait
// takes the event's state at call time, as in CUDA). Timing events carry the completion time of their record.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

thread_local std::vector<Stream*> t_per_thread;
uint64_t g_streams = 0;  // streams made so far (under state().mu)

// The jitter of operation `seq` of `s` (api.h): a function of the seed and the two numbers only, so a seed
// replays the same delays wherever the same streams are made in the same order.
void jitter(const Stream* s, uint64_t seq) {
  const uint64_t span = config().jitter_ns;
  if (span == 0) return;
  const uint64_t ns = mix64(config().seed ^ mix64(s->number * 0x100000001B3ull + seq)) % (span + 1);
  if (ns != 0) std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
}

Stream* new_stream(int device, bool blocking, bool legacy) {
  auto* s = new Stream();  // never freed: operations of other streams may name it in their dependencies
  s->device = device;
  s->blocking = blocking;
  s->legacy = legacy;
  s->number = ++g_streams;
  state().all.push_back(s);
  return s;
}

Stream* legacy_stream(int device) {
  State& st = state();
  if (st.legacy.size() < static_cast<size_t>(config().devices)) st.legacy.resize(config().devices, nullptr);
  if (st.legacy[device] == nullptr) st.legacy[device] = new_stream(device, true, true);
  return st.legacy[device];
}

bool deps_done(const Stream::Op& op) {
  for (const auto& [s, seq] : op.deps) {
    if (s->completed < seq) return false;
  }
  return true;
}

void worker_main(Stream* s) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  for (;;) {
    st.cv.wait(lock, [&] { return (!s->queue.empty() && deps_done(s->queue.front())) || (s->queue.empty() && s->destroyed); });
    if (s->queue.empty()) break;
    const Work work = s->queue.front().work;
    const uint64_t seq = s->queue.front().seq;
    lock.unlock();
    if (sticky() == cudaSuccess) jitter(s, seq);
    run_work(work);
    lock.lock();
    Stream::Op& op = s->queue.front();
    s->completed = op.seq;
    if (op.record) op.record->time_ns = now_ns();
    s->queue.pop_front();
    device_work_end();
    st.cv.notify_all();
  }
  s->worker = false;
  st.all.erase(std::remove(st.all.begin(), st.all.end(), s), st.all.end());
}

// Common preamble of the API calls that use a stream: initialised, stream known. Under state().mu.
Stream* stream_arg(cudaStream_t handle, cudaError_t* err) {
  *err = check_init();
  if (*err != cudaSuccess) return nullptr;
  return resolve_stream(handle, err);
}

// Queues `w` on `s`, or adds it to the capture `s` belongs to. Under state().mu.
cudaError_t submit(Stream* s, Work w) {
  if (s->capture != nullptr) return capture_work(s, std::move(w));
  if (s->legacy) {
    if (const cudaError_t e = check_legacy_use(s->device)) return e;
  }
  enqueue(s, std::move(w));
  return cudaSuccess;
}

// cudaMemcpy and cudaMemset: queued on the legacy stream and waited for.
cudaError_t run_sync(Work w) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  if (const cudaError_t e = check_unsafe_call()) return e;
  const int device = current_device();
  touch_device(device);
  if (const cudaError_t e = check_legacy_use(device)) return e;
  Stream* s = legacy_stream(device);
  const uint64_t seq = enqueue(s, std::move(w));
  wait_for(lock, s, seq);
  return cudaSuccess;
}

Event* event_arg(cudaEvent_t e) {
  Event* ev = reinterpret_cast<Event*>(e);
  return state().events.count(ev) != 0 ? ev : nullptr;
}

}  // namespace

namespace {
// Made when the library is loaded, before any thread; never destroyed: stream workers and static destructors
// that free CUDA resources may run after main returns. (A function-local static's first-use guard would be
// invisible to ThreadSanitizer in this uninstrumented library.)
State* const g_state = new State();
}  // namespace

State& state() { return *g_state; }

Stream* resolve_stream(cudaStream_t handle, cudaError_t* err) {
  const int device = current_device();
  touch_device(device);
  if (handle == nullptr || handle == cudaStreamLegacy) return legacy_stream(device);
  if (handle == cudaStreamPerThread) {
    if (t_per_thread.size() < static_cast<size_t>(config().devices)) t_per_thread.resize(config().devices, nullptr);
    if (t_per_thread[device] == nullptr) t_per_thread[device] = new_stream(device, true, false);
    return t_per_thread[device];
  }
  Stream* s = reinterpret_cast<Stream*>(handle);
  if (state().streams.count(s) == 0) {
    *err = cudaErrorInvalidResourceHandle;
    return nullptr;
  }
  return s;
}

uint64_t enqueue(Stream* s, Work w, std::shared_ptr<EventRecord> record,
                 std::vector<std::pair<Stream*, uint64_t>> deps) {
  State& st = state();
  Stream::Op op;
  op.seq = ++s->enqueued;
  op.work = std::move(w);
  op.deps = std::move(deps);
  if (s->legacy) {
    for (Stream* t : st.all) {
      if (t != s && t->device == s->device && t->blocking && t->completed < t->enqueued) {
        op.deps.emplace_back(t, t->enqueued);
      }
    }
  } else if (s->blocking) {
    Stream* l = legacy_stream(s->device);
    if (l->completed < l->enqueued) op.deps.emplace_back(l, l->enqueued);
  }
  if (record) {
    record->stream = s;
    record->seq = op.seq;
  }
  op.record = std::move(record);
  s->queue.push_back(std::move(op));
  device_work_begin();
  if (!s->worker) {
    s->worker = true;
    std::thread(worker_main, s).detach();
  }
  st.cv.notify_all();
  return s->enqueued;
}

void wait_for(std::unique_lock<std::mutex>& lock, Stream* s, uint64_t seq) {
  state().cv.wait(lock, [&] { return s->completed >= seq; });
}

void run_work(const Work& w) {
  if (sticky() != cudaSuccess) return;
  switch (w.kind) {
    case Work::Kind::kNone:
      break;
    case Work::Kind::kKernel:
      run_grid(w.kernel);
      break;
    case Work::Kind::kCopy:
      std::memmove(w.dst, w.src, w.bytes);
      break;
    case Work::Kind::kFill:
      std::memset(w.dst, w.value, w.bytes);
      break;
    case Work::Kind::kHost:
      set_in_host_function(true);
      w.fn(w.data);
      set_in_host_function(false);
      break;
    case Work::Kind::kGraph:
      run_graph(*w.exec);
      break;
  }
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

// ---- streams ------------------------------------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned int flags) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (out == nullptr || (flags & ~1u) != 0) return fail(cudaErrorInvalidValue);
  const int device = current_device();
  touch_device(device);
  std::lock_guard<std::mutex> lock(state().mu);
  Stream* s = new_stream(device, (flags & cudaStreamNonBlocking) == 0, false);
  state().streams.insert(s);
  *out = reinterpret_cast<cudaStream_t>(s);
  return ok();
}

cudaError_t cudaStreamCreate(cudaStream_t* out) { return cudaStreamCreateWithFlags(out, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t handle) {
  if (const cudaError_t e = check_init()) return fail(e);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  Stream* s = reinterpret_cast<Stream*>(handle);
  if (st.streams.count(s) == 0) return fail(cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) {
    invalidate(s->capture);
    s->capture->members.erase(s);
    s->capture = nullptr;
  }
  // Work already queued still runs (CUDA releases the stream once it is done); the handle is dead at once.
  st.streams.erase(s);
  s->destroyed = true;
  if (!s->worker) st.all.erase(std::remove(st.all.begin(), st.all.end(), s), st.all.end());
  st.cv.notify_all();
  return ok();
}

cudaError_t cudaStreamSynchronize(cudaStream_t handle) {
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  if (s->capture != nullptr) {
    invalidate(s->capture);
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (const cudaError_t e = check_unsafe_call()) return fail(e);
  if (s->legacy) {
    if (const cudaError_t e = check_legacy_use(s->device)) return fail(e);
  }
  wait_for(lock, s, s->enqueued);
  return ok();
}

cudaError_t cudaStreamQuery(cudaStream_t handle) {
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  if (s->capture != nullptr) {
    invalidate(s->capture);
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (const cudaError_t e = check_unsafe_call()) return fail(e);
  return s->completed >= s->enqueued ? ok() : fail(cudaErrorNotReady);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (const cudaError_t e = check_init()) return fail(e);
  State& st = state();
  std::unique_lock<std::mutex> lock(st.mu);
  if (const cudaError_t e = check_unsafe_call()) return fail(e);
  const int device = current_device();
  touch_device(device);
  std::vector<std::pair<Stream*, uint64_t>> targets;
  for (Stream* s : st.all) {
    if (s->device == device) targets.emplace_back(s, s->enqueued);
  }
  st.cv.wait(lock, [&] {
    return std::all_of(targets.begin(), targets.end(), [](const auto& t) { return t.first->completed >= t.second; });
  });
  return ok();
}

cudaError_t cudaLaunchHostFunc(cudaStream_t handle, cudaHostFn_t fn, void* data) {
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  if (fn == nullptr) return fail(cudaErrorInvalidValue);
  Work w;
  w.kind = Work::Kind::kHost;
  w.fn = fn;
  w.data = data;
  return fail(submit(s, std::move(w)));
}

// ---- copies and fills ---------------------------------------------------------------------------------------------

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (const cudaError_t e = check_copy(dst, src, n, kind)) return fail(e);
  if (n == 0) return ok();
  Work w;
  w.kind = Work::Kind::kCopy;
  w.dst = dst;
  w.src = src;
  w.bytes = n;
  return fail(run_sync(std::move(w)));
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t handle) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (const cudaError_t e = check_copy(dst, src, n, kind)) return fail(e);
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  if (n == 0) return ok();
  Work w;
  w.kind = Work::Kind::kCopy;
  w.dst = dst;
  w.src = src;
  w.bytes = n;
  return fail(submit(s, std::move(w)));
}

cudaError_t cudaMemset(void* p, int value, size_t n) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (const cudaError_t e = check_fill(p, n)) return fail(e);
  if (n == 0) return ok();
  Work w;
  w.kind = Work::Kind::kFill;
  w.dst = p;
  w.value = value;
  w.bytes = n;
  return fail(run_sync(std::move(w)));
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t handle) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (const cudaError_t e = check_fill(p, n)) return fail(e);
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  if (n == 0) return ok();
  Work w;
  w.kind = Work::Kind::kFill;
  w.dst = p;
  w.value = value;
  w.bytes = n;
  return fail(submit(s, std::move(w)));
}

// ---- kernels ------------------------------------------------------------------------------------------------------

cudaError_t cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                             cudaStream_t handle) {
  if (const cudaError_t e = check_init()) return fail(e);
  gpucoll_emu_pack_fn pack;
  gpucoll_emu_invoke_fn invoke;
  gpucoll_emu_free_fn destroy;
  if (!lookup_kernel(func, &pack, &invoke, &destroy)) return fail(cudaErrorInvalidDeviceFunction);
  if (const cudaError_t e = check_shape(grid, block, shared_bytes)) return fail(e);
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  // A stream belongs to the device that was current when it was made; launching into it from another device's
  // context is an invalid handle in CUDA.
  if (s->device != current_device()) return fail(cudaErrorInvalidResourceHandle);
  auto k = std::make_shared<Kernel>();
  k->func = func;
  k->invoke = invoke;
  k->destroy = destroy;
  k->params = pack(args);  // the parameters' values now: the caller may reuse its variables after the launch
  k->grid = grid;
  k->block = block;
  k->shared = shared_bytes;
  k->device = s->device;
  Work w;
  w.kind = Work::Kind::kKernel;
  w.kernel = std::move(k);
  return fail(submit(s, std::move(w)));
}

// ---- events -------------------------------------------------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned int flags) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (out == nullptr || (flags & ~0x7u) != 0) return fail(cudaErrorInvalidValue);
  if ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0) return fail(cudaErrorInvalidValue);
  const int device = current_device();
  touch_device(device);
  auto* ev = new Event();
  ev->device = device;
  ev->flags = flags;
  std::lock_guard<std::mutex> lock(state().mu);
  state().events.insert(ev);
  *out = reinterpret_cast<cudaEvent_t>(ev);
  return ok();
}

cudaError_t cudaEventCreate(cudaEvent_t* out) { return cudaEventCreateWithFlags(out, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (const cudaError_t err = check_init()) return fail(err);
  std::lock_guard<std::mutex> lock(state().mu);
  Event* ev = event_arg(e);
  if (ev == nullptr) return fail(cudaErrorInvalidResourceHandle);
  state().events.erase(ev);
  delete ev;  // a queued record keeps its EventRecord alive on its own
  return ok();
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t handle) {
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  Event* ev = event_arg(e);
  if (ev == nullptr || ev->device != s->device) return fail(cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) {
    if (s->capture->invalid) return fail(cudaErrorStreamCaptureInvalidated);
    // Inside a capture an event marks the capturing stream's current position in the graph being built.
    ev->capture = s->capture;
    ev->nodes = s->frontier;
    ev->record.reset();
    return ok();
  }
  if (s->legacy) {
    if (const cudaError_t le = check_legacy_use(s->device)) return fail(le);
  }
  auto rec = std::make_shared<EventRecord>();
  enqueue(s, Work{}, rec);
  ev->record = std::move(rec);
  ev->capture = nullptr;
  ev->nodes.clear();
  return ok();
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (const cudaError_t err = check_init()) return fail(err);
  std::lock_guard<std::mutex> lock(state().mu);
  Event* ev = event_arg(e);
  if (ev == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (ev->capture != nullptr) return fail(cudaErrorCapturedEvent);
  if (const cudaError_t err = check_unsafe_call()) return fail(err);
  if (!ev->record) return ok();
  return ev->record->stream->completed >= ev->record->seq ? ok() : fail(cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (const cudaError_t err = check_init()) return fail(err);
  std::unique_lock<std::mutex> lock(state().mu);
  Event* ev = event_arg(e);
  if (ev == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (ev->capture != nullptr) return fail(cudaErrorCapturedEvent);
  if (const cudaError_t err = check_unsafe_call()) return fail(err);
  if (!ev->record) return ok();
  const std::shared_ptr<EventRecord> rec = ev->record;
  wait_for(lock, rec->stream, rec->seq);
  return ok();
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (const cudaError_t err = check_init()) return fail(err);
  if (ms == nullptr) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mu);
  Event* a = event_arg(start);
  Event* b = event_arg(end);
  if (a == nullptr || b == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (a->capture != nullptr || b->capture != nullptr) return fail(cudaErrorCapturedEvent);
  if ((a->flags & cudaEventDisableTiming) != 0 || (b->flags & cudaEventDisableTiming) != 0 || !a->record ||
      !b->record) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (a->record->stream->completed < a->record->seq || b->record->stream->completed < b->record->seq) {
    return fail(cudaErrorNotReady);
  }
  *ms = static_cast<float>(static_cast<double>(static_cast<int64_t>(b->record->time_ns - a->record->time_ns)) / 1e6);
  return ok();
}

cudaError_t cudaStreamWaitEvent(cudaStream_t handle, cudaEvent_t e, unsigned int flags) {
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = stream_arg(handle, &err);
  if (s == nullptr) return fail(err);
  Event* ev = event_arg(e);
  if (ev == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return fail(cudaErrorInvalidValue);
  if (ev->capture != nullptr) {
    Capture* c = ev->capture;
    if (s->capture == nullptr) {
      // Waiting on an event recorded in a capture pulls this stream into that capture (how work forks out).
      if (s->legacy) return fail(cudaErrorStreamCaptureImplicit);
      s->capture = c;
      s->frontier = ev->nodes;
      c->members.insert(s);
      return ok();
    }
    if (s->capture != c) {
      invalidate(s->capture);
      invalidate(c);
      return fail(cudaErrorStreamCaptureMerge);
    }
    for (int n : ev->nodes) {
      if (std::find(s->frontier.begin(), s->frontier.end(), n) == s->frontier.end()) s->frontier.push_back(n);
    }
    return ok();
  }
  if (s->capture != nullptr) {
    if (!ev->record) return ok();
    // A captured stream cannot depend on work outside the capture.
    invalidate(s->capture);
    return fail(cudaErrorStreamCaptureIsolation);
  }
  if (!ev->record) return ok();
  if (s->legacy) {
    if (const cudaError_t le = check_legacy_use(s->device)) return fail(le);
  }
  enqueue(s, Work{}, nullptr, {{ev->record->stream, ev->record->seq}});
  return ok();
}

}  // extern "C"
