#include "backends/nccl/cuda/nccl_comm.h"

#include <algorithm>
#include <optional>
#include <thread>

#include "algo/registry.h"
#include "backends/nccl/nccl_features.h"
#include "device/cuda/cuda_util.h"
#include "backends/nccl/cuda/nccl_comm_internal.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::nccl {

using detail::backoff;
using detail::guard_quietly;
using detail::rethrow_with;

namespace {

// NCCL >= 2.23 hands every operation of a non-blocking communicator to a new thread and returns ncclInProgress
// (group.cc, ncclGroupEndInternal), so wait_ready() is on every call's path, not only connection setup. That
// launch usually lands within tens of microseconds, less than the shortest sleep (Linux adds its 50 us timer
// slack to each), so polls yield the core for this long before backing off.
constexpr std::chrono::microseconds kSpinFor{200};

std::string seconds(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

}  // namespace

std::string describe(const OpDesc& d, uint64_t seq) {
  std::string s = std::string(d.name) + " #" + std::to_string(seq);
  if (d.nested > 1) return s + " (a group of " + std::to_string(d.nested) + " operations)";
  if (std::string(d.name) == "send" || std::string(d.name) == "recv") {
    return s + " (" + std::to_string(d.count) + " bytes " + (d.name[0] == 's' ? "to" : "from") + " rank " +
           std::to_string(d.peer) + ")";
  }
  s += std::string(" (") + dtype_name(d.dtype) + " x " + std::to_string(d.count);
  if (d.peer >= 0) s += ", root " + std::to_string(d.peer);
  return s + ")";
}

Event::~Event() { cuda::event_put(device_, event_); }

bool Work::query() {
  if (done_.load(std::memory_order_acquire)) return true;
  const State state = this->state();
  if (state == State::kInGroup) return false;
  if (state == State::kCaptured) return true;
  cuda::RelaxedCaptureMode relaxed;
  const cudaError_t err = cudaEventQuery(event_->get());
  if (err == cudaSuccess) {
    done_.store(true, std::memory_order_release);
    return true;
  }
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // not an error, but the runtime records it as the last one
    return false;
  }
  cuda::throw_cuda(err, "cudaEventQuery", __FILE__, __LINE__);
}

void Work::wait_on(cudaStream_t stream) {
  const State state = this->state();
  if (state == State::kInGroup) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, "", "wait() on ", describe(desc_, seq_),
                  " inside the group that issued it: it launches when the group ends");
  }
  if (state == State::kCaptured || done_.load(std::memory_order_acquire)) return;
  // A wait on an event from outside a capture would put an eager dependency into a graph: the operation
  // was issued before the capture began, which the capture's own ordering already covers.
  if (cuda::stream_is_capturing(stream)) return;
  GPUCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, event_->get(), 0));
}

void Work::synchronize() {
  const State state = this->state();
  if (state == State::kInGroup) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, "", "synchronize() on ", describe(desc_, seq_),
                  " inside the group that issued it: it launches when the group ends");
  }
  if (state == State::kCaptured || done_.load(std::memory_order_acquire)) return;
  // Cannot hang for good: a stuck collective is aborted by the watchdog, which ends its kernels.
  cuda::RelaxedCaptureMode relaxed;
  GPUCOLL_CUDA_CHECK(cudaEventSynchronize(event_->get()));
  done_.store(true, std::memory_order_release);
}

