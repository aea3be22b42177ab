// The host backend: ranks are processes on one machine sharing one POSIX shared-memory region.
//
// Each rank owns a work buffer in the region; collectives are executed by following a schedule from
// csrc/algo/ (see schedule.h for the pull model and its ordering contract). Per-rank control words in the
// region carry the number of schedule steps each rank has completed; a rank waits on exactly the peers a
// step depends on, which is what the GPU kernels will do with flags in peer memory.
//
// Messages larger than the work buffer, or than the pipelining segment, are cut into pieces, and each piece
// runs the whole schedule; ranks are only coupled through step counters, so successive pieces overlap across
// ranks (a pipelined ring, not a lock-step one).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "algo/registry.h"
#include "backends/host/shm.h"
#include "backends/host/sync.h"
#include "core/error.h"
#include "core/types.h"

namespace gpucoll::host {

struct Ctl;      // region.h
struct PairCtl;  // region.h

struct HostOptions {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;
  int64_t buffer_bytes = 16 << 20;   // work buffer per rank
  int64_t segment_bytes = 256 << 10;  // target chunk size of one schedule step
  int64_t spin_us = 50;
  bool debug_checks = false;  // GPUCOLL_DEBUG_CHECKS
};

// One side of a point-to-point transfer; a batch of them (a group) progresses together.
struct P2POp {
  bool send = false;
  int peer = 0;
  void* buf = nullptr;  // read by a send, written by a recv
  int64_t bytes = 0;
};

struct CollArgs {
  algo::Coll coll = algo::Coll::kAllReduce;
  const void* in = nullptr;  // this rank's input (ignored where the collective does not read it)
  void* out = nullptr;       // this rank's output; may equal `in` (in place)
  int64_t count = 0;         // elements: N for all_reduce/broadcast/reduce, the per-rank block n otherwise
  DType dtype = DType::kF32;
  RedOp op = RedOp::kSum;
  bool premul = false;         // op is gpucoll.premul_sum(premul_scalar): a sum of the inputs times the scalar
  double premul_scalar = 1.0;  // converted to `dtype` as NCCL converts it (core/premul.h)
  int root = 0;
  int local_size = 0;  // hierarchical schedules; 0 = nranks
};

class HostComm {
 public:
  // The creating rank (rank 0) passes create=true and a name from ShmRegion::make_name(); the others
  // attach to that name. Call wait_attached() on every rank before the first collective.
  HostComm(const HostOptions& options, const std::string& shm_name, bool create);
  ~HostComm();
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  // Waits until every rank has attached, then the name is unlinked (by the last to attach). A rank that
  // never attaches turns into a timeout error naming it, and the name is unlinked anyway.
  void wait_attached();

  void run(const CollArgs& args, const algo::Algorithm& algorithm);
  void barrier();
  // Runs a batch of sends and receives to completion. All of them progress together, piece by piece, so any
  // order of matching pairs completes (ncclGroupStart/End semantics); a lone send or recv is a batch of one.
  void p2p(const std::vector<P2POp>& ops);
  // Marks the communicator closed; later calls raise InvalidUsage. Never throws.
  void close() noexcept;

  int rank() const { return opt_.rank; }
  int nranks() const { return opt_.nranks; }
  uint64_t op_seq() const { return op_seq_; }
  bool closed() const { return closed_; }
  bool broken() const { return broken_; }
  const std::string& shm_name() const { return shm_.name(); }

 private:
  struct StepPlan {
    std::vector<algo::Op> ops;
    std::vector<int> raw_peers;  // ranks this rank reads from at this step (excluding itself)
    std::vector<int> readers;    // ranks that read from this rank at this step (excluding itself)
  };
  struct Plan {
    algo::Shape shape;
    std::vector<StepPlan> steps;
  };

  Ctl* ctl(int rank) const;
  PairCtl* pair(int src, int dst) const;
  char* slot(int src, int dst, uint64_t piece) const;
  // Each work buffer is two halves used by alternate pieces: a piece's copy-in then only waits for the
  // readers of the piece before last, which are long done, instead of the readers of the piece just run.
  char* work(int rank, int half) const;
  const Plan& plan_for(const algo::Algorithm& a, const algo::Params& p);
  void check_usable(const char* what) const;
  void begin_op(const char* what);
  // Waits until rank `peer` has completed `target` steps; raises a timeout or remote error instead of hanging.
  void wait_done(int peer, uint32_t target);
  // Ends a step that wrote work-buffer half `half`; `readers` read this rank's buffer during it.
  void complete_step(const std::vector<int>& readers, int half);
  // Ends a step that touched no buffer (barrier, debug check).
  void complete_sync_step();
  // Waits until every rank that last read half `half` of this rank's buffer has completed that step.
  void wait_war(int half);
  // Marks this communicator broken (here and, for peers, in the region) with the error that broke it.
  void fail(const char* what, const Error* cause) noexcept;
  [[noreturn]] void raise_peer_failed(int peer);
  [[noreturn]] void raise_timeout(int peer);
  bool peer_dead(int peer) const;

  // `scale`: the pre-multiplier of every input element (one element of a.dtype: avg's 1/n on floating types,
  // premul_sum's scalar), or nullptr.
  void run_pieces(const CollArgs& a, const Plan& plan, const unsigned char* scale);
  void debug_check(const CollArgs& a);
  // Waits until `word` reaches target, for a peer's p2p counter; same timeout/dead-peer rules as wait_done.
  void wait_word(WaitWord* w, uint32_t target, int peer);

  HostOptions opt_;
  ShmRegion shm_;
  size_t work_offset_ = 0;
  size_t pair_offset_ = 0;
  size_t slot_offset_ = 0;
  size_t slot_bytes_ = 0;
  bool debug_checks_ = false;
  std::vector<uint32_t> p2p_sent_;   // pieces this rank has sent to each peer
  std::vector<uint32_t> p2p_recvd_;  // pieces this rank has received from each peer
  uint32_t done_ = 0;             // steps this rank has completed (mirrors its control word)
  struct War {
    uint32_t target = 0;       // the step count readers must reach
    std::vector<int> readers;  // ranks that read the half at that step
  };
  War war_[2];
  uint64_t pieces_ = 0;  // pieces run so far; its parity picks the work-buffer half
  uint64_t op_seq_ = 0;
  const char* current_ = "init";
  int64_t deadline_ns_ = 0;
  int64_t spin_ns_ = 0;
  bool closed_ = false;
  bool broken_ = false;
  std::map<std::tuple<const algo::Algorithm*, int, int, int>, Plan> plans_;
};

}  // namespace gpucoll::host
