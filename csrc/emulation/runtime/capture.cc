// Stream capture and graphs of the emulated runtime.
//
// While a stream captures, what is issued to it becomes a node of the capture's graph instead of running: kernels
// (with their parameters as they were at capture), copies, fills, host functions, graph launches. A node depends
// on the stream's previous node; cudaEventRecord marks a stream's position and cudaStreamWaitEvent on such an
// event forks another stream into the capture or joins it back (the only cross-stream edges). cudaStreamEndCapture
// on the origin stream returns the graph if every forked stream joined back.
//
// CUDA's rules that gpucoll's code must respect, enforced with CUDA's errors:
// - synchronising or querying a capturing stream fails (cudaErrorStreamCaptureUnsupported) and invalidates the
//   capture; so does a "potentially unsafe" call (cudaMalloc, cudaMemcpy, cudaEventQuery, cudaDeviceSynchronize,
//   ...) from a thread whose capture mode forbids it: its own non-relaxed capture, or in global mode any other
//   thread's global capture (cudaThreadExchangeStreamCaptureMode changes the thread's mode);
// - using the legacy stream while a blocking stream of the device captures fails with
//   cudaErrorStreamCaptureImplicit (it would make the legacy stream depend on the capture);
// - querying or synchronising an event recorded in a capture fails with cudaErrorCapturedEvent; a capturing stream
//   waiting for an event recorded outside the capture fails with cudaErrorStreamCaptureIsolation; two captures
//   meeting through an event fail with cudaErrorStreamCaptureMerge;
// - ending the capture elsewhere than on its origin stream fails with cudaErrorStreamCaptureUnmatched, with work
//   not joined back with cudaErrorStreamCaptureUnjoined, after any of the above with
//   cudaErrorStreamCaptureInvalidated.
//
// A graph launch runs its nodes as their dependencies finish; kernels without an edge between them run at once.
#include <algorithm>
#include <thread>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;

// Ends capture `c` for all its streams and events (under state().mu); frees it.
void finish(Capture* c) {
  State& st = state();
  for (Stream* s : c->members) {
    s->capture = nullptr;
    s->frontier.clear();
  }
  for (Event* e : st.events) {
    if (e->capture == c) {
      e->capture = nullptr;
      e->nodes.clear();
    }
  }
  st.captures.erase(c);
  delete c;
}

// Whether every forked stream's last nodes are among the origin's dependencies (ancestors or the nodes themselves).
bool joined(const Capture* c) {
  const std::vector<Node>& nodes = c->graph->nodes;
  std::vector<char> reach(nodes.size(), 0);
  std::vector<int> todo = c->origin->frontier;
  while (!todo.empty()) {
    const int n = todo.back();
    todo.pop_back();
    if (reach[n]) continue;
    reach[n] = 1;
    for (int d : nodes[n].deps) todo.push_back(d);
  }
  for (const Stream* s : c->members) {
    if (s == c->origin) continue;
    for (int n : s->frontier) {
      if (!reach[n]) return false;
    }
  }
  return true;
}

}  // namespace

void invalidate(Capture* c) {
  if (c != nullptr) c->invalid = true;
}

cudaError_t capture_work(Stream* s, Work w) {
  Capture* c = s->capture;
  if (c->invalid) return cudaErrorStreamCaptureInvalidated;
  Node n;
  n.work = std::move(w);
  n.deps = s->frontier;
  c->graph->nodes.push_back(std::move(n));
  s->frontier.assign(1, static_cast<int>(c->graph->nodes.size() - 1));
  return cudaSuccess;
}