NcclComm::NcclComm(const ncclUniqueId& id, int nranks, int rank, int device, double timeout_s)
    : lib_(nccl_require()), rank_(rank), nranks_(nranks), device_(device), timeout_(timeout_s) {
  GPUCOLL_CHECK_ARG(nranks >= 1, "nranks must be >= 1; got ", nranks);
  GPUCOLL_CHECK_ARG(rank >= 0 && rank < nranks, "rank must be in [0, ", nranks, "); got ", rank);
  GPUCOLL_CHECK_ARG(device >= 0, "device must be a CUDA device index >= 0; got ", device);
  GPUCOLL_CHECK_ARG(timeout_s > 0, "timeout must be positive; got ", timeout_s);
  // NCCL binds the communicator to the current device.
  cuda::DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
  GPUCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
  ncclConfig_t config = nccl_config_default();
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = lib_.fn.ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  comm_ = comm;
  const std::string what = "NCCL communicator init (rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                           " on cuda:" + std::to_string(device) + ")";
  try {
    if (r != ncclSuccess && r != ncclInProgress) {
      try {
        nccl_check(r, "ncclCommInitRankConfig", comm, __FILE__, __LINE__);
      } catch (const Error& e) {
        rethrow_with(e, what, __FILE__, __LINE__);
      }
    }
    wait_ready("ncclCommInitRankConfig", what);
  } catch (...) {
    abort_locked("init failed");
    throw;
  }
  GPUCOLL_INFO("NCCL communicator ready: rank ", rank, "/", nranks, " on cuda:", device, " (NCCL ",
               lib_.version_string, ")");
}

NcclComm::~NcclComm() { close(); }

bool NcclComm::native(algo::Coll c) const {
  switch (c) {
    case algo::Coll::kAllToAll:
      return prefer_native_ && lib_.fn.ncclAlltoAll != nullptr;
    case algo::Coll::kGather:
      return prefer_native_ && lib_.fn.ncclGather != nullptr;
    case algo::Coll::kScatter:
      return prefer_native_ && lib_.fn.ncclScatter != nullptr;
    default:
      return true;
  }
}

uintptr_t NcclComm::scratch() {
  std::lock_guard<std::mutex> lock(call_mu_);
  check_usable("barrier");
  if (scratch_ == nullptr) {
    cuda::DeviceGuard guard(device_);
    GPUCOLL_CUDA_CHECK(cudaMalloc(&scratch_, 16));
    GPUCOLL_CUDA_CHECK(cudaMemset(scratch_, 0, 16));
  }
  return reinterpret_cast<uintptr_t>(scratch_);
}

std::string NcclComm::reason() {
  std::lock_guard<std::mutex> lock(call_mu_);
  return reason_;
}

void NcclComm::check_usable(const char* what) const {
  const int s = state_.load(std::memory_order_acquire);
  if (s == kOpen) return;
  GPUCOLL_THROW(ErrorCode::kInvalidUsage, "", what, " on an NCCL communicator that was ",
                s == kClosed ? "closed" : "aborted", " (", reason_, ")");
}

void NcclComm::wait_ready(const char* call, const std::string& what) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(timeout_);
  int sleep_us = 10;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = lib_.fn.ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) {
      try {
        nccl_check(r, "ncclCommGetAsyncError", comm_, __FILE__, __LINE__);
      } catch (const Error& e) {
        abort_locked(e.message());
        rethrow_with(e, what, __FILE__, __LINE__);
      }
    }
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      // An asynchronous failure: NCCL requires the communicator to be aborted after one.
      try {
        nccl_check(state, call, comm_, __FILE__, __LINE__);
      } catch (const Error& e) {
        abort_locked(e.message());
        rethrow_with(e, what, __FILE__, __LINE__);
      }
    }
    if (abort_requested_.load(std::memory_order_acquire)) {
      GPUCOLL_THROW(ErrorCode::kInvalidUsage, call, what, " was interrupted: the communicator is being aborted");
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      const std::string msg = what + ": NCCL did not finish " + call + " within the timeout of " +
                              seconds(timeout_.count()) + " (ncclCommGetAsyncError still says ncclInProgress)";
      abort_locked(msg);
      throw Error(ErrorCode::kTimeout, msg + "; the communicator was aborted", call, __FILE__, __LINE__);
    }
    if (now - start < kSpinFor) {
      std::this_thread::yield();
    } else {
      backoff(&sleep_us);
    }
  }
}

