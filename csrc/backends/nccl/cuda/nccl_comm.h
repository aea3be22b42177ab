// The NCCL communicator: one ncclComm_t created non-blocking, every gpucoll collective mapped onto NCCL's,
// operations tracked with CUDA events for a watchdog, and failure paths that abort instead of hanging.
//
// Threads. The owning (user) thread issues operations; a watchdog thread (gpucoll/backends/nccl.py) calls
// poll() and may call abort() at any time. Operations hold call_mu_ only while they enqueue work (never
// while the GPU runs it); their waits on NCCL's ncclInProgress state check abort_requested_ so that an
// abort from the watchdog gets the mutex within one poll step. comm_ is additionally guarded by comm_mu_,
// which poll() takes for ncclCommGetAsyncError, so the watchdog never waits behind an enqueue.
//
// Ordering. Every operation is enqueued on the caller's stream, or, for async_op, on the communicator's
// internal stream after that stream waits on the caller's (so inputs are ready). After the enqueue one event
// is recorded on that stream: it is what the watchdog, Work.wait() and Work.synchronize() use. Nothing of
// this happens on a stream that is being captured into a CUDA graph: no event is recorded there, no stream
// forked, nothing queried or synchronized, so captured collectives replay as plain graph nodes.
//
// Non-blocking NCCL. The communicator is created with ncclConfig_t.blocking = 0: init, and any later call
// that needs connection setup, returns ncclInProgress and finishes in the background. gpucoll polls
// ncclCommGetAsyncError until the state leaves ncclInProgress, with the communicator's timeout, before it
// records events or returns: until then the kernels may not be on the stream yet.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algo/schedule.h"
#include "backends/nccl/nccl_api.h"
#include "backends/nccl/nccl_loader.h"
#include "core/config.h"
#include "core/flight_recorder.h"
#include "core/types.h"

namespace gpucoll::nccl {

using Clock = std::chrono::steady_clock;

// What an operation was, kept as plain fields: formatted into text only when an error needs it.
struct OpDesc {
  const char* name = "";  // "all_reduce", "send", "group", ...
  DType dtype = DType::kU8;
  size_t count = 0;
  int peer = -1;    // root or peer; -1 when none
  int nested = 0;   // for a group: how many operations it holds
};
std::string describe(const OpDesc& d, uint64_t seq);

// A recorded completion event, returned to the pool when the last holder lets go.
class Event {
 public:
  Event(int device, cudaEvent_t event) : device_(device), event_(event) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }

 private:
  int device_;
  cudaEvent_t event_;
};

// The host's view of one operation (or of one group): Python's gpucoll Work wraps it.
class Work {
 public:
  enum class State { kInGroup, kLaunched, kCaptured };
  Work(uint64_t seq, const OpDesc& desc) : seq_(seq), desc_(desc) {}

  uint64_t seq() const { return seq_; }
  const OpDesc& desc() const { return desc_; }
  State state() const { return state_.load(std::memory_order_acquire); }
  // Whether the GPU finished it. A captured operation has nothing to finish eagerly (true); one inside a
  // group that has not ended yet has not started (false). Safe during graph capture on other threads.
  bool query();
  // Makes `stream` wait for the operation without blocking the host. InvalidUsage inside an open group.
  void wait_on(cudaStream_t stream);
  // Blocks the calling thread until the operation finished (release the GIL around it).
  void synchronize();

 private:
  friend class NcclComm;
  uint64_t seq_;
  OpDesc desc_;
  // Set once, by the owning thread, after event_ (release); readers on the watchdog thread acquire it, so a
  // kLaunched state guarantees a visible event_.
  std::atomic<State> state_{State::kInGroup};
  std::shared_ptr<Event> event_;
  std::atomic<bool> done_{false};
  Clock::time_point issued_ = Clock::now();
  std::vector<uint64_t> trace_ids_;  // the flight-recorder entries it completes (a group's: every operation's)
};

struct CollArgs {
  algo::Coll coll = algo::Coll::kAllReduce;
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;  // N for all_reduce/broadcast/reduce; the per-rank block for the blocked collectives
  DType dtype = DType::kF32;
  RedOp op = RedOp::kSum;
  int root = 0;
  bool premul = false;  // op is gpucoll.premul_sum(premul_scalar)
  double premul_scalar = 1.0;
};

struct P2PArgs {
  bool send = false;
  int peer = 0;
  void* buf = nullptr;
  size_t bytes = 0;
};

