#include "backends/custom/cuda/custom_comm.h"

#include <algorithm>
#include <mutex>
#include <tuple>

#include "check/call_mismatch.h"
#include "algo/double_binary_tree.h"
#include "algo/registry.h"
#include "backends/custom/eligibility.h"
#include "device/cuda/cuda_util.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::cuda::custom {

using gpucoll::custom::LaunchShape;

cudaError_t launch_algo(Algo algo, const AllReduceArgs& a, cudaStream_t stream) {
  switch (algo) {
    case Algo::kOneShot:
      return launch_one_shot(a, stream);
    case Algo::kTwoShot:
      return launch_two_shot(a, stream);
    case Algo::kRing:
      return launch_ring(a, stream);
    case Algo::kTree:
      return launch_tree(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t algo_blocks_per_sm(Algo algo, DType dtype, RedOp op, int* out) {
  switch (algo) {
    case Algo::kOneShot:
      return one_shot_blocks_per_sm(dtype, op, out);
    case Algo::kTwoShot:
      return two_shot_blocks_per_sm(dtype, op, out);
    case Algo::kRing:
      return ring_blocks_per_sm(dtype, op, out);
    case Algo::kTree:
      return tree_blocks_per_sm(dtype, op, out);
  }
  return cudaErrorInvalidValue;
}

namespace {

// The registry index of the schedule a kernel runs, for the call signature (the message names it by the
// registry's name: the custom 'tree' kernel runs the double binary tree, "dbt").
int32_t sig_algo(Algo a) {
  const std::string name = a == Algo::kTree ? algo::DoubleBinaryTree::kName : gpucoll::custom::algo_name(a);
  const auto& all = algo::algorithms();
  for (size_t i = 0; i < all.size(); ++i) {
    if (name == all[i]->name) return static_cast<int32_t>(i);
  }
  return -1;
}

// Occupancy per (algo, dtype, op), process-wide: the query is far slower than a launch.
int cached_blocks_per_sm(Algo algo, DType dtype, RedOp op, int device) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, int> cache;
  const auto key = std::make_tuple(static_cast<int>(algo), static_cast<int>(dtype), static_cast<int>(op), device);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  GPUCOLL_CUDA_CHECK(algo_blocks_per_sm(algo, dtype, op, &n));
  cache.emplace(key, n);
  return n;
}

}  // namespace

CustomComm::CustomComm(int rank, int nranks, int device, size_t half_bytes, double timeout_s)
    : rank_(rank), nranks_(nranks), device_(device) {
  GPUCOLL_CHECK_ARG(nranks >= 1 && nranks <= kMaxRanks, "the custom backend serves 1 to ", kMaxRanks,
                    " ranks; got nranks = ", nranks);
  GPUCOLL_CHECK_ARG(rank >= 0 && rank < nranks, "rank must be in [0, ", nranks, "); got ", rank);
  GPUCOLL_CHECK_ARG(timeout_s >= 0, "timeout must be >= 0 seconds; got ", timeout_s);
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
  mem_ = std::make_unique<RankMemory>(rank, device, half_bytes);
  bufs_.ptr[rank] = mem_->buffer();
  sigs_.ptr[rank] = mem_->signals();
  trace_ = std::make_unique<KernelTrace>(nranks, device, static_cast<int>(config_int("GPUCOLL_TRACE_BUFFER")));
  if (rank == 0) trace_->set_report(config_int("GPUCOLL_STRAGGLER_REPORT"));
  trace_->set_peer(rank, trace_->records(), trace_->record_capacity());
}

std::string CustomComm::records_handle() const {
  GPUCOLL_CHECK_ARG(trace_ != nullptr, "the communicator is closed");
  if (trace_->records() == nullptr) return "";
  DeviceGuard guard(device_);
  return export_range(trace_->records()).handle;
}

void CustomComm::connect_records(const std::vector<std::string>& handles, const std::vector<uint32_t>& capacities) {
  GPUCOLL_CHECK_ARG(trace_ != nullptr, "the communicator is closed");
  GPUCOLL_CHECK_ARG(handles.size() == static_cast<size_t>(nranks_) && capacities.size() == handles.size(),
                    "need one records handle and capacity per rank (", nranks_, ")");
  DeviceGuard guard(device_);
  for (int q = 0; q < nranks_; ++q) {
    if (q == rank_ || handles[q].empty()) continue;
    try {
      trace_->set_peer(q, static_cast<const CallRecord*>(mappings_.open(handles[q], q)), capacities[q]);
    } catch (const Error& e) {
      // Only the hang report reads it: without it, that rank is told from its process alone.
      GPUCOLL_WARN("custom backend: rank ", q, "'s flight recorder cannot be mapped: ", e.message());
    }
  }
}

CustomComm::~CustomComm() { close(); }

std::string CustomComm::ipc_handle() const {
  GPUCOLL_CHECK_ARG(mem_ != nullptr, "the communicator is closed");
  return mem_->ipc_handle();
}

void CustomComm::connect_ipc(const std::vector<std::string>& handles, int min_sms, int co_resident) {
  GPUCOLL_CHECK_ARG(!connected_, "the communicator is already connected");
  GPUCOLL_CHECK_ARG(co_resident >= 1 && co_resident <= nranks_, "co_resident must be in [1, ", nranks_, "]; got ",
                    co_resident);
  GPUCOLL_CHECK_ARG(handles.size() == static_cast<size_t>(nranks_), "need one IPC handle per rank (", nranks_,
                    "); got ", handles.size());
  DeviceGuard guard(device_);
  p2p_row_.assign(nranks_, 0);
  for (int q = 0; q < nranks_; ++q) {
    if (q != rank_) {
      // A peer the driver will not map is a P2P failure, not an error: this rank still publishes its row, so
      // every rank sees the same matrix and declines (to NCCL) together instead of some of them hanging.
      try {
        char* base = static_cast<char*>(mappings_.open(handles[q], q));
        sigs_.ptr[q] = base;
        bufs_.ptr[q] = base + RankMemory::kSignalsBytes;
      } catch (const Error& e) {
        GPUCOLL_WARN("custom backend: ", e.message());
        continue;
      }
    }
    p2p_row_[q] = probe_peer(static_cast<Signals*>(sigs_.ptr[q]), q) ? 1 : 0;
  }
  if (min_sms > 0) sms_ = std::min(sms_, min_sms);
  // Processes sharing a GPU: time-sliced contexts (no MPS) run one process's kernels at a time, and the cap costs
  // nothing there; under MPS their kernels run at once and spin on each other exactly like virtual ranks, so every
  // block of every one of them must be resident together (an H200 run of the process tests under MPS stalled).
  if (co_resident > 1) {
    gpucoll::custom::check_residency(co_resident, 1, sms_,
                                     cached_blocks_per_sm(Algo::kRing, DType::kF64, RedOp::kAvg, device_));
  }
  alloc_table();
  co_resident_ = co_resident;
  connected_ = true;
}

void CustomComm::connect_local(const std::vector<CustomComm*>& comms) {
  GPUCOLL_CHECK_ARG(!connected_, "the communicator is already connected");
  GPUCOLL_CHECK_ARG(comms.size() == static_cast<size_t>(nranks_), "need one communicator per rank (", nranks_,
                    "); got ", comms.size());
  GPUCOLL_CHECK_ARG(comms[rank_] == this, "comms[", rank_, "] must be this communicator");
  for (int q = 0; q < nranks_; ++q) {
    const CustomComm* c = comms[q];
    GPUCOLL_CHECK_ARG(c != nullptr && c->mem_ != nullptr && c->rank_ == q && c->nranks_ == nranks_,
                      "comms[", q, "] must be open rank ", q, " of ", nranks_);
    GPUCOLL_CHECK_ARG(c->device_ == device_, "virtual ranks must share one device: rank ", q, " is on cuda:",
                      c->device_, ", rank ", rank_, " on cuda:", device_);
    GPUCOLL_CHECK_ARG(c->half_bytes() == half_bytes(), "every rank needs the same staging size");
    bufs_.ptr[q] = c->mem_->buffer();
    sigs_.ptr[q] = c->mem_->signals();
    trace_->set_peer(q, c->trace_->records(), c->trace_->record_capacity());
  }
  DeviceGuard guard(device_);
  // Every virtual rank needs at least one resident block next to the others'.
  gpucoll::custom::check_residency(nranks_, 1, sms_, cached_blocks_per_sm(Algo::kRing, DType::kF64, RedOp::kAvg, device_));
  p2p_row_.assign(nranks_, 0);
  for (int q = 0; q < nranks_; ++q) p2p_row_[q] = probe_peer(static_cast<Signals*>(sigs_.ptr[q]), q) ? 1 : 0;
  alloc_table();
  co_resident_ = nranks_;
  connected_ = true;
}

ExportedRange CustomComm::export_buffer(uintptr_t ptr) const {
  DeviceGuard guard(device_);
  return export_range(reinterpret_cast<const void*>(ptr));
}

void CustomComm::alloc_table() {
  GPUCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&table_), sizeof(PeerTable) * kMaxRegistered));
  // Zeroed: a graph replayed before register_graph_buffers() filled its slot meets null pointers (a fault that
  // names itself) rather than whatever the allocation held, which may map to live memory and read wrong data.
  GPUCOLL_CUDA_CHECK(cudaMemset(table_, 0, sizeof(PeerTable) * kMaxRegistered));
}