void NcclComm::settle(ncclResult_t r, const char* call, const std::string& what) {
  if (r == ncclSuccess) return;
  if (r == ncclInProgress) {
    wait_ready(call, what);
    return;
  }
  // Returned at once: an argument or usage error. NCCL also stores it as a non-blocking communicator's
  // asynchronous error (ncclEnqueueCheck's failure path), after which every later call on the communicator fails
  // with it: such a communicator is aborted here, so that later calls name this error instead of NCCL's echo.
  try {
    nccl_check(r, call, comm_, __FILE__, __LINE__);
  } catch (const Error& e) {
    // A blocking communicator returns every error at once and keeps none (ncclEnqueueCheck and groupCleanup set
    // the asynchronous error of non-blocking ones only): past an argument or usage error (a failed connection,
    // a remote or CUDA error) NCCL requires the abort all the same.
    if (blocking_ && r != ncclInvalidArgument && r != ncclInvalidUsage) {
      abort_locked(what + ": " + e.message());
      throw Error(e.code(), what + ": " + e.message() + "; the NCCL communicator was aborted", e.call(), __FILE__,
                  __LINE__, e.ranks());
    }
    ncclResult_t state = ncclSuccess;
    if (comm_ != nullptr && lib_.fn.ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      abort_locked(what + ": " + e.message());
      throw Error(e.code(), what + ": " + e.message() + "; NCCL keeps this error on the communicator: aborted",
                  e.call(), __FILE__, __LINE__, e.ranks());
    }
    rethrow_with(e, what, __FILE__, __LINE__);
  }
}

cudaStream_t NcclComm::fork_internal(cudaStream_t from) {
  if (internal_ == nullptr) GPUCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&internal_, cudaStreamNonBlocking));
  cuda::stream_wait_stream(internal_, from, device_);
  return internal_;
}

void NcclComm::send_recv_group(const std::vector<P2PArgs>& ops, ncclDataType_t dt, size_t es, cudaStream_t s,
                               const std::string& what) {
  // Every started group must be ended, also after a failed call inside it: NCCL's group depth is per thread.
  GPUCOLL_NCCL_CALL(lib_, ncclGroupStart);
  ncclResult_t first = ncclSuccess;
  const char* first_call = "ncclGroupEnd";
  for (const P2PArgs& op : ops) {
    const size_t count = op.bytes / es;
    const ncclResult_t r = op.send ? lib_.fn.ncclSend(op.buf, count, dt, op.peer, comm_, s)
                                   : lib_.fn.ncclRecv(op.buf, count, dt, op.peer, comm_, s);
    if (r != ncclSuccess && r != ncclInProgress && first == ncclSuccess) {
      first = r;
      first_call = op.send ? "ncclSend" : "ncclRecv";
    }
  }
  const ncclResult_t end = lib_.fn.ncclGroupEnd();
  settle(first != ncclSuccess ? first : end, first != ncclSuccess ? first_call : "ncclGroupEnd", what);
}

