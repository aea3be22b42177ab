// One rank of gpucoll's own allreduce over peer memory: its memory, its peers' mappings, registered buffers,
// and the launch of one call (algorithm, launch shape, pieces). Bound as gpucoll._C.CustomComm; the Python side
// (gpucoll/backends/custom.py, gpucoll/testing.py) does the rendezvous, eligibility and NCCL fallback.
//
// Two ways to connect P ranks:
//   connect_ipc    one process per rank (several GPUs, or several processes on one GPU): handles exchanged
//                  through the rendezvous store, opened with cudaIpcOpenMemHandle. `co_resident` ranks share this
//                  rank's GPU: under CUDA MPS their kernels run at once, so their grids are capped as below.
//   connect_local  P communicators in one process (virtual ranks on one GPU): plain pointers. All P ranks'
//                  blocks spin on each other, so they must all be resident at once: the grid of each rank is
//                  capped at max_blocks_per_rank(P, SMs, occupancy) and check_residency raises past that.
//
// Calls on one communicator must be ordered (one stream at a time, as with NCCL): the call counter in the
// signal area assumes kernels of a communicator never overlap.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/custom/launch_shape.h"
#include "backends/custom/cuda/kernel_trace.h"
#include "backends/custom/cuda/peer_memory.h"
#include "core/types.h"
#include "backends/custom/kernels/custom_allreduce.h"