int CustomComm::take_slot() {
  if (next_slot_ >= kMaxRegistered) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "register", "this communicator already registered ", kMaxRegistered,
                  " buffers (the limit); register long-lived buffers once and reuse them");
  }
  return next_slot_++;
}

void CustomComm::fill_slot(int slot, const PeerTable& t) {
  DeviceGuard guard(device_);
  GPUCOLL_CUDA_CHECK(cudaMemcpy(table_ + slot, &t, sizeof(t), cudaMemcpyHostToDevice));
}

void CustomComm::register_ipc(uintptr_t ptr, size_t bytes, const std::vector<ExportedRange>& peers) {
  GPUCOLL_CHECK_ARG(connected_, "register needs a connected communicator");
  GPUCOLL_CHECK_ARG(peers.size() == static_cast<size_t>(nranks_), "need one exported range per rank");
  PeerTable t{};
  DeviceGuard guard(device_);
  for (int q = 0; q < nranks_; ++q) {
    t.ptr[q] = q == rank_ ? reinterpret_cast<void*>(ptr)
                          : static_cast<char*>(mappings_.open(peers[q].handle, q)) + peers[q].offset;
  }
  std::vector<uintptr_t> ptrs(nranks_);
  for (int q = 0; q < nranks_; ++q) ptrs[q] = reinterpret_cast<uintptr_t>(t.ptr[q]);
  register_local(ptr, bytes, ptrs);
}