void NcclComm::enqueue(const CollArgs& a, ncclRedOp_t op, cudaStream_t s, const std::string& what) {
  const ncclDataType_t dt = to_nccl(a.dtype);
  const size_t es = dtype_size(a.dtype);
  const size_t block = a.count * es;
  auto at = [](const void* p, size_t off) { return static_cast<char*>(const_cast<void*>(p)) + off; };
  const auto& fn = lib_.fn;
  switch (a.coll) {
    case algo::Coll::kAllReduce:
      return settle(fn.ncclAllReduce(a.in, a.out, a.count, dt, op, comm_, s), "ncclAllReduce", what);
    case algo::Coll::kBroadcast:
      return settle(fn.ncclBroadcast(a.in, a.out, a.count, dt, a.root, comm_, s), "ncclBroadcast", what);
    case algo::Coll::kReduce:
      return settle(fn.ncclReduce(a.in, a.out, a.count, dt, op, a.root, comm_, s), "ncclReduce", what);
    case algo::Coll::kAllGather:
      return settle(fn.ncclAllGather(a.in, a.out, a.count, dt, comm_, s), "ncclAllGather", what);
    case algo::Coll::kReduceScatter:
      return settle(fn.ncclReduceScatter(a.in, a.out, a.count, dt, op, comm_, s), "ncclReduceScatter", what);
    case algo::Coll::kAllToAll: {
      if (native(a.coll)) {
        return settle(fn.ncclAlltoAll(a.in, a.out, a.count, dt, comm_, s), "ncclAlltoAll", what);
      }
      // NCCL < 2.28: block p goes to rank p, block p comes from rank p (itself included: NCCL copies locally).
      std::vector<P2PArgs> ops;
      ops.reserve(2 * static_cast<size_t>(nranks_));
      for (int p = 0; p < nranks_; ++p) {
        ops.push_back(P2PArgs{true, p, at(a.in, p * block), block});
        ops.push_back(P2PArgs{false, p, at(a.out, p * block), block});
      }
      return send_recv_group(ops, dt, es, s, what);
    }
    case algo::Coll::kGather: {
      if (native(a.coll)) {
        return settle(fn.ncclGather(a.in, a.out, a.count, dt, a.root, comm_, s), "ncclGather", what);
      }
      std::vector<P2PArgs> ops;
      if (rank_ == a.root) {
        for (int p = 0; p < nranks_; ++p) ops.push_back(P2PArgs{false, p, at(a.out, p * block), block});
      }
      ops.push_back(P2PArgs{true, a.root, const_cast<void*>(a.in), block});
      return send_recv_group(ops, dt, es, s, what);
    }
    case algo::Coll::kScatter: {
      if (native(a.coll)) {
        return settle(fn.ncclScatter(a.in, a.out, a.count, dt, a.root, comm_, s), "ncclScatter", what);
      }
      std::vector<P2PArgs> ops;
      if (rank_ == a.root) {
        for (int p = 0; p < nranks_; ++p) ops.push_back(P2PArgs{true, p, at(a.in, p * block), block});
      }
      ops.push_back(P2PArgs{false, a.root, a.out, block});
      return send_recv_group(ops, dt, es, s, what);
    }
  }
  GPUCOLL_INVALID_ARG("unknown collective id ", static_cast<int>(a.coll));
}

std::shared_ptr<Work> NcclComm::collective(const CollArgs& a, cudaStream_t stream, bool async_op) {
  const OpDesc d{algo::coll_name(a.coll), a.dtype, a.count, algo::coll_is_rooted(a.coll) ? a.root : -1, 0};
  std::lock_guard<std::mutex> lock(call_mu_);
  check_usable(d.name);
  nccl_check_dtype(a.dtype, lib_.version);
  // NCCL refuses fp8 reductions below sm_90 with ncclInvalidArgument, which would also poison the communicator
  // (see settle); data movement in fp8 works on any GPU. Checked on this rank's GPU, NCCL checks every rank's.
  if (dtype_is_fp8(a.dtype) && algo::coll_reduces(a.coll) && cc_major_ < 9) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "", d.name, " on ", dtype_name(a.dtype),
                  " needs a GPU of compute capability 9.0 or newer (NCCL reduces fp8 only there); cuda:", device_,
                  " is ", cc_major_, ".", cc_minor_,
                  ". all_gather, broadcast, all_to_all, gather, scatter and send/recv move fp8 on any GPU.");
  }
  GPUCOLL_CHECK_ARG(!a.premul || algo::coll_reduces(a.coll), "premul_sum applies to all_reduce, reduce and "
                    "reduce_scatter; got it for ", d.name);
  GPUCOLL_CHECK_ARG(!algo::coll_is_rooted(a.coll) || (a.root >= 0 && a.root < nranks_), "root must be in [0, ", nranks_,
                    "); got ", a.root);
  cuda::DeviceGuard guard(device_);
  const bool capturing = cuda::stream_is_capturing(stream);
  // Inside a capture the operation stays on the capturing stream: forking would need the fork joined back
  // before the capture ends, which only the caller could do.
  cudaStream_t s = (async_op && !capturing) ? fork_internal(stream) : stream;
  const uint64_t seq = issued_.fetch_add(1, std::memory_order_relaxed) + 1;
  const std::string what = describe(d, seq);

  ncclRedOp_t op = to_nccl(a.op);
  if (a.premul) {
    unsigned char scalar[8];
    premul_scalar_bytes(a.dtype, a.premul_scalar, scalar);
    // Host-immediate: NCCL copies the scalar now, so the op (and a graph that captured it) needs no memory
    // of ours afterwards.
    settle(lib_.fn.ncclRedOpCreatePreMulSum(&op, scalar, to_nccl(a.dtype), ncclScalarHostImmediate, comm_),
           "ncclRedOpCreatePreMulSum", what);
  }
  // The signature's seq numbers the collectives alone (seq counts sends and receives too, which ranks make in
  // different numbers): what lines ranks' entries up, in stragglers() and in merged dumps.
  const uint64_t coll_seq = ++collectives_;
  const uint64_t tid = trace_begin(
      seq, algo::make_call_sig(static_cast<uint32_t>(coll_seq), static_cast<int32_t>(a.coll),
                               static_cast<int32_t>(a.dtype), a.premul ? algo::kSigPremulSum : static_cast<int32_t>(a.op),
                               a.root, static_cast<int64_t>(a.count), -1, 0, false),
      static_cast<int64_t>(a.count * dtype_size(a.dtype)));
  try {
    enqueue(a, op, s, what);
  } catch (...) {
    trace_.end(tid, TraceState::kFailed, FlightRecorder::now_ns());
    if (a.premul && comm_ != nullptr) lib_.fn.ncclRedOpDestroy(op, comm_);
    throw;
  }
  if (a.premul) {
    // "An operator may be destroyed as soon as the last NCCL function which is given that operator returns";
    // inside a group gpucoll still waits for the group to end, to be safe with older releases.
    if (group_.depth > 0) {
      group_.premul_ops.push_back(op);
    } else {
      lib_.fn.ncclRedOpDestroy(op, comm_);
    }
  }
  return finish(seq, d, s, capturing, async_op, tid);
}

