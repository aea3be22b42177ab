#include "core/flight_recorder.h"

#include <time.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace gpucoll {

namespace {
constexpr auto kRelaxed = std::memory_order_relaxed;

uint64_t bits(int64_t v) { return static_cast<uint64_t>(v); }
int64_t signed_of(uint64_t v) { return static_cast<int64_t>(v); }
}  // namespace

const char* trace_state_name(TraceState s) {
  switch (s) {
    case TraceState::kRunning: return "running";
    case TraceState::kDone: return "done";
    case TraceState::kFailed: return "failed";
    case TraceState::kMismatch: return "mismatch";
    case TraceState::kCaptured: return "captured";
  }
  return "unknown";
}

const char* trace_backend_name(TraceBackend b) {
  switch (b) {
    case TraceBackend::kHost: return "host";
    case TraceBackend::kNccl: return "nccl";
    case TraceBackend::kCustom: return "custom";
  }
  return "unknown";
}

int64_t FlightRecorder::now_ns() noexcept {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

FlightRecorder::FlightRecorder(int capacity) : capacity_(capacity) {
  if (capacity < 0) GPUCOLL_INVALID_ARG("GPUCOLL_TRACE_BUFFER (a flight recorder's entries) must be >= 0 (0: off); got ", capacity);
  if (capacity > 0) slots_ = std::make_unique<Slot[]>(static_cast<size_t>(capacity));
}

uint64_t FlightRecorder::begin(uint64_t seq, const algo::CallSig& sig, int64_t bytes, TraceBackend backend,
                               int64_t enqueue_ns, int64_t start_ns) {
  if (capacity_ == 0) return kOff;
  const uint64_t id = next_.load(kRelaxed);
  Slot* s = slot_of(id);
  // Odd while the fields change: a reader that copies meanwhile sees a version that moved and drops the copy.
  s->version.store(2 * id + 1, kRelaxed);
  std::atomic_thread_fence(std::memory_order_release);
  uint64_t sw[3];
  std::memcpy(sw, &sig, sizeof(sw));
  s->w[kSeq].store(seq, kRelaxed);
  s->w[kSig0].store(sw[0], kRelaxed);
  s->w[kSig1].store(sw[1], kRelaxed);
  s->w[kSig2].store(sw[2], kRelaxed);
  s->w[kBytes].store(bits(bytes), kRelaxed);
  s->w[kEnqueue].store(bits(enqueue_ns), kRelaxed);
  s->w[kStart].store(bits(start_ns), kRelaxed);
  s->w[kEnd].store(0, kRelaxed);
  s->w[kDevStart].store(0, kRelaxed);
  s->w[kDevEnd].store(0, kRelaxed);
  s->w[kMeta].store(static_cast<uint64_t>(TraceState::kRunning) | static_cast<uint64_t>(backend) << 8, kRelaxed);
  s->version.store(2 * (id + 1), std::memory_order_release);
  next_.store(id + 1, std::memory_order_release);
  return id;
}

void FlightRecorder::started(uint64_t id, int64_t start_ns) {
  if (id == kOff) return;
  Slot* s = slot_of(id);
  if (owns(s, id)) s->w[kStart].store(bits(start_ns), kRelaxed);
}

void FlightRecorder::device_times(uint64_t id, int64_t dev_start_ns, int64_t dev_end_ns) {
  if (id == kOff) return;
  Slot* s = slot_of(id);
  if (!owns(s, id)) return;
  s->w[kDevStart].store(bits(dev_start_ns), kRelaxed);
  s->w[kDevEnd].store(bits(dev_end_ns), kRelaxed);
}

void FlightRecorder::end(uint64_t id, TraceState state, int64_t end_ns) {
  if (id == kOff) return;
  Slot* s = slot_of(id);
  if (!owns(s, id)) return;
  s->w[kEnd].store(bits(end_ns), kRelaxed);
  const uint64_t meta = s->w[kMeta].load(kRelaxed);
  s->w[kMeta].store((meta & ~uint64_t{0xFF}) | static_cast<uint64_t>(state), std::memory_order_release);
}

std::vector<TraceEntry> FlightRecorder::snapshot(int last) const {
  std::vector<TraceEntry> out;
  if (capacity_ == 0) return out;
  const uint64_t n = next_.load(std::memory_order_acquire);
  uint64_t held = std::min<uint64_t>(n, static_cast<uint64_t>(capacity_));
  if (last > 0) held = std::min<uint64_t>(held, static_cast<uint64_t>(last));
  out.reserve(held);
  for (uint64_t id = n - held; id < n; ++id) {
    const Slot* s = slot_of(id);
    // The writer went round the ring meanwhile when the slot holds (or is being given) a later id: this entry and
    // every older one copied so far no longer exist, so they are dropped and the copy stays one contiguous run.
    // (An id below next_ is always complete before next_ moves past it, so there is nothing else to wait for.)
    for (;;) {
      const uint64_t v1 = s->version.load(std::memory_order_acquire);
      if (v1 != 2 * (id + 1)) {
        out.clear();
        break;
      }
      TraceEntry e;
      e.id = id;
      const uint64_t meta = s->w[kMeta].load(std::memory_order_acquire);
      e.seq = s->w[kSeq].load(kRelaxed);
      const uint64_t sw[3] = {s->w[kSig0].load(kRelaxed), s->w[kSig1].load(kRelaxed), s->w[kSig2].load(kRelaxed)};
      std::memcpy(&e.sig, sw, sizeof(sw));
      e.bytes = signed_of(s->w[kBytes].load(kRelaxed));
      e.enqueue_ns = signed_of(s->w[kEnqueue].load(kRelaxed));
      e.start_ns = signed_of(s->w[kStart].load(kRelaxed));
      e.end_ns = signed_of(s->w[kEnd].load(kRelaxed));
      e.dev_start_ns = signed_of(s->w[kDevStart].load(kRelaxed));
      e.dev_end_ns = signed_of(s->w[kDevEnd].load(kRelaxed));
      e.state = static_cast<TraceState>(meta & 0xFF);
      e.backend = static_cast<TraceBackend>((meta >> 8) & 0xFF);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s->version.load(kRelaxed) == v1) {
        out.push_back(e);
        break;
      }
      // Rewritten while copied: the next look sees the later id.
    }
  }
  return out;
}

}  // namespace gpucoll