cudaError_t check_unsafe_call() {
  if (t_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  const std::thread::id me = std::this_thread::get_id();
  bool prohibited = false;
  for (Capture* c : state().captures) {
    const bool own = c->thread == me;
    if ((own && c->mode != cudaStreamCaptureModeRelaxed) ||
        (!own && c->mode == cudaStreamCaptureModeGlobal && t_mode == cudaStreamCaptureModeGlobal)) {
      invalidate(c);
      prohibited = true;
    }
  }
  return prohibited ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t check_legacy_use(int device) {
  for (Stream* s : state().all) {
    if (s->device == device && s->blocking && !s->legacy && s->capture != nullptr) {
      invalidate(s->capture);
      return cudaErrorStreamCaptureImplicit;
    }
  }
  return cudaSuccess;
}

void run_graph(const GraphExec& g) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> waiting(n);
  std::vector<std::vector<int>> children(n);
  for (int i = 0; i < n; ++i) {
    waiting[i] = static_cast<int>(g.nodes[i].deps.size());
    for (int d : g.nodes[i].deps) children[d].push_back(i);
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> ready, finished;
  for (int i = 0; i < n; ++i) {
    if (waiting[i] == 0) ready.push_back(i);
  }
  int done = 0;
  std::unique_lock<std::mutex> lock(mu);
  while (done < n) {
    std::vector<int> start;
    start.swap(ready);
    lock.unlock();
    for (int i : start) {
      const Work& w = g.nodes[i].work;
      if (w.kind == Work::Kind::kKernel) {
        submit_grid(w.kernel, [&mu, &cv, &finished, i] {
          std::lock_guard<std::mutex> l(mu);
          finished.push_back(i);
          cv.notify_all();
        });
      } else {
        run_work(w);
        std::lock_guard<std::mutex> l(mu);
        finished.push_back(i);
      }
    }
    lock.lock();
    cv.wait(lock, [&] { return !finished.empty(); });
    for (int i : finished) {
      ++done;
      for (int c : children[i]) {
        if (--waiting[c] == 0) ready.push_back(c);
      }
    }
    finished.clear();
  }
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t handle, cudaStreamCaptureMode mode) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return fail(cudaErrorInvalidValue);
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  cudaError_t err = cudaSuccess;
  Stream* s = resolve_stream(handle, &err);
  if (s == nullptr) return fail(err);
  if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot be captured
  if (s->capture != nullptr) return fail(cudaErrorIllegalState);
  auto* c = new Capture();
  c->graph = new Graph();
  c->origin = s;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->members.insert(s);
  st.captures.insert(c);
  s->capture = c;
  s->frontier.clear();
  return ok();
}

cudaError_t cudaStreamEndCapture(cudaStream_t handle, cudaGraph_t* out) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (out == nullptr) return fail(cudaErrorInvalidValue);
  *out = nullptr;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  cudaError_t err = cudaSuccess;
  Stream* s = resolve_stream(handle, &err);
  if (s == nullptr) return fail(err);
  Capture* c = s->capture;
  if (c == nullptr) return fail(cudaErrorIllegalState);
  if (c->origin != s) {
    invalidate(c);
    return fail(cudaErrorStreamCaptureUnmatched);
  }
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
    return fail(cudaErrorStreamCaptureWrongThread);
  }
  cudaError_t result = cudaSuccess;
  if (c->invalid) {
    result = cudaErrorStreamCaptureInvalidated;
  } else if (!joined(c)) {
    result = cudaErrorStreamCaptureUnjoined;
  }
  if (result == cudaSuccess) {
    st.graphs.insert(c->graph);
    *out = reinterpret_cast<cudaGraph_t>(c->graph);
  } else {
    delete c->graph;
  }
  finish(c);
  return fail(result);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t handle, cudaStreamCaptureStatus* status) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (status == nullptr) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mu);
  cudaError_t err = cudaSuccess;
  Stream* s = resolve_stream(handle, &err);
  if (s == nullptr) return fail(err);
  if (s->legacy) {
    for (Stream* t : state().all) {
      if (t->device == s->device && t->blocking && !t->legacy && t->capture != nullptr &&
          t->capture->mode != cudaStreamCaptureModeRelaxed) {
        return fail(cudaErrorStreamCaptureImplicit);
      }
    }
  }
  *status = s->capture == nullptr ? cudaStreamCaptureStatusNone
            : s->capture->invalid ? cudaStreamCaptureStatusInvalidated
                                  : cudaStreamCaptureStatusActive;
  return ok();
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr) return fail(cudaErrorInvalidValue);
  if (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
      *mode != cudaStreamCaptureModeRelaxed) {
    return fail(cudaErrorInvalidValue);
  }
  std::swap(*mode, t_mode);
  return ok();
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* out, cudaGraph_t graph, unsigned long long flags) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (out == nullptr || flags != 0) return fail(cudaErrorInvalidValue);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  Graph* g = reinterpret_cast<Graph*>(graph);
  if (st.graphs.count(g) == 0) return fail(cudaErrorInvalidValue);
  auto* h = new GraphExecHandle();
  h->exec = std::make_shared<GraphExec>();
  h->exec->nodes = g->nodes;
  st.execs.insert(h);
  *out = reinterpret_cast<cudaGraphExec_t>(h);
  return ok();
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t handle) {
  if (const cudaError_t e = check_init()) return fail(e);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* h = reinterpret_cast<GraphExecHandle*>(exec);
  if (st.execs.count(h) == 0) return fail(cudaErrorInvalidValue);
  cudaError_t err = cudaSuccess;
  Stream* s = resolve_stream(handle, &err);
  if (s == nullptr) return fail(err);
  Work w;
  w.kind = Work::Kind::kGraph;
  w.exec = h->exec;
  if (s->capture != nullptr) return fail(capture_work(s, std::move(w)));
  if (s->legacy) {
    if (const cudaError_t e = check_legacy_use(s->device)) return fail(e);
  }
  enqueue(s, std::move(w));
  return ok();
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (const cudaError_t e = check_init()) return fail(e);
  std::lock_guard<std::mutex> lock(state().mu);
  Graph* g = reinterpret_cast<Graph*>(graph);
  if (state().graphs.erase(g) == 0) return fail(cudaErrorInvalidValue);
  delete g;
  return ok();
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (const cudaError_t e = check_init()) return fail(e);
  std::lock_guard<std::mutex> lock(state().mu);
  auto* h = reinterpret_cast<GraphExecHandle*>(exec);
  if (state().execs.erase(h) == 0) return fail(cudaErrorInvalidValue);
  delete h;
  return ok();
}

}  // extern "C"