uint64_t NcclComm::trace_begin(uint64_t seq, const algo::CallSig& sig, int64_t bytes) {
  return trace_.begin(seq, sig, bytes, TraceBackend::kNccl, FlightRecorder::now_ns(), 0);
}

std::shared_ptr<Work> NcclComm::p2p(const std::vector<P2PArgs>& ops, cudaStream_t stream, bool async_op) {
  if (ops.empty()) return nullptr;
  size_t bytes = 0;
  for (const P2PArgs& op : ops) bytes += op.bytes;
  OpDesc d{ops.size() == 1 ? (ops[0].send ? "send" : "recv") : "send/recv", DType::kU8, bytes,
           ops.size() == 1 ? ops[0].peer : -1, ops.size() == 1 ? 0 : static_cast<int>(ops.size())};
  std::lock_guard<std::mutex> lock(call_mu_);
  check_usable(d.name);
  for (const P2PArgs& op : ops) {
    GPUCOLL_CHECK_ARG(op.peer >= 0 && op.peer < nranks_, "peer must be in [0, ", nranks_, "); got ", op.peer);
  }
  cuda::DeviceGuard guard(device_);
  const bool capturing = cuda::stream_is_capturing(stream);
  cudaStream_t s = (async_op && !capturing) ? fork_internal(stream) : stream;
  const uint64_t seq = issued_.fetch_add(1, std::memory_order_relaxed) + 1;
  algo::CallSig sig{};
  sig.seq = static_cast<uint32_t>(seq);
  sig.coll = kTraceP2P;
  sig.count = static_cast<int64_t>(ops.size());
  sig.root = ops.size() == 1 ? ops[0].peer : -2;
  sig.dtype = sig.op = sig.algo = algo::kSigNone;
  int64_t sent = 0;
  for (const P2PArgs& op : ops) sent += op.send ? static_cast<int64_t>(op.bytes) : 0;
  const uint64_t tid = trace_begin(seq, sig, sent);
  try {
    send_recv_group(ops, ncclUint8, 1, s, describe(d, seq));
  } catch (...) {
    trace_.end(tid, TraceState::kFailed, FlightRecorder::now_ns());
    throw;
  }
  return finish(seq, d, s, capturing, async_op, tid);
}

