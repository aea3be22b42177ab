// New NCCL communicators made from an existing one: with ncclCommSplit, the blocking twin of a non-blocking init
// (GPUCOLL_NCCL_BLOCKING_OPS) and the children of Communicator.split/subgroup; with ncclCommShrink (NCCL >= 2.27),
// the communicator of the ranks that stay when others leave (Communicator.shrink, parent healthy).
//
// Why ncclCommSplit rather than a fresh init over the store: the child is set up from the parent's bootstrap and
// topology (no new unique id, no second rendezvous), and NCCL may share the parent's resources with it
// (ncclConfig_t.splitShare, off by default: a child that shares cannot outlive a parent abort). Every rank of the
// parent must call it, in the same order as its other calls; ranks that take no part pass NCCL_SPLIT_NOCOLOR and
// get no communicator.
//
// ncclCommShrink is called by the ranks that stay only, with NCCL_SHRINK_DEFAULT: gpucoll uses it when no rank saw a
// failure (a watchdog that timed out has aborted the parent, and a fresh init replaces it then).
//
// Why it is polled: the split runs in the parent's mode (init.cc hands the parent to ncclAsyncLaunch). A
// non-blocking parent returns ncclInProgress and finishes on NCCL's thread; wait_ready polls the parent under the
// timeout like init, so a rank that never calls the split is a CollectiveTimeout, not a hang. NCCL writes the child
// through the pointer when it finishes, so the slot lives on the heap: where NCCL's thread may still run, it is
// left to it (8 bytes) rather than freed under it.
#include <memory>
#include <vector>

#include "backends/nccl/cuda/nccl_comm.h"
#include "backends/nccl/cuda/nccl_comm_internal.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::nccl {

using detail::rethrow_with;

ncclComm_t NcclComm::child_locked(const char* call, const ChildStart& start, int blocking, bool want_child,
                                  const std::string& what) {
  check_usable(call);
  if (group_.depth != 0) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "", call, " inside an open group");
  cuda::DeviceGuard guard(device_);
  ncclConfig_t config = nccl_config_default();
  config.blocking = blocking;
  auto* slot = new ncclComm_t(nullptr);
  const ncclResult_t r = start(slot, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (*slot != nullptr) lib_.fn.ncclCommAbort(*slot);
    delete slot;
    try {
      nccl_check(r, call, comm_, __FILE__, __LINE__);
    } catch (const Error& e) {
      abort_locked(what + ": " + e.message());
      rethrow_with(e, what, __FILE__, __LINE__);
    }
  }
  try {
    wait_ready(call, what);
  } catch (...) {
    // On a timeout or an asynchronous error wait_ready aborted the parent, and ncclCommAbort joins NCCL's thread
    // for the split (ncclCommEnsureReady, ncclGroupJobAbort): the slot is final, and a child written there (its
    // init failed or was cut short) holds its own proxy thread, sockets and GPU memory until aborted. Otherwise
    // (an abort requested meanwhile) NCCL's thread may still write the slot: it is left to it.
    if (comm_ == nullptr) {
      if (*slot != nullptr) lib_.fn.ncclCommAbort(*slot);
      delete slot;
    }
    throw;
  }
  ncclComm_t child = *slot;
  delete slot;
  if (child == nullptr && want_child) {
    abort_locked(what + ": " + call + " finished without a communicator");
    GPUCOLL_THROW(ErrorCode::kInternal, call, what, ": NCCL finished without a communicator");
  }
  return child;
}

ncclComm_t NcclComm::split_locked(int color, int key, int blocking, const std::string& what) {
  if (lib_.fn.ncclCommSplit == nullptr) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "ncclCommSplit", "NCCL ", lib_.version_string,
                  " has no ncclCommSplit (2.18 or newer has)");
  }
  const auto start = [&](ncclComm_t* slot, ncclConfig_t* config) {
    return lib_.fn.ncclCommSplit(comm_, color, key, slot, config);
  };
  return child_locked("ncclCommSplit", start, blocking, color != kNcclSplitNoColor, what);
}

