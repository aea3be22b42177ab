#include "backends/custom/cuda/kernel_trace.h"

#include <algorithm>

#include "device/cuda/cuda_util.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::cuda::custom {

namespace {
constexpr int kWindow = 1000;  // collectives the straggler window keeps (as the other backends')
constexpr int kProbes = 5;     // clock probes at set-up; the tightest bracket wins
}  // namespace

KernelTrace::KernelTrace(int nranks, int device, int capacity)
    : nranks_(nranks),
      device_(device),
      recorder_(capacity),
      window_(nranks, kWindow),
      peers_(static_cast<size_t>(nranks), {nullptr, 0}) {
  if (capacity == 0) return;
  DeviceGuard guard(device_);
  record_capacity_ = static_cast<uint32_t>(2 * capacity);
  const size_t bytes = sizeof(CallRecord) * record_capacity_ + sizeof(uint64_t);
  void* mem = nullptr;
  GPUCOLL_CUDA_CHECK(cudaMalloc(&mem, bytes));
  records_ = static_cast<CallRecord*>(mem);
  // seq 0 everywhere: no slot names a call until a kernel opens it.
  GPUCOLL_CUDA_CHECK(cudaMemset(records_, 0, bytes));
  probe_ = reinterpret_cast<uint64_t*>(records_ + record_capacity_);
  GPUCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  calibrate();
}

KernelTrace::~KernelTrace() {
  if (records_ == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) cudaSetDevice(device_);
  if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) cudaGetLastError();
  if (cudaFree(records_) != cudaSuccess) cudaGetLastError();
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

void KernelTrace::calibrate() {
  int64_t best = -1;
  for (int i = 0; i < kProbes; ++i) {
    const int64_t t0 = FlightRecorder::now_ns();
    GPUCOLL_CUDA_CHECK(launch_read_global_timer(probe_, stream_));
    GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const int64_t t1 = FlightRecorder::now_ns();
    uint64_t device_ns = 0;
    GPUCOLL_CUDA_CHECK(cudaMemcpy(&device_ns, probe_, sizeof(device_ns), cudaMemcpyDeviceToHost));
    if (best < 0 || t1 - t0 < best) {
      best = t1 - t0;
      offset_ns_ = static_cast<int64_t>(device_ns) - (t0 + (t1 - t0) / 2);
    }
  }
}

uint64_t KernelTrace::begin(const algo::CallSig& sig, int64_t bytes, bool captured) {
  algo::CallSig numbered = sig;
  numbered.seq = sig.seq + 1;  // numbered from 1, as every backend's entries
  const uint64_t id = recorder_.begin(numbered.seq, numbered, bytes, TraceBackend::kCustom,
                                      FlightRecorder::now_ns(), 0);
  if (captured) recorder_.end(id, TraceState::kCaptured, 0);
  if (report_ > 0 && numbered.seq % static_cast<uint64_t>(report_) == 0) {
    // Rank 0 only (the caller's choice): the calls settled so far, everything up to the one before this.
    log_write(LogLevel::kInfo, StragglerWindow::summary(stragglers(false)));
  }
  return id;
}

void KernelTrace::launch_failed(uint64_t id) { recorder_.end(id, TraceState::kFailed, FlightRecorder::now_ns()); }

std::vector<CallRecord> KernelTrace::copy_records() {
  std::vector<CallRecord> out(record_capacity_);
  if (record_capacity_ == 0) return out;
  DeviceGuard guard(device_);
  GPUCOLL_CUDA_CHECK(cudaMemcpyAsync(out.data(), records_, sizeof(CallRecord) * record_capacity_,
                                     cudaMemcpyDeviceToHost, stream_));
  GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

std::vector<TraceEntry> KernelTrace::snapshot(int last) {
  std::vector<TraceEntry> entries = recorder_.snapshot(last);
  if (entries.empty()) return entries;
  std::vector<CallRecord> recs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    recs = copy_records();
  }
  for (TraceEntry& e : entries) {
    const CallRecord& r = recs[(e.seq - 1) % record_capacity_];
    if (r.seq != e.seq) continue;  // not started on the device yet
    e.dev_start_ns = static_cast<int64_t>(r.start_ns);
    e.start_ns = e.dev_start_ns - offset_ns_;
    if (r.end_ns == 0) continue;  // running: in a wait, or working
    e.dev_end_ns = static_cast<int64_t>(r.end_ns);
    e.end_ns = e.dev_end_ns - offset_ns_;
    if (e.state != TraceState::kRunning) continue;  // captured, or a launch that failed
    e.state = (r.flags & kRecordTimedOut) != 0   ? TraceState::kFailed
              : (r.flags & kRecordMismatch) != 0 ? TraceState::kMismatch
                                                 : TraceState::kDone;
  }
  return entries;
}

