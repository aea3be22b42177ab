// The flight recorder and the straggler window of the custom kernels (one per CustomComm).
//
// Two halves. The host half is a FlightRecorder entry per allreduce call, begun when the call is enqueued (its
// signature, bytes, algorithm and enqueue time). The device half is a ring of CallRecords in device memory that the
// kernels fill as they run (custom_allreduce.h): when block 0 began, when each rank's barrier-0 flag came, when the
// last block ended, whether a wait timed out or the call was mismatched, and each rank's lateness. Nothing crosses to
// the host on a call's path: the host copies the ring out (its own non-blocking stream, so a hung kernel does not
// hold the copy back) only when asked, for trace() and stragglers(), and merges it into the entries then.
//
// Device times are %globaltimer; a probe kernel bracketed by the host's clock at set-up gives their offset from
// CLOCK_MONOTONIC (within half the probe's round trip, microseconds), so the entries' start and end sit on the
// same timeline as every other backend's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "check/call_sig.h"
#include "core/flight_recorder.h"
#include "core/stragglers.h"
#include "backends/custom/kernels/custom_allreduce.h"

namespace gpucoll::cuda::custom {

class KernelTrace {
 public:
  // `capacity`: the recorder's entries (GPUCOLL_TRACE_BUFFER; 0: off, and the kernels record nothing).
  KernelTrace(int nranks, int device, int capacity);
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // For AllReduceArgs: the ring (null when off) and its slots (twice the recorder's entries).
  CallRecord* records() const { return records_; }
  uint32_t record_capacity() const { return record_capacity_; }

  // The thread that makes the calls: one entry per call, numbered as its signature (sig.seq + 1).
  uint64_t begin(const algo::CallSig& sig, int64_t bytes, bool captured);
  void launch_failed(uint64_t id);

  // Any thread. The recorder's last `last` entries (0: all), with what the device recorded merged in: device start
  // and end, their host-clock times, and the state (done, failed on a timed-out wait, mismatch).
  std::vector<TraceEntry> snapshot(int last);
  int capacity() const { return recorder_.capacity(); }
  uint64_t recorded() const { return recorder_.recorded(); }
  // The straggler window (core/stragglers.h), after adding every call whose lateness the kernels have settled
  // since the last look.
  StragglerWindow::Snapshot stragglers(bool reset);
  int window() const { return window_.capacity(); }

  // Every rank's ring, for the hang report: where a peer's kernels are, read from its own device memory (mapped
  // by CUDA IPC, or a virtual rank's pointer), so a rank that cannot answer (stopped, computing, dead) is still
  // seen. `ring` null: that rank records nothing.
  void set_peer(int rank, const CallRecord* ring, uint32_t capacity);
  struct PeerCalls {
    bool known = false;       // the rank's ring is readable
    uint64_t entered = 0;     // the last call its kernels began (its number; 0: none)
    uint64_t done = 0;        // the last call its kernels finished
    double in_for_s = 0;      // how long the entered call has run, when it has not finished
    double done_ago_s = 0;    // how long ago the done one finished
  };
  // One per rank, on this rank's device clock (peers on other GPUs: as far as %globaltimer agrees across GPUs).
  // The ranks in `skip` are not read: a dead process's memory may be gone under its mapping, and a fault on a
  // real GPU would be sticky in this context.
  std::vector<PeerCalls> peer_calls(const std::vector<int>& skip);
  // GPUCOLL_STRAGGLER_REPORT: every this many calls, begin() logs the window's one-line summary (0: never). The
  // communicator sets it on rank 0 only.
  void set_report(int64_t every) { report_ = every; }

 private:
  std::vector<CallRecord> copy_records();
  void calibrate();

  int nranks_, device_;
  FlightRecorder recorder_;
  CallRecord* records_ = nullptr;
  uint32_t record_capacity_ = 0;
  uint64_t* probe_ = nullptr;  // device: the clock probe's word
  cudaStream_t stream_ = nullptr;
  int64_t offset_ns_ = 0;      // %globaltimer - CLOCK_MONOTONIC
  std::mutex mu_;              // the copy's buffer and the window's progress
  StragglerWindow window_;
  uint64_t measured_ = 0;      // the number (sig.seq + 1) of the last call added to the window
  int64_t report_ = 0;
  std::vector<std::pair<const CallRecord*, uint32_t>> peers_;  // every rank's ring and its slots
};

}  // namespace gpucoll::cuda::custom