struct PollResult {
  std::vector<uint64_t> completed;  // seqs of tracked operations found complete by this poll
  bool pending = false;             // some tracked operation has not completed
  uint64_t oldest_seq = 0;          // the oldest of them
  std::string oldest_what;
  double oldest_age_s = 0;
  uint64_t issued = 0;  // operations issued so far (the seq of the latest)
  ncclResult_t async_error = ncclSuccess;
  std::string async_text;  // ncclGetErrorString + ncclGetLastError for async_error
  bool usable = true;      // false once aborted or closed
};

class NcclComm {
 public:
  // Creates this rank's communicator on `device` from the unique id rank 0 made; blocks (polling) until NCCL
  // finished, at most timeout_s seconds, then raises CollectiveTimeout (after aborting what was created).
  NcclComm(const ncclUniqueId& id, int nranks, int rank, int device, double timeout_s);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Enqueues one collective on `stream` (or, with async_op, on the internal stream ordered after `stream`).
  // Returns its Work for async_op, else nullptr.
  std::shared_ptr<Work> collective(const CollArgs& a, cudaStream_t stream, bool async_op);
  // Runs the sends and receives together (ncclGroupStart/End), as one operation.
  std::shared_ptr<Work> p2p(const std::vector<P2PArgs>& ops, cudaStream_t stream, bool async_op);
  // ncclGroupStart / ncclGroupEnd: operations in between launch together at the outermost group_end.
  void group_start();
  void group_end();

  // Replaces the non-blocking communicator by a blocking one split off it (ncclCommSplit: same ranks, same
  // order), then frees the first. Collective; call it right after init. The split is polled under the timeout
  // like init (CollectiveTimeout, communicator aborted). GPUCOLL_NCCL_BLOCKING_OPS.
  // What it gives up: a blocking call waits inside NCCL without a bound for what it does on the host, e.g. the
  // connections NCCL sets up on an operation's first use of a peer or algorithm (NCCL_RUNTIME_CONNECT), which wait
  // for that peer; the watchdog cannot abort a call in progress (call_mu_; ncclCommAbort would free the
  // communicator under it). The timeout then covers only work on the GPU.
  void split_blocking();
  bool blocking() const { return blocking_; }
  // Collective over every rank of this communicator (ncclCommSplit, nccl_split.cc): the communicator of the ranks
  // that pass the same color (>= 0), ordered by key then by rank here, in this one's mode (blocking or not), polled
  // under the timeout like init. color -1 (NCCL_SPLIT_NOCOLOR) takes part and gets nullptr. Unsupported where the
  // loaded NCCL has no ncclCommSplit.
  std::unique_ptr<NcclComm> split(int color, int key);
  // Collective over the ranks not in `exclude` (ncclCommShrink, NCCL >= 2.27, NCCL_SHRINK_DEFAULT: nothing of this
  // communicator may be in flight): their communicator, renumbered in rank order, in this one's mode. Unsupported
  // where the loaded NCCL has no ncclCommShrink.
  std::unique_ptr<NcclComm> shrink(const std::vector<int>& exclude);

  // The watchdog's view; never throws for NCCL/CUDA states (they are reported in the result).
  PollResult poll();
  // ncclCommAbort; later calls raise InvalidUsage with `why`. Idempotent, never throws.
  void abort(const std::string& why) noexcept;
  // Waits (at most the timeout) for issued work, then frees the communicator; aborts it on failure. Never
  // throws; idempotent.
  void close() noexcept;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int device() const { return device_; }
  int nccl_version() const { return lib_.version; }
  uint64_t issued() const { return issued_.load(std::memory_order_relaxed); }
  bool usable() const { return state_.load() == kOpen; }
  // Why the communicator is no longer usable ("" while it is).
  std::string reason();
  int group_depth() const { return group_.depth; }
  // The stream async operations run on (created on first use); 0 before that.
  uintptr_t internal_stream() const { return reinterpret_cast<uintptr_t>(internal_); }
  // 16 bytes of device memory for barrier() when no framework allocator is loaded: cudaMalloc'ed on first
  // use, freed by close().
  uintptr_t scratch();
  // Whether the loaded NCCL has its own AlltoAll/Gather/Scatter (>= 2.28); else grouped send/recv.
  bool native(algo::Coll c) const;
  // Test hook: false makes all_to_all/gather/scatter take the grouped send/recv path even on NCCL >= 2.28,
  // so that the path older NCCLs need is exercised on whatever NCCL the test machine has.
  void set_prefer_native(bool prefer) { prefer_native_ = prefer; }
  // This rank's last operations (core/flight_recorder.h; GPUCOLL_TRACE_BUFFER entries).
  const FlightRecorder& trace() const { return trace_; }