void CustomComm::register_local(uintptr_t ptr, size_t bytes, const std::vector<uintptr_t>& peer_ptrs) {
  GPUCOLL_CHECK_ARG(connected_, "register needs a connected communicator");
  GPUCOLL_CHECK_ARG(peer_ptrs.size() == static_cast<size_t>(nranks_), "need one pointer per rank (", nranks_,
                    "); got ", peer_ptrs.size());
  GPUCOLL_CHECK_ARG(peer_ptrs[rank_] == ptr, "this rank's entry must be the registered pointer itself");
  PeerTable t{};
  for (int q = 0; q < nranks_; ++q) t.ptr[q] = reinterpret_cast<void*>(peer_ptrs[q]);
  auto it = registered_.find(ptr);
  const int slot = it != registered_.end() ? it->second.slot : take_slot();
  fill_slot(slot, t);
  registered_[ptr] = Registered{slot, bytes};
}

bool CustomComm::is_registered(uintptr_t ptr, size_t bytes) const { return registered_bytes(ptr) >= bytes && bytes > 0; }

size_t CustomComm::registered_bytes(uintptr_t ptr) const {
  auto it = registered_.find(ptr);
  return it == registered_.end() ? 0 : it->second.bytes;
}

std::vector<std::pair<uintptr_t, size_t>> CustomComm::pending() const {
  std::vector<std::pair<uintptr_t, size_t>> out;
  for (const auto& [ptr, reg] : pending_) out.emplace_back(ptr, reg.bytes);
  return out;
}