StragglerWindow::Snapshot KernelTrace::stragglers(bool reset) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t recorded = recorder_.recorded();
  if (record_capacity_ > 0 && recorded > measured_) {
    const std::vector<CallRecord> recs = copy_records();
    // Calls older than the ring's reach are gone; a call whose lateness never settles (a timed-out rank left no
    // view) is passed over once a later call has settled.
    const uint64_t oldest = recorded > record_capacity_ ? recorded - record_capacity_ + 1 : 1;
    const uint64_t from = std::max<uint64_t>(measured_ + 1, oldest);
    std::vector<int64_t> late(static_cast<size_t>(nranks_));
    for (uint64_t n = from; n <= recorded; ++n) {
      const CallRecord& r = recs[(n - 1) % record_capacity_];
      if (r.seq != n) continue;
      bool settled = true;
      for (int q = 0; q < nranks_; ++q) {
        settled = settled && r.late_ns[q] != kNoLateness;
        late[static_cast<size_t>(q)] = static_cast<int64_t>(r.late_ns[q]);
      }
      if (!settled) continue;
      window_.add(late.data());  // lateness against the first rank is an arrival time on a clock starting there
      measured_ = n;
    }
  }
  StragglerWindow::Snapshot snap = window_.stats();
  if (reset) window_.clear();
  return snap;
}

void KernelTrace::set_peer(int rank, const CallRecord* ring, uint32_t capacity) {
  GPUCOLL_CHECK_ARG(rank >= 0 && rank < nranks_, "rank must be in [0, ", nranks_, "); got ", rank);
  peers_[static_cast<size_t>(rank)] = {ring, ring == nullptr ? 0 : capacity};
}

std::vector<KernelTrace::PeerCalls> KernelTrace::peer_calls(const std::vector<int>& skip) {
  std::vector<PeerCalls> out(static_cast<size_t>(nranks_));
  if (records_ == nullptr) return out;
  DeviceGuard guard(device_);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now_dev = FlightRecorder::now_ns() + offset_ns_;
  std::vector<CallRecord> ring;
  for (int q = 0; q < nranks_; ++q) {
    const auto& [ptr, slots] = peers_[static_cast<size_t>(q)];
    if (ptr == nullptr || std::find(skip.begin(), skip.end(), q) != skip.end()) continue;
    ring.resize(slots);
    GPUCOLL_CUDA_CHECK(cudaMemcpyAsync(ring.data(), ptr, sizeof(CallRecord) * slots, cudaMemcpyDeviceToHost, stream_));
    GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    PeerCalls& p = out[static_cast<size_t>(q)];
    p.known = true;
    uint64_t entered_start = 0, done_end = 0;
    // Calls finish in order on a rank's stream: the newest opened slot is where its kernels are, the newest ended
    // one what they finished last.
    for (const CallRecord& r : ring) {
      if (r.seq > p.entered) {
        p.entered = r.seq;
        entered_start = r.start_ns;
      }
      if (r.end_ns != 0 && r.seq > p.done) {
        p.done = r.seq;
        done_end = r.end_ns;
      }
    }
    if (p.entered > p.done) p.in_for_s = 1e-9 * static_cast<double>(now_dev - static_cast<int64_t>(entered_start));
    if (p.done > 0) p.done_ago_s = 1e-9 * static_cast<double>(now_dev - static_cast<int64_t>(done_end));
  }
  return out;
}

}  // namespace gpucoll::cuda::custom
