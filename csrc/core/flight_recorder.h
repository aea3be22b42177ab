// The flight recorder: the last N operations of one communicator, always on, for the report of a hang.
//
// When a collective times out, the question is where every rank is; the answer is in each rank's last few
// operations (which one it never finished, which it finished last and when), so every backend records each
// operation here as it begins and ends, and the Python layer dumps the ring on a timeout (gpucoll/trace/).
//
// One writer, readers at any time: a backend begins and ends entries from the thread that runs its collectives
// (NCCL's watchdog thread ends its entries: a different slot from any begin() of the owner, unless an operation stays
// in flight while `capacity` later ones begin, when its end may land on the entry that reused its slot; ended
// entries are never rewritten otherwise), while a dump may read from any thread (torch's worker thread runs the
// collectives of a torch job; the main thread may ask). A mutex would cost two uncontended lock pairs per call;
// instead every field is its own atomic word, stored relaxed (a plain store on x86 and ARM), and a slot carries a
// version in the style of a seqlock: begin() makes it odd, writes the fields and makes it even again (release),
// so a reader that sees the same even version before and after copying the fields has a consistent entry. Later
// updates (start, end, state) are single words, each consistent alone; end() stores the state last, with release,
// so a reader that sees an entry done also sees its end time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "check/call_sig.h"

namespace gpucoll {

enum class TraceState : uint8_t {
  kRunning = 1,   // begun; not ended (the operation a hang is in)
  kDone = 2,
  kFailed = 3,    // raised: a timeout, a peer's failure (the communicator is broken), a call refused in step
  kMismatch = 4,  // the ranks' calls differed; the communicator stays usable
  kCaptured = 5,  // recorded into a CUDA graph: it runs when the graph is launched, not now
};
const char* trace_state_name(TraceState s);

enum class TraceBackend : uint8_t { kHost = 0, kNccl = 1, kCustom = 2 };
const char* trace_backend_name(TraceBackend b);

// `coll` of a point-to-point batch in an entry's signature (past kSigBarrier; never compared across ranks).
constexpr uint8_t kTraceP2P = 0x0E;

struct TraceEntry {
  uint64_t id = 0;       // position in the recorder's history (0 for its first operation), unique per recorder
  uint64_t seq = 0;      // the operation's number: the collective's (as the call check numbers it) or the batch's
  algo::CallSig sig{};   // collective, count, dtype, op, root, algorithm index: what the call check compares
  int64_t bytes = 0;     // this rank's input: count elements of dtype (a p2p batch: the bytes it sends)
  int64_t enqueue_ns = 0;  // CLOCK_MONOTONIC: the call reached the backend
  int64_t start_ns = 0;    // ... it started (the host backend: at once; a GPU backend: when the stream reached it)
  int64_t end_ns = 0;      // ... it ended; 0 while running
  int64_t dev_start_ns = 0;  // the device's clock (%globaltimer) where the device measured it; 0 otherwise
  int64_t dev_end_ns = 0;
  TraceState state = TraceState::kRunning;
  TraceBackend backend = TraceBackend::kHost;
};

class FlightRecorder {
 public:
  static constexpr uint64_t kOff = ~uint64_t{0};  // the id begin() returns when the recorder is off
  static constexpr int kDefaultCapacity = 2000;

  explicit FlightRecorder(int capacity);  // 0: off (every call returns at once)
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  int capacity() const { return capacity_; }
  // Entries begun so far (the ring holds the last min(recorded, capacity) of them).
  uint64_t recorded() const { return next_.load(std::memory_order_acquire); }

  // Writer side (one thread at a time). Returns the entry's id for the updates below.
  uint64_t begin(uint64_t seq, const algo::CallSig& sig, int64_t bytes, TraceBackend backend, int64_t enqueue_ns,
                 int64_t start_ns);
  void started(uint64_t id, int64_t start_ns);
  void device_times(uint64_t id, int64_t dev_start_ns, int64_t dev_end_ns);
  // Ends entry `id` with `state`; a no-op when the ring has already reused its slot.
  void end(uint64_t id, TraceState state, int64_t end_ns);

  // The last `last` entries (0: all held), oldest first; any thread.
  std::vector<TraceEntry> snapshot(int last = 0) const;

  // CLOCK_MONOTONIC in nanoseconds: the clock of every entry (the host backend's waits read the same one).
  static int64_t now_ns() noexcept;

 private:
  enum Word { kSeq, kSig0, kSig1, kSig2, kBytes, kEnqueue, kStart, kEnd, kDevStart, kDevEnd, kMeta, kWords };
  struct alignas(64) Slot {
    std::atomic<uint64_t> version{0};  // 2 * (id + 1) when complete; odd while begin() writes it
    std::atomic<uint64_t> w[kWords];
  };
  Slot* slot_of(uint64_t id) const { return &slots_[id % static_cast<uint64_t>(capacity_)]; }
  bool owns(const Slot* s, uint64_t id) const { return s->version.load(std::memory_order_relaxed) == 2 * (id + 1); }

  int capacity_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace gpucoll