void CustomComm::register_pending_local(const std::vector<std::vector<uintptr_t>>& peer_ptrs) {
  GPUCOLL_CHECK_ARG(peer_ptrs.size() == pending_.size(), "need peer pointers for each of the ", pending_.size(),
                    " buffers first seen during capture; got ", peer_ptrs.size());
  for (size_t i = 0; i < pending_.size(); ++i) {
    const auto& [ptr, reg] = pending_[i];
    GPUCOLL_CHECK_ARG(peer_ptrs[i].size() == static_cast<size_t>(nranks_) && peer_ptrs[i][rank_] == ptr,
                      "pending buffer ", i, ": need one pointer per rank, this rank's being the buffer itself");
    PeerTable t{};
    for (int q = 0; q < nranks_; ++q) t.ptr[q] = reinterpret_cast<void*>(peer_ptrs[i][q]);
    fill_slot(reg.slot, t);
    registered_[ptr] = reg;
  }
  pending_.clear();
}

void CustomComm::register_pending_ipc(const std::vector<std::vector<ExportedRange>>& peers) {
  GPUCOLL_CHECK_ARG(peers.size() == pending_.size(), "need exported ranges for each of the ", pending_.size(),
                    " buffers first seen during capture; got ", peers.size());
  std::vector<std::vector<uintptr_t>> ptrs(peers.size());
  DeviceGuard guard(device_);
  for (size_t i = 0; i < peers.size(); ++i) {
    GPUCOLL_CHECK_ARG(peers[i].size() == static_cast<size_t>(nranks_), "pending buffer ", i,
                      ": need one range per rank");
    ptrs[i].resize(nranks_);
    for (int q = 0; q < nranks_; ++q) {
      ptrs[i][q] = q == rank_ ? pending_[i].first
                              : reinterpret_cast<uintptr_t>(mappings_.open(peers[i][q].handle, q)) + peers[i][q].offset;
    }
  }
  register_pending_local(ptrs);
}

int CustomComm::max_blocks_for(Algo algo, DType dtype, RedOp op) const {
  if (co_resident_ <= 1) return 0;
  return residency_cap(cached_blocks_per_sm(algo, dtype, op, device_));
}

int CustomComm::residency_cap(int blocks_per_sm) const {
  const int cap = gpucoll::custom::max_blocks_per_rank(co_resident_, sms_, blocks_per_sm);
  if (cap < 1) gpucoll::custom::check_residency(co_resident_, 1, sms_, blocks_per_sm);
  return cap;
}

AllReduceArgs CustomComm::call_args(DType dtype, RedOp op, size_t count, int32_t algo, Wire wire) {
  AllReduceArgs a;
  a.dtype = dtype;
  a.op = op;
  a.wire = wire;
  a.rank = rank_;
  a.nranks = nranks_;
  a.bufs = bufs_;
  a.sigs = sigs_;
  a.half_bytes = mem_->half_bytes();
  a.timeout_ns = timeout_ns_;
  // The whole call's count, not a piece's: ranks whose counts differ may agree on the first piece.
  a.sig = algo::make_call_sig(seq_++, static_cast<int32_t>(algo::Coll::kAllReduce), static_cast<int32_t>(dtype),
                              static_cast<int32_t>(op), -1, static_cast<int64_t>(count), algo, 0, false);
  a.sig.wire = static_cast<uint8_t>(wire);
  a.check = call_check_;
  return a;
}