std::shared_ptr<Work> NcclComm::finish(uint64_t seq, const OpDesc& d, cudaStream_t s, bool capturing,
                                       bool async_op, uint64_t trace_id) {
  if (group_.depth > 0) {
    group_.trace_ids.emplace_back(trace_id, s);
    if (group_.nops++ == 0) group_.first = d;
    group_.last_seq = seq;
    const auto used = std::make_pair(s, capturing);
    if (std::find(group_.streams.begin(), group_.streams.end(), used) == group_.streams.end()) {
      group_.streams.push_back(used);
    }
    if (!async_op) return nullptr;
    auto w = std::make_shared<Work>(seq, d);
    group_.works.emplace_back(w, s);
    return w;
  }
  auto w = std::make_shared<Work>(seq, d);
  w->trace_ids_.push_back(trace_id);
  track(w, s, capturing);
  return async_op ? w : nullptr;
}

void NcclComm::track(const std::shared_ptr<Work>& w, cudaStream_t s, bool capturing) {
  w->issued_ = Clock::now();
  if (capturing) {
    for (uint64_t id : w->trace_ids_) trace_.end(id, TraceState::kCaptured, FlightRecorder::now_ns());
    w->state_.store(Work::State::kCaptured, std::memory_order_release);
    return;
  }
  cudaEvent_t e = cuda::event_get(device_);
  const cudaError_t err = cudaEventRecord(e, s);
  if (err != cudaSuccess) {
    cuda::event_put(device_, e);
    cuda::throw_cuda(err, "cudaEventRecord (after the NCCL operation)", __FILE__, __LINE__);
  }
  w->event_ = std::make_shared<Event>(device_, e);
  w->state_.store(Work::State::kLaunched, std::memory_order_release);
  std::lock_guard<std::mutex> lock(pend_mu_);
  pending_.push_back(Pending{w});
}

void NcclComm::group_start() {
  std::lock_guard<std::mutex> lock(call_mu_);
  check_usable("group");
  GPUCOLL_NCCL_CALL(lib_, ncclGroupStart);
  ++group_.depth;
}

void NcclComm::group_end() {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (group_.depth <= 0) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "ncclGroupEnd", "group end without a group start");
  // The whole of it on the communicator's device: track() below takes pooled events of device_ and records them
  // on the group's streams, which fails (cudaErrorInvalidResourceHandle) from another current device.
  // Quietly: a failed switch must not skip the ncclGroupEnd below (track() then reports the CUDA error).
  std::optional<cuda::DeviceGuard> guard;
  guard_quietly(&guard, device_);
  // Always end NCCL's group (its depth is per thread and must balance), even on an aborted communicator.
  const ncclResult_t r = lib_.fn.ncclGroupEnd();
  if (--group_.depth > 0) {
    if (r != ncclSuccess && r != ncclInProgress) nccl_check(r, "ncclGroupEnd", comm_, __FILE__, __LINE__);
    return;
  }
  Group g = std::move(group_);
  group_ = Group{};
  const OpDesc gd = g.nops == 1 ? g.first : OpDesc{"group", DType::kU8, 0, -1, g.nops};
  const std::string what = describe(gd, g.last_seq);
  if (deferred_abort_) {
    // abort() came while the group was open; NCCL's group is now balanced, so it can run.
    deferred_abort_ = false;
    abort_locked(reason_);
    check_usable("group");
  }
  try {
    settle(r, "ncclGroupEnd", what);
  } catch (...) {
    for (const auto& [id, us] : g.trace_ids) trace_.end(id, TraceState::kFailed, FlightRecorder::now_ns());
    if (comm_ != nullptr) {
      for (ncclRedOp_t op : g.premul_ops) lib_.fn.ncclRedOpDestroy(op, comm_);
    }
    throw;
  }
  for (ncclRedOp_t op : g.premul_ops) lib_.fn.ncclRedOpDestroy(op, comm_);
  if (g.nops == 0) return;
  // One completion event per stream the group used; async Works on that stream share it.
  for (const auto& [s, capturing] : g.streams) {
    auto w = std::make_shared<Work>(g.last_seq, gd);
    for (const auto& [id, us] : g.trace_ids) {
      if (us == s) w->trace_ids_.push_back(id);
    }
    track(w, s, capturing);
    for (auto& [uw, us] : g.works) {
      if (us != s) continue;
      uw->event_ = w->event_;
      uw->issued_ = w->issued_;
      uw->state_.store(w->state(), std::memory_order_release);
    }
  }
}

}  // namespace gpucoll::nccl