namespace gpucoll::cuda::custom {

using gpucoll::custom::Algo;

// Registered-buffer slots per communicator (each a PeerTable of 64 bytes in device memory).
constexpr int kMaxRegistered = 1024;

class CustomComm {
 public:
  CustomComm(int rank, int nranks, int device, size_t half_bytes, double timeout_s);
  ~CustomComm();
  CustomComm(const CustomComm&) = delete;
  CustomComm& operator=(const CustomComm&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int device() const { return device_; }
  int sms() const { return sms_; }
  size_t half_bytes() const { return mem_ ? mem_->half_bytes() : 0; }
  bool connected() const { return connected_; }

  std::string ipc_handle() const;
  // `handles[q]` is rank q's ipc_handle() (this rank's own entry is not opened). `min_sms` is the smallest SM
  // count of all ranks: every rank must pick the same grid for the same call.
  void connect_ipc(const std::vector<std::string>& handles, int min_sms, int co_resident = 1);
  // `comms[q]` is rank q (this one included), all on this communicator's device, in this process.
  void connect_local(const std::vector<CustomComm*>& comms);
  // This rank's row of the P2P matrix: row[q] = 1 when a real copy through the mapping of rank q's memory read
  // back the pattern q wrote. Measured once at connect, then cached.
  const std::vector<uint8_t>& p2p_row() const { return p2p_row_; }

  // Registration. export_buffer gives what peers need to map `ptr` (IPC mode); register_* commit one buffer
  // on every rank in the same order. A call whose input pointer equals a registered pointer (and fits its
  // size) reads every rank's input in place instead of staging it.
  ExportedRange export_buffer(uintptr_t ptr) const;
  void register_ipc(uintptr_t ptr, size_t bytes, const std::vector<ExportedRange>& peers);
  void register_local(uintptr_t ptr, size_t bytes, const std::vector<uintptr_t>& peer_ptrs);
  bool is_registered(uintptr_t ptr, size_t bytes) const;
  size_t registered_bytes(uintptr_t ptr) const;  // 0 when not registered
  // CUDA graphs: while `defer` is on, an unregistered input of a call made during stream capture gets a slot
  // whose peer table is filled in after capture (register_pending_*), so the captured kernel reads in place.
  void set_defer_registration(bool defer) { defer_ = defer; }
  std::vector<std::pair<uintptr_t, size_t>> pending() const;
  void register_pending_ipc(const std::vector<std::vector<ExportedRange>>& peers);  // [pending i][rank q]
  void register_pending_local(const std::vector<std::vector<uintptr_t>>& peer_ptrs);

  // Enqueue an allreduce of `count` elements on `stream`. max_blocks caps the grid (0: the residency cap of
  // virtual ranks, or SM count). Messages larger than a staging half run as several kernels ("pieces"); returns
  // how many. only_piece >= 0 enqueues that piece alone: virtual ranks enqueue piece i of every rank before piece
  // i + 1 of any, because rank 0's piece 1 queued ahead of rank 1's piece 0 deadlocks wherever two ranks'
  // streams share a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS) or the launch queue fills.
  size_t all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Algo algo, cudaStream_t stream,
                    int max_blocks = 0, int64_t only_piece = -1);
  // all_reduce(compress=wire) (kernels/compressed.cu): float32/float16/bfloat16, sum or avg, in pieces of whole
  // quant blocks, always staged. Raises InvalidArgument for another dtype or op, Unsupported where the kernels can
  // never run on this communicator (set_placement): NCCL has no compressed path to fall back on.
  void compressed_all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Wire wire,
                             cudaStream_t stream);
  // One allreduce from end to end, the backend's whole call path in one crossing: the per-call half of the
  // eligibility (the placement half was settled by set_placement), the algorithm ("auto": the size rule of
  // launch_shape.h; else that name), then all_reduce above. Returns "" when enqueued, else why the kernels
  // decline it (the caller hands the call to NCCL). Every such reason is the same on every rank; the one that is
  // not, a misaligned pointer, raises InvalidArgument instead, so that ranks never split between two backends.
  std::string run_all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, bool premul,
                             const std::string& algo, cudaStream_t stream);
  // What the ranks agreed at set-up: every rank's host and the P2P matrix (eligibility.h's placement facts).
  // Returns why the kernels can never run on this communicator ("" when they can).
  std::string set_placement(const std::vector<std::string>& hosts, const std::vector<uint8_t>& p2p);
  // The launch shape a call would use (for tests and the benchmark).
  gpucoll::custom::LaunchShape shape_for(Algo algo, size_t bytes, DType dtype, RedOp op) const;

  // Non-zero once a barrier wait timed out (reads the signal area; synchronises the device).
  uint32_t timed_out() const;
  // Raises InvalidArgument (call_mismatch_message of every rank's signature, ranks() those differing from rank 0)
  // once for each call whose kernel found that ranks made different calls (open_call in backends/custom/kernels/peer_sync.cuh),
  // since the last check. Reads the signal area: call it where the kernels are known to have finished, as for
  // timed_out. Every rank's kernel finds the same mismatch, so every rank raises the same error there.
  void check_calls();
  // The cross-rank signature check of the kernels (on by default; off only to measure what it costs).
  void set_call_check(bool on) { call_check_ = on; }
  bool call_check() const { return call_check_; }
  // The ranks some wait of this rank gave up on (whose flags never came), in rank order.
  std::vector<int> late_ranks() const;
  // Waits for all work of this device (teardown: before any rank frees memory its peers read).
  void synchronize() const;
  // Frees everything; never throws. Peers must have synchronised first.
  void close() noexcept;
  size_t open_mappings() const { return mappings_.size(); }
  // The flight recorder and straggler window of this rank's calls (kernel_trace.h); null once closed.
  KernelTrace* trace() const { return trace_.get(); }
  // IPC mode: this rank's ring of CallRecords for the peers ("" when recording is off), and the peers' rings
  // (handles[q], capacities[q]: rank q's records_handle() and record capacity), read by the hang report.
  std::string records_handle() const;
  void connect_records(const std::vector<std::string>& handles, const std::vector<uint32_t>& capacities);
  int64_t registered_count() const { return static_cast<int64_t>(registered_.size()); }

 private:
  struct Registered {
    int slot;
    size_t bytes;
  };
  int max_blocks_for(Algo algo, DType dtype, RedOp op) const;
  // The grid cap that keeps every co-resident rank's blocks resident at once (raises when not even one fits).
  int residency_cap(int blocks_per_sm) const;
  // A call's arguments common to every kernel: the communicator's tables and its signature (numbered here).
  AllReduceArgs call_args(DType dtype, RedOp op, size_t count, int32_t algo, Wire wire);
  void alloc_table();
  int take_slot();
  void fill_slot(int slot, const PeerTable& t);
  const PeerTable* slot_ptr(int slot) const { return table_ + slot; }

  int rank_, nranks_, device_;
  int sms_ = 0;
  uint64_t timeout_ns_;
  std::unique_ptr<RankMemory> mem_;
  std::unique_ptr<KernelTrace> trace_;
  IpcMappings mappings_;
  PeerTable bufs_{}, sigs_{};
  std::vector<uint8_t> p2p_row_;
  std::string placement_problem_ = "the ranks' placement was not set (set_placement)";
  bool connected_ = false;
  int co_resident_ = 1;  // ranks whose blocks must be resident together on this GPU
  PeerTable* table_ = nullptr;  // device: kMaxRegistered slots
  int next_slot_ = 0;
  std::map<uintptr_t, Registered> registered_;
  std::vector<std::pair<uintptr_t, Registered>> pending_;
  bool defer_ = false;
  uint32_t seq_ = 0;        // all_reduce calls made (the signature's call number)
  uint64_t reported_ = 0;   // Signals::mismatches already raised by check_calls
  bool call_check_ = true;
};

// Which launcher runs `algo`.
cudaError_t launch_algo(Algo algo, const AllReduceArgs& a, cudaStream_t stream);
cudaError_t algo_blocks_per_sm(Algo algo, DType dtype, RedOp op, int* out);

}  // namespace gpucoll::cuda::custom