LaunchShape CustomComm::shape_for(Algo algo, size_t bytes, DType dtype, RedOp op) const {
  // The occupancy query behind the residency cap runs on the current device: make it this communicator's.
  DeviceGuard guard(device_);
  return gpucoll::custom::choose_launch_shape(algo, bytes, nranks_, sms_, max_blocks_for(algo, dtype, op));
}

std::string CustomComm::set_placement(const std::vector<std::string>& hosts, const std::vector<uint8_t>& p2p) {
  GPUCOLL_CHECK_ARG(hosts.size() == static_cast<size_t>(nranks_), "set_placement: ", hosts.size(), " hosts for ",
                    nranks_, " ranks");
  placement_problem_ = gpucoll::custom::placement_problem(nranks_, hosts, p2p);
  return placement_problem_;
}

std::string CustomComm::run_all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, bool premul,
                                       const std::string& algo, cudaStream_t stream) {
  if (!placement_problem_.empty()) return placement_problem_;
  gpucoll::custom::Facts f;
  f.dtype = dtype;
  f.op = op;
  f.premul = premul;
  f.count = count;
  f.in_ptr = reinterpret_cast<uintptr_t>(in);
  f.out_ptr = reinterpret_cast<uintptr_t>(out);
  f.registered_bytes = registered_bytes(f.in_ptr);
  f.registered = f.registered_bytes > 0;
  gpucoll::custom::Decision d = gpucoll::custom::check_call(f);
  if (d.alignment) {
    GPUCOLL_INVALID_ARG("x and out must be aligned to their element size for the custom backend: ", d.reason);
  }
  if (!d.ok) return std::move(d.reason);
  Algo a;
  if (algo == "auto") {
    a = gpucoll::custom::choose_algo(count * dtype_size(dtype), nranks_);
  } else {
    GPUCOLL_CHECK_ARG(gpucoll::custom::parse_algo(algo, &a),
                      "algo must be one of oneshot, twoshot, ring, tree (or dbt); got '", algo, "'");
  }
  all_reduce(in, out, count, dtype, op, a, stream);
  return {};
}

size_t CustomComm::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Algo algo,
                              cudaStream_t stream, int max_blocks, int64_t only_piece) {
  if (!connected_) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "all_reduce", "the custom communicator is not connected");
  GPUCOLL_CHECK_ARG(gpucoll::custom::dtype_supported(dtype), "dtype ", dtype_name(dtype), " has no custom kernel");
  GPUCOLL_CHECK_ARG(gpucoll::custom::op_supported(op), "op ", redop_name(op), " has no custom kernel");
  if (count == 0) return 0;
  const size_t esize = dtype_size(dtype);
  // Every call goes through a staging half, piece by piece (a registered one-shot holds its result there when
  // it runs in place); every rank cuts the same pieces, one call number each.
  const size_t piece = gpucoll::custom::piece_elems(mem_->half_bytes(), esize);
  const size_t npieces = (count + piece - 1) / piece;
  GPUCOLL_CHECK_ARG(only_piece < static_cast<int64_t>(npieces), "piece ", only_piece, " of a call cut into ", npieces,
                    " pieces");
  DeviceGuard guard(device_);
  const size_t bytes = count * esize;
  const uintptr_t key = reinterpret_cast<uintptr_t>(in);
  const PeerTable* inputs = nullptr;
  if (algo == Algo::kOneShot || algo == Algo::kTwoShot) {
    auto it = registered_.find(key);
    if (it != registered_.end() && it->second.bytes >= bytes) {
      inputs = slot_ptr(it->second.slot);
    } else if (defer_ && stream_is_capturing(stream)) {
      auto p = std::find_if(pending_.begin(), pending_.end(), [&](const auto& e) { return e.first == key; });
      if (p == pending_.end()) {
        pending_.emplace_back(key, Registered{take_slot(), bytes});
        p = pending_.end() - 1;
      }
      p->second.bytes = std::max(p->second.bytes, bytes);
      inputs = slot_ptr(p->second.slot);
    }
  }
  AllReduceArgs a = call_args(dtype, op, count, sig_algo(algo), Wire::kNone);
  a.inputs = inputs;
  // A piece enqueued alone (virtual ranks) is its own call to the recorder; the pieces after the first record nothing.
  const bool recorded = only_piece <= 0 && trace_->records() != nullptr;
  const uint64_t entry = recorded ? trace_->begin(a.sig, static_cast<int64_t>(bytes), stream_is_capturing(stream))
                                  : FlightRecorder::kOff;
  a.records = recorded ? trace_->records() : nullptr;
  a.record_capacity = recorded ? trace_->record_capacity() : 0;
  int cap = max_blocks_for(algo, dtype, op);
  if (max_blocks > 0) cap = cap > 0 ? std::min(cap, max_blocks) : max_blocks;
  for (size_t i = 0; i < npieces; ++i) {
    if (only_piece >= 0 && static_cast<size_t>(only_piece) != i) continue;
    const size_t off = i * piece;
    const size_t n = std::min(piece, count - off);
    a.in = static_cast<const char*>(in) + off * esize;
    a.out = static_cast<char*>(out) + off * esize;
    a.count = n;
    a.in_offset = off;
    a.continuation = i > 0;
    a.last_piece = i + 1 == npieces || only_piece >= 0;
    const LaunchShape shape = gpucoll::custom::choose_launch_shape(algo, n * esize, nranks_, sms_, cap);
    a.blocks = shape.blocks;
    a.threads = shape.threads;
    const cudaError_t err = launch_algo(algo, a, stream);
    if (err != cudaSuccess && recorded) trace_->launch_failed(entry);
    GPUCOLL_CUDA_CHECK(err);
  }
  return npieces;
}

