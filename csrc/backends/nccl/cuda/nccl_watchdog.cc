// The NCCL communicator's failure side: the watchdog's poll (progress, timeouts, asynchronous errors), abort and
// teardown. These run on the watchdog's thread or at close, never on an operation's path (nccl_comm.cc).
#include <optional>

#include "device/cuda/cuda_util.h"
#include "backends/nccl/cuda/nccl_comm.h"
#include "backends/nccl/cuda/nccl_comm_internal.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::nccl {

using detail::backoff;
using detail::guard_quietly;

PollResult NcclComm::poll() {
  PollResult out;
  out.issued = issued();
  out.usable = usable();
  const auto now = Clock::now();
  // The watchdog is a thread of its own: without a current device its first CUDA call would bind (and create)
  // device 0's context, in every rank. Set before RelaxedCaptureMode, whose runtime call would do the same.
  std::optional<cuda::DeviceGuard> guard;
  try {
    guard.emplace(device_);
  } catch (const Error& e) {
    out.async_error = ncclUnhandledCudaError;
    out.async_text = e.message();
    return out;
  }
  {
    cuda::RelaxedCaptureMode relaxed;
    std::lock_guard<std::mutex> lock(pend_mu_);
    std::deque<Pending> still;
    for (Pending& p : pending_) {
      bool done = false;
      try {
        done = p.work->query();
      } catch (const Error& e) {
        // A failing event query means the context is broken (e.g. an illegal address in some kernel).
        done = true;
        if (out.async_error == ncclSuccess) {
          out.async_error = ncclUnhandledCudaError;
          out.async_text = e.message();
        }
      }
      if (done) {
        out.completed.push_back(p.work->seq());
        for (uint64_t id : p.work->trace_ids_) trace_.end(id, TraceState::kDone, FlightRecorder::now_ns());
        continue;
      }
      if (!out.pending) {
        out.pending = true;
        out.oldest_seq = p.work->seq();
        out.oldest_what = describe(p.work->desc(), p.work->seq());
        out.oldest_age_s = std::chrono::duration<double>(now - p.work->issued_).count();
      }
      still.push_back(std::move(p));
    }
    pending_.swap(still);
  }
  // Not while the owner is in a call: once a non-blocking operation finished, ncclCommGetAsyncError joins its group
  // job and clears comm->groupJob without synchronisation (init.cc, group.cc ncclGroupJobComplete), so the owner's
  // wait_ready and this poll reading ncclSuccess at once would free the job twice. The owner's calls report
  // errors themselves; a communicator between calls is read here.
  std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
  if (!call.owns_lock()) return out;
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (comm_ != nullptr && out.usable) {
    ncclResult_t state = ncclSuccess;
    if (lib_.fn.ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      out.async_error = state;
      out.async_text = nccl_result_name(state);
      const char* text = lib_.fn.ncclGetErrorString(state);
      if (text != nullptr && text[0] != '\0') out.async_text += std::string(" (") + text + ")";
      const char* last = lib_.fn.ncclGetLastError(comm_);
      if (last != nullptr && last[0] != '\0') out.async_text += std::string("; NCCL's last error: ") + last;
    }
  }
  return out;
}

void NcclComm::abort(const std::string& why) noexcept {
  abort_requested_.store(true, std::memory_order_release);
  try {
    std::lock_guard<std::mutex> lock(call_mu_);
    abort_locked(why);
  } catch (...) {
    // std::mutex::lock can only fail on a broken system; nothing sensible is left to do.
  }
}

