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
//
// Every collective is checked against the other ranks' calls (check/call_sig.h): each rank writes its call's
// signature next to its step counter before the copy-in step of the first piece publishes it, and waits for
// every rank's copy-in step (not only the peers its first step reads) before going on. That wait costs no extra
// round trip - the copy-in steps are published anyway, and every rank of any collective but a rooted one's root
// needs every other rank's data before it finishes - and it is what lets every rank compare every signature
// before anything but its own work buffer was written. A mismatch raises the same InvalidArgument on every
// rank and leaves every counter in step, so the communicator stays usable.
//
// Blame is taken from evidence, in this order: a rank whose process is gone; a rank at the end of the chain of
// who waits for whom (it waits for nobody, or for something already there: it is not running); the rank waited
// for. A rank whose own wait was interrupted for longer than kStallNs (SIGSTOP, a debugger) does not count that
// time against its peers, and when a peer gave up waiting for it, it says so instead of blaming that peer.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "algo/registry.h"
#include "backends/host/progress.h"
#include "backends/host/shm.h"
#include "backends/host/sync.h"
#include "check/call_sig.h"
#include "core/error.h"
#include "core/flight_recorder.h"
#include "core/quant.h"
#include "core/stragglers.h"
#include "core/types.h"
#include "select/selector.h"

namespace gpucoll::host {

struct Ctl;      // region.h
struct PairCtl;  // region.h

// Ranks made different collective calls (check/call_sig.h). Every rank raises it, after the same one step and
// with the same message, so unlike other errors it leaves the communicator usable.
class CallMismatch : public Error {
 public:
  CallMismatch(std::string message, const char* call, std::vector<int> ranks, const char* file, int line)
      : Error(ErrorCode::kInvalidArgument, std::move(message), call, file, line, std::move(ranks)) {}
};

struct HostOptions {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;
  int64_t buffer_bytes = 16 << 20;   // work buffer per rank
  int64_t segment_bytes = 256 << 10;  // target chunk size of one schedule step
  int64_t spin_us = 50;
  int64_t straggler_report = 0;  // GPUCOLL_STRAGGLER_REPORT: rank 0 logs a straggler summary every this many
  int trace_capacity = FlightRecorder::kDefaultCapacity;  // GPUCOLL_TRACE_BUFFER: the flight recorder's entries
};

// One side of a point-to-point transfer; a batch of them (a group) progresses together.
struct P2POp {
  bool send = false;
  int peer = 0;
  void* buf = nullptr;  // read by a send, written by a recv
  int64_t bytes = 0;
};

// One array of a fused all-reduce (CollArgs::segs): `elems` elements at `ptr`, in and out.
struct IoSeg {
  char* ptr = nullptr;
  int64_t elems = 0;
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
  int local_size = 0;       // hierarchical schedules; 0 = nranks
  bool auto_algo = false;   // the algorithm was chosen by 'auto' (named as such in a mismatch error)
  Wire wire = Wire::kNone;  // all_reduce(compress=...): the compressed schedule (compressed.cc) instead of `algorithm`
  // all_reduce in place over several arrays as one vector (tensor fusion), instead of in/out: the copy-in gathers
  // from them and every write of the result scatters into them, so no staging copy of the whole list is made.
  const IoSeg* segs = nullptr;
  int64_t nsegs = 0;
};

// out = what `in` is after one trip through wire format `w`, block by block (core/quant.h); in == out is fine. For
// error feedback: what a rank's compressed all-reduce drops of its input is in - out.
void wire_roundtrip(Wire w, DType dtype, const void* in, void* out, int64_t count);

// Why a compressed call cannot run (not an all_reduce, not floating data, not a sum or avg), or nullptr.
const char* compress_unusable(const CollArgs& a);

class HostComm {
 public:
  // The creating rank (rank 0) passes attach_to=nullptr and hands handle() to the others through the
  // rendezvous; they pass it. Call wait_attached() on every rank before the first collective.
  HostComm(const HostOptions& options, const ShmHandle* attach_to);
  ~HostComm();
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  // Waits until every rank has attached, then the creator closes its descriptor (the region then lives exactly
  // as long as the ranks' mappings). A rank that never attaches turns into a timeout error naming it. The
  // rendezvous normally has every rank attached before this (a store barrier that names a dead rank at once).
  void wait_attached();