void CustomComm::compressed_all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Wire wire,
                                       cudaStream_t stream) {
  if (!connected_) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "all_reduce", "the custom communicator is not connected");
  if (!placement_problem_.empty()) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "all_reduce", "compress='", wire_name(wire),
                  "' needs gpucoll's kernels, which cannot run on this communicator: ", placement_problem_);
  }
  GPUCOLL_CHECK_ARG(wire != Wire::kNone, "compress needs a wire format");
  GPUCOLL_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16, "compress='",
                    wire_name(wire), "' needs float32, float16 or bfloat16 data; got ", dtype_name(dtype));
  GPUCOLL_CHECK_ARG(op == RedOp::kSum || op == RedOp::kAvg, "compress='", wire_name(wire),
                    "' reduces with op sum or avg only; got ", redop_name(op));
  if (count == 0) return;
  const size_t esize = dtype_size(dtype);
  const size_t piece = compressed_piece_elems(mem_->half_bytes(), wire);
  GPUCOLL_INTERNAL_CHECK(piece > 0);
  const size_t npieces = (count + piece - 1) / piece;
  DeviceGuard guard(device_);
  AllReduceArgs a = call_args(dtype, op, count, -1, wire);
  const bool recorded = trace_->records() != nullptr;
  const uint64_t entry = recorded ? trace_->begin(a.sig, static_cast<int64_t>(count * esize),
                                                  stream_is_capturing(stream))
                                  : FlightRecorder::kOff;
  a.records = recorded ? trace_->records() : nullptr;
  a.record_capacity = recorded ? trace_->record_capacity() : 0;
  // Virtual ranks share the device: every rank's blocks must be resident at once (as max_blocks_for).
  int cap = 0;
  if (co_resident_ > 1) {
    int bps = 0;
    GPUCOLL_CUDA_CHECK(compressed_blocks_per_sm(dtype, &bps));
    cap = residency_cap(bps);
  }
  for (size_t i = 0; i < npieces; ++i) {
    const size_t off = i * piece;
    const size_t n = std::min(piece, count - off);
    a.in = static_cast<const char*>(in) + off * esize;
    a.out = static_cast<char*>(out) + off * esize;
    a.count = n;
    a.in_offset = off;
    a.continuation = i > 0;
    a.last_piece = i + 1 == npieces;
    const LaunchShape shape = gpucoll::custom::choose_launch_shape(Algo::kTwoShot, n * esize, nranks_, sms_, cap);
    a.blocks = shape.blocks;
    a.threads = kThreads;
    const cudaError_t err = launch_compressed(a, stream);
    if (err != cudaSuccess && recorded) trace_->launch_failed(entry);
    GPUCOLL_CUDA_CHECK(err);
  }
}