void NcclComm::abort_locked(const std::string& why) noexcept {
  if (state_.load() == kOpen) {
    reason_ = why;
    state_.store(kAborted, std::memory_order_release);
  }
  if (group_.depth > 0) {
    // NCCL's open group on the owning thread still refers to the communicator: abort once it ended.
    deferred_abort_ = true;
    return;
  }
  {
    // What is still in flight will never complete: the flight recorder says so before the abort releases the
    // threads waiting for it, which may read the recorder at once (a hang report).
    std::lock_guard<std::mutex> lock(pend_mu_);
    const int64_t now = FlightRecorder::now_ns();
    for (Pending& p : pending_) {
      for (uint64_t id : p.work->trace_ids_) trace_.end(id, TraceState::kFailed, now);
    }
  }
  ncclComm_t c = nullptr;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    std::swap(c, comm_);
  }
  if (c != nullptr) {
    // On the communicator's device: NCCL saves and restores the caller's device around its teardown, which on
    // the watchdog thread would otherwise be device 0 (a new context there).
    std::optional<cuda::DeviceGuard> guard;
    guard_quietly(&guard, device_);
    // ncclCommAbort also ends kernels still waiting on peers, which unblocks Work.synchronize().
    const ncclResult_t r = lib_.fn.ncclCommAbort(c);
    if (r != ncclSuccess && r != ncclInProgress) {
      GPUCOLL_WARN("ncclCommAbort on rank ", rank_, " returned ", nccl_result_name(r));
    }
  }
  std::lock_guard<std::mutex> lock(pend_mu_);
  pending_.clear();
}

bool NcclComm::drained() {
  cuda::RelaxedCaptureMode relaxed;
  std::lock_guard<std::mutex> lock(pend_mu_);
  for (Pending& p : pending_) {
    try {
      if (!p.work->query()) return false;
    } catch (const Error&) {
      return false;  // a broken context: abort rather than finalize
    }
  }
  return true;
}

void NcclComm::close() noexcept {
  try {
    std::lock_guard<std::mutex> lock(call_mu_);
    std::optional<cuda::DeviceGuard> guard;  // finalize, abort, cudaFree and the stream's destruction alike
    guard_quietly(&guard, device_);
    if (state_.load() == kOpen) {
      reason_ = "close() was called";
      state_.store(kClosed, std::memory_order_release);
      ncclComm_t c = nullptr;
      {
        std::lock_guard<std::mutex> comm_lock(comm_mu_);
        std::swap(c, comm_);
      }
      bool clean = false;
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
      int sleep_us = 10;
      // A blocking communicator's finalize waits for its operations without a bound: wait for the tracked ones
      // here (bounded), and abort instead of finalizing when they do not finish.
      bool settled = !blocking_;
      while (!settled) {
        settled = drained();
        if (settled || Clock::now() >= deadline) break;
        backoff(&sleep_us);
      }
      if (c != nullptr && group_.depth == 0 && settled) {
        // Finalize waits for the issued operations (bounded by the timeout), then destroy frees the rest.
        // On any failure the communicator is aborted instead, which never waits.
        ncclResult_t r = lib_.fn.ncclCommFinalize(c);
        ncclResult_t state = r;
        while (state == ncclInProgress && Clock::now() < deadline) {
          backoff(&sleep_us);
          if (lib_.fn.ncclCommGetAsyncError(c, &state) != ncclSuccess) state = ncclInternalError;
        }
        clean = state == ncclSuccess && lib_.fn.ncclCommDestroy(c) == ncclSuccess;
        if (!clean) {
          GPUCOLL_WARN("NCCL communicator of rank ", rank_, " did not finalize cleanly (", nccl_result_name(state),
                       "); aborting it");
        }
      }
      if (c != nullptr && !clean) lib_.fn.ncclCommAbort(c);
    } else {
      state_.store(kClosed, std::memory_order_release);
    }
    {
      std::lock_guard<std::mutex> pend_lock(pend_mu_);
      pending_.clear();
    }
    if (scratch_ != nullptr) {
      if (cudaFree(scratch_) != cudaSuccess) cudaGetLastError();
      scratch_ = nullptr;
    }
    if (internal_ != nullptr) {
      // Destroying a stream with work queued is allowed: its resources are freed when the work completes.
      if (cudaStreamDestroy(internal_) != cudaSuccess) cudaGetLastError();
      internal_ = nullptr;
    }
  } catch (...) {
    // Teardown never throws (a failed device switch or lock leaves the communicator to the process's exit).
  }
}

}  // namespace gpucoll::nccl