 private:
  enum State : int { kOpen = 0, kAborted = 1, kClosed = 2 };
  struct Pending {
    std::shared_ptr<Work> work;
  };
  struct Group {
    int depth = 0;
    int nops = 0;
    OpDesc first;
    uint64_t last_seq = 0;
    std::vector<std::pair<std::shared_ptr<Work>, cudaStream_t>> works;  // async Works waiting for group_end
    std::vector<std::pair<cudaStream_t, bool>> streams;                 // (stream, capturing) used in the group
    std::vector<ncclRedOp_t> premul_ops;                                // destroyed once the group ended
    std::vector<std::pair<uint64_t, cudaStream_t>> trace_ids;           // its operations' recorder entries
  };

  // Adopts a communicator NCCL made from this one (split): polls it ready, reads its rank and size.
  NcclComm(ncclComm_t adopted, int device, double timeout_s, bool blocking, const std::string& what);
  // Starts NCCL's making of a child into `slot` with `config` (ncclCommSplit, ncclCommShrink).
  using ChildStart = std::function<ncclResult_t(ncclComm_t* slot, ncclConfig_t* config)>;
  // Runs `start` with call_mu_ held and polls it done under the timeout; the child (nullptr only if !want_child).
  ncclComm_t child_locked(const char* call, const ChildStart& start, int blocking, bool want_child,
                          const std::string& what);
  // ncclCommSplit with call_mu_ held; the child, or nullptr for color -1.
  ncclComm_t split_locked(int color, int key, int blocking, const std::string& what);
  void check_usable(const char* what) const;
  // Polls ncclCommGetAsyncError until the state leaves ncclInProgress; throws NcclError naming `call` on
  // an error, CollectiveTimeout at the deadline, InvalidUsage when abort() was requested meanwhile.
  void wait_ready(const char* call, const std::string& what);
  void settle(ncclResult_t r, const char* call, const std::string& what);
  cudaStream_t fork_internal(cudaStream_t from);
  void enqueue(const CollArgs& a, ncclRedOp_t op, cudaStream_t s, const std::string& what);
  // ncclGroupStart, one ncclSend/ncclRecv of bytes/es elements per op, ncclGroupEnd.
  void send_recv_group(const std::vector<P2PArgs>& ops, ncclDataType_t dt, size_t es, cudaStream_t s,
                       const std::string& what);
  // Records completion (outside groups) or defers it to group_end; returns the Work for async_op.
  std::shared_ptr<Work> finish(uint64_t seq, const OpDesc& d, cudaStream_t s, bool capturing, bool async_op,
                               uint64_t trace_id);
  // The operation's flight-recorder entry, begun when it is enqueued. NCCL says nothing of when a kernel starts
  // (the entry's start stays 0), and its end is when the watchdog's poll (or close) found the event complete:
  // within GPUCOLL_NCCL_WATCHDOG_MS of the real end.
  uint64_t trace_begin(uint64_t seq, const algo::CallSig& sig, int64_t bytes);
  void track(const std::shared_ptr<Work>& w, cudaStream_t s, bool capturing);
  void abort_locked(const std::string& why) noexcept;
  bool drained();  // every tracked operation finished (close() of a blocking communicator)

  const NcclLibrary& lib_;
  int rank_;
  int nranks_;
  int device_;
  int cc_major_ = 0;  // device_'s compute capability
  int cc_minor_ = 0;
  std::chrono::duration<double> timeout_;
  std::mutex call_mu_;  // held while an operation is enqueued
  std::mutex comm_mu_;  // guards comm_'s lifetime against poll()
  std::mutex pend_mu_;  // guards pending_
  ncclComm_t comm_ = nullptr;
  std::atomic<int> state_{kOpen};
  bool blocking_ = false;  // comm_ is the blocking child of split_blocking()
  std::atomic<bool> abort_requested_{false};
  bool deferred_abort_ = false;  // abort() came while a group was open (guarded by call_mu_)
  bool prefer_native_ = true;
  std::string reason_;  // why unusable (set once, before state_ leaves kOpen)
  std::atomic<uint64_t> issued_{0};
  FlightRecorder trace_{static_cast<int>(config_int("GPUCOLL_TRACE_BUFFER"))};
  uint64_t collectives_ = 0;  // collectives issued (under call_mu_): their entries' CallSig::seq
  cudaStream_t internal_ = nullptr;
  void* scratch_ = nullptr;
  Group group_;
  std::deque<Pending> pending_;
};

}  // namespace gpucoll::nccl