uint32_t CustomComm::timed_out() const {
  if (mem_ == nullptr) return 0;
  DeviceGuard guard(device_);
  uint32_t v = 0;
  GPUCOLL_CUDA_CHECK(cudaMemcpy(&v, &mem_->signals()->timed_out, sizeof(v), cudaMemcpyDeviceToHost));
  return v;
}

void CustomComm::check_calls() {
  if (mem_ == nullptr) return;
  DeviceGuard guard(device_);
  const Signals* sig = mem_->signals();
  uint64_t n = 0;
  GPUCOLL_CUDA_CHECK(cudaMemcpy(&n, &sig->mismatches, sizeof(n), cudaMemcpyDeviceToHost));
  if (n == reported_) return;
  const uint64_t unreported = n - reported_ - 1;
  reported_ = n;
  algo::CallSig table[kMaxRanks];
  GPUCOLL_CUDA_CHECK(cudaMemcpy(table, sig->bad, sizeof(algo::CallSig) * nranks_, cudaMemcpyDeviceToHost));
  std::vector<int> odd;
  for (int q = 1; q < nranks_; ++q) {
    if (!algo::call_sig_equal(table[0], table[q])) odd.push_back(q);
  }
  std::string message = algo::call_mismatch_message(table, nranks_);
  message += "\nThe custom kernels found it before moving any data: no rank read a peer's data or wrote its output in "
             "that call (outputs hold what they held before), and the communicator is still usable.";
  if (unreported > 0) {
    message += " " + std::to_string(unreported) + " earlier mismatched call(s) since the last check went the same way.";
  }
  throw Error(ErrorCode::kInvalidArgument, message, "all_reduce", __FILE__, __LINE__, odd);
}

std::vector<int> CustomComm::late_ranks() const {
  std::vector<int> out;
  if (mem_ == nullptr) return out;
  DeviceGuard guard(device_);
  uint32_t mask = 0;
  GPUCOLL_CUDA_CHECK(cudaMemcpy(&mask, &mem_->signals()->late_ranks, sizeof(mask), cudaMemcpyDeviceToHost));
  for (int q = 0; q < nranks_; ++q) {
    if ((mask >> q) & 1u) out.push_back(q);
  }
  return out;
}

void CustomComm::synchronize() const {
  DeviceGuard guard(device_);
  GPUCOLL_CUDA_CHECK(cudaDeviceSynchronize());
}

void CustomComm::close() noexcept {
  if (mem_ == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) cudaSetDevice(device_);
  // Kernels of this rank may still read peers' memory: finish them before unmapping it.
  if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
  uint64_t mismatches = reported_;
  if (cudaMemcpy(&mismatches, &mem_->signals()->mismatches, sizeof(mismatches), cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    cudaGetLastError();
  } else if (mismatches != reported_) {
    GPUCOLL_WARN("custom backend: rank ", rank_, " closes with ", mismatches - reported_, " mismatched call(s) never "
                 "reported (ranks made different all_reduce calls; no data moved in them): nothing synchronised "
                 "with the communicator after them (barrier(), or wait on an async call's Work)");
  }
  mappings_.close_all();
  if (table_ != nullptr && cudaFree(table_) != cudaSuccess) cudaGetLastError();
  table_ = nullptr;
  mem_->release();
  mem_.reset();
  trace_.reset();
  registered_.clear();
  pending_.clear();
  connected_ = false;
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

}  // namespace gpucoll::cuda::custom