  void run(const CollArgs& args, const algo::Algorithm& algorithm);
  void barrier();
  // Runs a batch of sends and receives to completion. All of them progress together, piece by piece, so any
  // order of matching pairs completes (ncclGroupStart/End semantics); a lone send or recv is a batch of one.
  void p2p(const std::vector<P2POp>& ops);
  // Runs `task`, one of this communicator's operations (run, p2p, barrier), on its progress thread after every
  // operation called before it, and returns at once (backends/host/progress.h). Synchronous operations wait for
  // the queue first, so all of them run in call order.
  std::shared_ptr<Completion> submit(std::function<void()> task) {
    check_usable("async_op=True");
    return progress_.submit(std::move(task));
  }
  // At interpreter exit: lets queued operations finish for at most `seconds`; false if one is still running (a
  // peer that never comes), which is then left to its thread and never freed (close() leaves the region mapped).
  bool stop_progress_for(double seconds) noexcept { return progress_.stop_for(seconds); }
  // Stops without waiting for issued operations (ncclCommAbort): the one running raises InvalidUsage naming
  // `reason` at its next look at its peers (within a wait slice, 20 ms), which breaks the communicator for them
  // too; queued ones raise it without starting. Any thread may call it; close() must follow. Never throws.
  void abort(const std::string& reason) noexcept;
  // Marks this rank broken for its peers, as a failed collective does, while no operation of it runs: peers that
  // wait on it, now or later, fail at once (RemoteError) instead of timing out. For a rank whose failure happened
  // outside this communicator (HostNodes: a lost machine, seen on the network by the machine's first rank). The
  // communicator is unusable afterwards.
  void abandon() noexcept;
  // Runs the queued operations (close waits for them, as ncclCommDestroy does), then marks the communicator closed
  // (peers still waiting in a collective on this rank learn it); later calls raise InvalidUsage. Never throws.
  void close() noexcept;
  // Benchmarks and tests only (gpucoll-bench --compare unchecked): turns the cross-rank call check off or on.
  // Every rank must switch between the same two collectives. Without the check a mismatch corrupts data.
  void set_call_check(bool on) { call_check_ = on; }

  int rank() const { return opt_.rank; }
  int nranks() const { return opt_.nranks; }
  uint64_t op_seq() const { return op_seq_; }
  // algo="auto"'s choice for this communicator's calls, the last one kept (select/selector.h).
  const algo::Algorithm& auto_algorithm(algo::Coll coll, int64_t nbytes, int local_size) {
    in_order();  // the choice is cached state, which a queued operation may be updating
    return auto_choice_.choose(coll, opt_.nranks, nbytes, local_size);
  }
  bool closed() const { return closed_; }
  bool broken() const { return broken_; }
  bool call_check() const { return call_check_; }
  // Every rank's lateness at the last kStragglerWindow collectives, taken where the call check compares the
  // calls (no extra synchronisation); empty with the call check off (benchmarks only).
  const StragglerWindow& stragglers() const { return stragglers_; }
  void clear_stragglers() { stragglers_.clear(); }
  // This rank's last operations (core/flight_recorder.h), begun and ended where begin_op/end_op and fail() are.
  const FlightRecorder& trace() const { return trace_; }
  // Where each rank is, as it published in the region (for a hang report): its pid and whether that process is
  // gone, the collective it entered last (op_seq, in_coll) and the last it completed (done_seq, done_coll, when).
  struct PeerState {
    int pid = 0;
    bool exited = false;
    bool broken = false;
    uint64_t entered = 0;
    int32_t in_coll = -1;
    double in_for_s = 0;  // since it entered `entered`, while it has not completed it
    uint64_t done = 0;
    int32_t done_coll = -1;
    double done_ago_s = 0;
    bool in_p2p = false;  // inside a batch of sends and receives (`where` says which)
    std::string where;  // whereabouts(): "it is inside all_reduce #12, entered 3.1 s ago"
  };
  std::vector<PeerState> peer_states() const;
  static constexpr int kStragglerWindow = 1000;
  ShmHandle handle() const { return shm_.handle(); }