void NcclComm::split_blocking() {
  std::lock_guard<std::mutex> lock(call_mu_);
  check_usable("split_blocking");
  if (blocking_) return;
  const std::string what = "NCCL blocking split (rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) +
                           " on cuda:" + std::to_string(device_) + ")";
  ncclComm_t child = nullptr;
  try {
    child = split_locked(0, rank_, 1, what);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnsupported) throw;
    GPUCOLL_THROW(ErrorCode::kUnsupported, "ncclCommSplit", e.message(), ": its communicators stay non-blocking");
  }
  ncclComm_t parent = nullptr;
  {
    std::lock_guard<std::mutex> comm_lock(comm_mu_);
    parent = comm_;
    comm_ = child;
  }
  blocking_ = true;
  // Nothing was ever issued on the parent but its init, so destroying it has nothing to wait for.
  const ncclResult_t d = lib_.fn.ncclCommDestroy(parent);
  if (d != ncclSuccess && d != ncclInProgress) {
    GPUCOLL_WARN("ncclCommDestroy of the non-blocking parent on rank ", rank_, " returned ", nccl_result_name(d));
  }
  GPUCOLL_INFO("NCCL communicator of rank ", rank_, " is blocking (split off the non-blocking init)");
}

std::unique_ptr<NcclComm> NcclComm::split(int color, int key) {
  GPUCOLL_CHECK_ARG(color >= 0 || color == kNcclSplitNoColor, "color must be >= 0, or -1 to take no part; got ", color);
  std::lock_guard<std::mutex> lock(call_mu_);
  const std::string what = "NCCL split (rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) +
                           ", color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
  // The child keeps the parent's mode: a blocking parent (GPUCOLL_NCCL_BLOCKING_OPS) gives a blocking child.
  ncclComm_t child = split_locked(color, key, blocking_ ? 1 : 0, what);
  if (child == nullptr) return nullptr;
  return std::unique_ptr<NcclComm>(new NcclComm(child, device_, timeout_.count(), blocking_, what));
}

std::unique_ptr<NcclComm> NcclComm::shrink(const std::vector<int>& exclude) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (lib_.fn.ncclCommShrink == nullptr) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "ncclCommShrink", "NCCL ", lib_.version_string,
                  " has no ncclCommShrink (2.27 or newer has)");
  }
  for (int q : exclude) {
    GPUCOLL_CHECK_ARG(q >= 0 && q < nranks_ && q != rank_, "exclude must hold other ranks of this communicator (0 to ",
                      nranks_ - 1, ", not ", rank_, "); got ", q);
  }
  std::string what = "NCCL shrink (rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) + ", without";
  for (int q : exclude) what += " " + std::to_string(q);
  what += ")";
  std::vector<int> list(exclude);
  const auto start = [&](ncclComm_t* slot, ncclConfig_t* config) {
    return lib_.fn.ncclCommShrink(comm_, list.data(), static_cast<int>(list.size()), slot, config,
                                  kNcclShrinkDefault);
  };
  ncclComm_t child = child_locked("ncclCommShrink", start, blocking_ ? 1 : 0, true, what);
  return std::unique_ptr<NcclComm>(new NcclComm(child, device_, timeout_.count(), blocking_, what));
}

NcclComm::NcclComm(ncclComm_t adopted, int device, double timeout_s, bool blocking, const std::string& what)
    : lib_(nccl_require()), rank_(0), nranks_(0), device_(device), timeout_(timeout_s) {
  comm_ = adopted;  // owned from here: a failure below aborts it (the destructor does not run)
  blocking_ = blocking;
  try {
    cuda::DeviceGuard guard(device);
    GPUCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
    GPUCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
    // A non-blocking child may still be connecting when the parent's split reports done: NCCL's rule is to poll
    // the new communicator's own asynchronous state before using it.
    wait_ready("ncclCommSplit", what);
    GPUCOLL_NCCL_CALL(lib_, ncclCommUserRank, comm_, &rank_);
    GPUCOLL_NCCL_CALL(lib_, ncclCommCount, comm_, &nranks_);
  } catch (...) {
    abort_locked(what + ": the new communicator failed");
    throw;
  }
  GPUCOLL_INFO("NCCL communicator split off: rank ", rank_, "/", nranks_, " on cuda:", device, " (", what, ")");
}

}  // namespace gpucoll::nccl