 private:
  // Every operation's first step, before it touches any state: the asynchronous ones called before it run first.
  void in_order() { progress_.drain(); }
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
  // Starts a collective (barrier included; `coll` is its algo::Coll, -1 for a barrier): numbers it, publishes that
  // number and this rank's arrival time, sets its deadline.
  void begin_op(const char* what, int coll = -1);
  // Ends it: publishes it as this rank's last completed collective (for the peers' timeout reports), a call that
  // raised CallMismatch included (every rank completes it alike); `state` goes to the flight recorder.
  void end_op(int coll, TraceState state = TraceState::kDone);
  // Writes this rank's signature of the current collective (before the step that publishes it).
  void post_sig(const algo::CallSig& sig);
  // After this rank's first step of a collective: waits for every rank's, then compares the signatures. Raises
  // CallMismatch (an InvalidArgument) on every rank alike. Does nothing with the check off (benchmarks only).
  void check_arrivals(const algo::CallSig& sig);
  // Waits until every rank has completed as many steps as this one.
  void wait_all_arrived();
  // Waits until rank `peer` has completed `target` steps; raises a timeout or remote error instead of hanging.
  void wait_done(int peer, uint32_t target);
  // Starts a batch of sends and receives: numbered apart from the collectives, which it must not disturb.
  // Its flight-recorder entry: coll kTraceP2P, count = the batch's operations, root = its one peer (-2: several),
  // bytes = what it sends.
  void begin_p2p(const char* what, const std::vector<P2POp>& ops);
  // "all_reduce #12", "send #3".
  std::string op_label() const;
  // Where `peer` is, from what it published in the region: "it is inside all_reduce #12, entered 3.1 s ago", or
  // "its last completed: all_reduce #11, 31.2 s ago".
  std::string whereabouts(int peer) const;
  // "; rank(s) that had not entered it: 3 (its last completed: ...)" for the current collective (empty for
  // point-to-point calls, which are not numbered alike); adds those ranks to `ranks`.
  std::string late_note(std::vector<int>* ranks) const;
  // Time this rank was not running inside the operation (SIGSTOP, ...) moves its deadline; returns now.
  int64_t note_awake(int64_t now);
  // Ends a step that wrote work-buffer half `half`; `readers` read this rank's buffer during it.
  void complete_step(const std::vector<int>& readers, int half);
  // Ends a step that touched no buffer (barrier, a call with nothing to move).
  void complete_sync_step();
  // Waits until every rank that last read half `half` of this rank's buffer has completed that step.
  void wait_war(int half);
  // Marks this communicator broken (here and, for peers, in the region) with the error that broke it.
  void fail(const char* what, const Error* cause) noexcept;
  [[noreturn]] void raise_peer_failed(int peer);
  [[noreturn]] void raise_peer_closed(int peer, uint64_t after);
  [[noreturn]] void raise_timeout(int peer);
  bool peer_dead(int peer) const;
  // The rank to blame for a wait on `peer` that ran out of time, and on what evidence (region.h, Blame).
  int culprit(int peer, int32_t* how) const;
  // One round of the slow wait on `peer`: raises if it failed, closed, exited or the deadline passed.
  void check_peer(int peer);

  // `scale`: the pre-multiplier of every input element (one element of a.dtype: avg's 1/n on floating types,
  // premul_sum's scalar), or nullptr.
  void run_pieces(const CollArgs& a, const Plan& plan, const algo::CallSig& sig, const unsigned char* scale);
  // The compressed all-reduce (compressed.cc): the two-shot shape over block-encoded records.
  void run_compressed(const CollArgs& a, const algo::CallSig& sig);
  // Waits until `word` reaches target; same timeout/dead-peer rules as wait_done. `published` is what this rank
  // says it waits for (the peer's step count, or kP2PWait), for peers that follow the chain of waits.
  void wait_word(WaitWord* w, uint32_t target, int peer, uint32_t published);

  HostOptions opt_;
  ShmRegion shm_;
  size_t work_offset_ = 0;
  size_t pair_offset_ = 0;
  size_t slot_offset_ = 0;
  size_t slot_bytes_ = 0;
  bool call_check_ = true;
  std::vector<uint32_t> p2p_sent_;   // pieces this rank has sent to each peer
  std::vector<uint32_t> p2p_recvd_;  // pieces this rank has received from each peer
  uint32_t done_ = 0;             // steps this rank has completed (mirrors its control word)
  struct War {
    uint32_t target = 0;       // the step count readers must reach
    std::vector<int> readers;  // ranks that read the half at that step
  };
  War war_[2];
  uint64_t pieces_ = 0;  // pieces run so far; its parity picks the work-buffer half
  algo::AutoChoice auto_choice_;
  uint64_t op_seq_ = 0;  // collectives (barriers included) begun; point-to-point calls do not count
  uint64_t p2p_seq_ = 0;  // point-to-point batches begun, for messages only
  const char* current_ = "init";
  int64_t deadline_ns_ = 0;
  int64_t awake_ns_ = 0;    // when this rank was last seen running inside an operation (waits.cc, kStallNs)
  int64_t stalled_ns_ = 0;  // how long it was not, in this operation
  bool in_p2p_ = false;
  struct Blamed {
    int rank = -1;
    int32_t how = 0;  // Blame
  };
  Blamed last_blame_;  // what the last raise_* blamed; fail() publishes it to the peers
  int64_t spin_ns_ = 0;
  bool closed_ = false;
  bool broken_ = false;
  // Set by abort() from any thread, read by the operation's waits; abort_reason_ is written before it (release).
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
  std::map<std::tuple<const algo::Algorithm*, int, int, int>, Plan> plans_;
  StragglerWindow stragglers_;
  FlightRecorder trace_;
  uint64_t trace_id_ = FlightRecorder::kOff;  // the recorder's entry of the operation under way
  std::vector<int64_t> arrivals_;  // scratch: one collective's arrival times, read from the region
  Progress progress_;  // last: its thread ends (in close()) before anything it uses goes
};

}  // namespace gpucoll::host
