#include "backends/host/host_comm.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "check/call_mismatch.h"
#include "backends/host/kernels.h"
#include "core/premul.h"
#include "backends/host/region.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::host {

namespace {
constexpr size_t kMaxFused = 16;

// The algorithm as a signature field: its registry index; hierarchical schedules also depend on the node size.
int32_t algo_index(const algo::Algorithm& a) {
  const auto& all = algo::algorithms();
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == &a) return static_cast<int32_t>(i);
  }
  return -1;
}
bool uses_local_size(const algo::Algorithm& a) {
  static const algo::Algorithm* const hierarchical = algo::find_algorithm("hierarchical");
  return &a == hierarchical;
}
}  // namespace

HostComm::HostComm(const HostOptions& options, const ShmHandle* attach_to)
    : opt_(options),
      stragglers_(std::max(options.nranks, 1), kStragglerWindow),
      trace_(options.trace_capacity),
      arrivals_(static_cast<size_t>(std::max(options.nranks, 1))) {
  GPUCOLL_CHECK_ARG(opt_.nranks >= 1, "world_size must be >= 1, got ", opt_.nranks);
  GPUCOLL_CHECK_ARG(opt_.rank >= 0 && opt_.rank < opt_.nranks, "rank must be in [0, ", opt_.nranks, "), got ",
                    opt_.rank);
  GPUCOLL_CHECK_ARG(opt_.buffer_bytes >= 4096, "GPUCOLL_HOST_BUFFER_BYTES must be at least 4096, got ",
                    opt_.buffer_bytes);
  opt_.buffer_bytes = static_cast<int64_t>(align_up(static_cast<size_t>(opt_.buffer_bytes), kPageAlign));
  opt_.segment_bytes = std::max<int64_t>(opt_.segment_bytes, 64);
  spin_ns_ = std::max<int64_t>(opt_.spin_us, 0) * 1000;
  // p2p slots: up to 1 MiB each, shrinking with P^2 so that the region stays within 256 MiB of address space
  // (tmpfs only backs the pages that are touched, so unused pairs cost nothing).
  const size_t P = static_cast<size_t>(opt_.nranks);
  slot_bytes_ = std::clamp<size_t>((size_t{256} << 20) / (2 * P * P), size_t{64} << 10, size_t{1} << 20);
  slot_bytes_ = align_up(slot_bytes_, kPageAlign) - kSlotHeaderBytes;
  const RegionLayout layout(opt_.nranks, static_cast<size_t>(opt_.buffer_bytes), slot_bytes_);
  work_offset_ = layout.work_offset;
  pair_offset_ = layout.pair_offset;
  slot_offset_ = layout.slot_offset;
  if (attach_to == nullptr) {
    shm_.create(layout.total);
    auto* h = static_cast<RegionHeader*>(shm_.data());
    h->magic = kRegionMagic;
    h->nranks = opt_.nranks;
    h->buffer_bytes = static_cast<uint64_t>(opt_.buffer_bytes);
    h->slot_bytes = slot_bytes_;
    h->token[0] = shm_.handle().token[0];
    h->token[1] = shm_.handle().token[1];
  } else {
    shm_.attach(*attach_to);
    const std::string& where = shm_.describe();
    const auto* h = static_cast<const RegionHeader*>(shm_.data());
    if (shm_.size() < sizeof(RegionHeader) || h->magic != kRegionMagic || h->token[0] != attach_to->token[0] ||
        h->token[1] != attach_to->token[1]) {
      GPUCOLL_INVALID_ARG("the file at ", where, " is not this job's host-backend region (wrong magic or token)");
    }
    if (h->nranks != opt_.nranks || h->buffer_bytes != static_cast<uint64_t>(opt_.buffer_bytes) ||
        shm_.size() != layout.total) {
      GPUCOLL_INVALID_ARG("ranks disagree on the communicator: rank 0 created it for world_size=", h->nranks,
                          " with ", h->buffer_bytes, "-byte buffers, this rank expects world_size=", opt_.nranks,
                          " with ", opt_.buffer_bytes, " (check world_size and GPUCOLL_HOST_BUFFER_BYTES)");
    }
  }
  p2p_sent_.assign(P, 0);
  p2p_recvd_.assign(P, 0);
  Ctl* me = ctl(opt_.rank);
  me->pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  me->attached.store(1, std::memory_order_release);
  auto* h = static_cast<RegionHeader*>(shm_.data());
  h->attached.fetch_add(1, std::memory_order_acq_rel);
}

HostComm::~HostComm() { close(); }

Ctl* HostComm::ctl(int rank) const {
  char* base = static_cast<char*>(shm_.data()) + align_up(sizeof(RegionHeader), 128);
  return reinterpret_cast<Ctl*>(base) + rank;
}

PairCtl* HostComm::pair(int src, int dst) const {
  char* base = static_cast<char*>(shm_.data()) + pair_offset_;
  return reinterpret_cast<PairCtl*>(base) + (static_cast<size_t>(src) * opt_.nranks + dst);
}

char* HostComm::slot(int src, int dst, uint64_t piece) const {
  const size_t stride = kSlotHeaderBytes + slot_bytes_;
  const size_t index = (static_cast<size_t>(src) * opt_.nranks + dst) * kP2PSlots + piece % kP2PSlots;
  return static_cast<char*>(shm_.data()) + slot_offset_ + stride * index;
}

char* HostComm::work(int rank, int half) const {
  return static_cast<char*>(shm_.data()) + work_offset_ + static_cast<size_t>(opt_.buffer_bytes) * rank +
         static_cast<size_t>(opt_.buffer_bytes / 2) * half;
}

void HostComm::wait_attached() {
  auto* h = static_cast<RegionHeader*>(shm_.data());
  const int64_t deadline = now_ns() + static_cast<int64_t>(opt_.timeout_s * 1e9);
  while (h->attached.load(std::memory_order_acquire) < static_cast<uint32_t>(opt_.nranks)) {
    if (now_ns() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < opt_.nranks; ++r) {
        if (ctl(r)->attached.load(std::memory_order_acquire) == 0) missing.push_back(r);
      }
      shm_.close_fd();
      std::string list;
      for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
      throw Error(ErrorCode::kTimeout,
                  "host communicator set-up timed out after " + std::to_string(opt_.timeout_s) +
                      " s: rank(s) " + list + " never attached to the shared-memory region",
                  "HostComm::wait_attached", __FILE__, __LINE__, missing);
    }
    usleep(200);
  }
  shm_.close_fd();  // every rank maps the region now: it lives exactly as long as they do
  GPUCOLL_DEBUG("host communicator ready: ", opt_.nranks, " ranks, ", opt_.buffer_bytes, "-byte work buffers");
}

void HostComm::close() noexcept {
  if (closed_) return;
  progress_.stop();
  closed_ = true;
  // A thread left running at interpreter exit (stop_progress_for) may still be waiting in the region: it stays.
  if (progress_.abandoned()) return;
  if (shm_.data() != nullptr) {
    // Peers still waiting in a collective on this rank learn that it will not come (see raise_peer_closed).
    Ctl* me = ctl(opt_.rank);
    me->closed_after.store(op_seq_, std::memory_order_relaxed);
    me->closed.store(1, std::memory_order_seq_cst);
    futex_wake_all(&me->done.value);
  }
  shm_.close_fd();
  shm_.unmap();
}

void HostComm::abort(const std::string& reason) noexcept {
  if (aborted_.load(std::memory_order_acquire)) return;
  try {
    abort_reason_ = reason;
  } catch (...) {  // no memory for the text: the error says "abort" alone
  }
  aborted_.store(true, std::memory_order_release);
}

void HostComm::check_usable(const char* what) const {
  if (aborted_.load(std::memory_order_acquire)) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, what, what, " on an aborted communicator (", abort_reason_, ")");
  }
  if (closed_) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, what, what, " on a closed communicator (close() was called)");
  }
  if (broken_) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, what, what,
                  " on a broken communicator: an earlier collective failed (timeout or peer failure), so ranks "
                  "are out of step; create a new communicator");
  }
}

void HostComm::begin_op(const char* what, int coll) {
  check_usable(what);
  current_ = what;
  in_p2p_ = false;
  ++op_seq_;
  awake_ns_ = now_ns();
  Ctl* me = ctl(opt_.rank);
  me->arrived_us[op_seq_ & 1].store(static_cast<uint32_t>(awake_ns_ / 1000), std::memory_order_relaxed);
  me->in_coll.store(coll, std::memory_order_relaxed);
  me->op_seq.store(op_seq_, std::memory_order_release);
  stalled_ns_ = 0;
  deadline_ns_ = awake_ns_ + static_cast<int64_t>(opt_.timeout_s * 1e9);
}

void HostComm::end_op(int coll, TraceState state) {
  Ctl* me = ctl(opt_.rank);
  const int64_t now = now_ns();
  trace_.end(trace_id_, state, now);
  me->done_ns.store(now, std::memory_order_relaxed);
  me->done_coll.store(coll, std::memory_order_relaxed);
  me->done_seq.store(op_seq_, std::memory_order_release);
}

void HostComm::begin_p2p(const char* what, const std::vector<P2POp>& ops) {
  check_usable(what);
  current_ = what;
  in_p2p_ = true;
  ++p2p_seq_;
  awake_ns_ = now_ns();
  int64_t sent = 0;
  int32_t peer = -1;
  for (const P2POp& op : ops) {
    if (op.send) sent += op.bytes;
    peer = (peer == -1 || peer == op.peer) ? op.peer : -2;
  }
  algo::CallSig sig{};
  sig.seq = static_cast<uint32_t>(p2p_seq_);
  sig.coll = kTraceP2P;
  sig.count = static_cast<int64_t>(ops.size());
  sig.root = peer;  // the one peer of the batch, -2 for several
  sig.dtype = sig.op = sig.algo = algo::kSigNone;
  trace_id_ = trace_.begin(p2p_seq_, sig, sent, TraceBackend::kHost, awake_ns_, awake_ns_);
  Ctl* me = ctl(opt_.rank);
  const P2PKind kind = ops.size() != 1 ? P2PKind::kGroup : ops[0].send ? P2PKind::kSend : P2PKind::kRecv;
  me->p2p_kind.store(static_cast<int32_t>(kind), std::memory_order_relaxed);
  me->p2p_peer.store(peer, std::memory_order_relaxed);
  me->p2p_ns.store(awake_ns_, std::memory_order_relaxed);
  me->p2p_begun.store(p2p_seq_, std::memory_order_release);
  stalled_ns_ = 0;
  deadline_ns_ = awake_ns_ + static_cast<int64_t>(opt_.timeout_s * 1e9);
}

void HostComm::wait_war(int half) {
  const War& w = war_[half];
  for (int q : w.readers) wait_done(q, w.target);
}

void HostComm::complete_step(const std::vector<int>& readers, int half) {
  complete_sync_step();
  war_[half].target = done_;
  war_[half].readers = readers;
}

void HostComm::complete_sync_step() {
  ++done_;
  // seq_cst store publishes every write of this step (release) before peers see the new count.
  publish(&ctl(opt_.rank)->done, done_);
}

void HostComm::post_sig(const algo::CallSig& sig) {
  if (call_check_) ctl(opt_.rank)->sig[op_seq_ & 1] = sig;
}

void HostComm::wait_all_arrived() {
  for (int q = 0; q < opt_.nranks; ++q) {
    if (q != opt_.rank) wait_done(q, done_);
  }
}

void HostComm::check_arrivals(const algo::CallSig& sig) {
  if (!call_check_) return;  // (benchmarks only) the schedule's own waits follow
  wait_all_arrived();
  // The signatures were written before the steps just waited for were published (release/acquire).
  const size_t slot = op_seq_ & 1;
  bool same = true;
  for (int q = 0; q < opt_.nranks && same; ++q) same = algo::call_sig_equal(ctl(q)->sig[slot], sig);
  if (same) {
    // Relative to this rank's own arrival: the 32-bit clock wraps, differences do not (region.h).
    const uint32_t mine = ctl(opt_.rank)->arrived_us[slot].load(std::memory_order_relaxed);
    for (int q = 0; q < opt_.nranks; ++q) {
      const auto d = static_cast<int32_t>(ctl(q)->arrived_us[slot].load(std::memory_order_relaxed) - mine);
      arrivals_[static_cast<size_t>(q)] = int64_t{d} * 1000;
    }
    const int64_t measured = stragglers_.add(arrivals_.data());
    if (opt_.straggler_report > 0 && opt_.rank == 0 && measured % opt_.straggler_report == 0) {
      log_write(LogLevel::kInfo, stragglers_.summary());  // asked for by name: whatever GPUCOLL_LOG_LEVEL says
    }
    return;
  }
  std::vector<algo::CallSig> table(static_cast<size_t>(opt_.nranks));
  for (int q = 0; q < opt_.nranks; ++q) table[static_cast<size_t>(q)] = ctl(q)->sig[slot];
  // ranks(): those whose call differs from rank 0's - the same list on every rank, like the message.
  std::vector<int> odd;
  for (int q = 1; q < opt_.nranks; ++q) {
    if (!algo::call_sig_equal(table[0], table[static_cast<size_t>(q)])) odd.push_back(q);
  }
  throw CallMismatch(algo::call_mismatch_message(table.data(), opt_.nranks), current_, odd, __FILE__, __LINE__);
}

const HostComm::Plan& HostComm::plan_for(const algo::Algorithm& a, const algo::Params& p) {
  auto key = std::make_tuple(&a, static_cast<int>(p.coll), p.root, p.local_size);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan plan;
  plan.shape = a.shape(p);
  const int P = p.nranks;
  std::vector<algo::Op> buf(static_cast<size_t>(std::max(plan.shape.max_ops, 1)));
  plan.steps.resize(static_cast<size_t>(plan.shape.nsteps));
  for (int t = 0; t < plan.shape.nsteps; ++t) {
    StepPlan& sp = plan.steps[static_cast<size_t>(t)];
    for (int r = 0; r < P; ++r) {
      const int n = a.step_ops(p, r, t, buf.data());
      GPUCOLL_INTERNAL_CHECK(n <= plan.shape.max_ops);
      for (int i = 0; i < n; ++i) {
        const algo::Op& op = buf[static_cast<size_t>(i)];
        if (r == opt_.rank) {
          sp.ops.push_back(op);
          if (op.peer != r && std::find(sp.raw_peers.begin(), sp.raw_peers.end(), op.peer) == sp.raw_peers.end())
            sp.raw_peers.push_back(op.peer);
        } else if (op.peer == opt_.rank &&
                   std::find(sp.readers.begin(), sp.readers.end(), r) == sp.readers.end()) {
          sp.readers.push_back(r);
        }
      }
    }
  }
  return plans_.emplace(key, std::move(plan)).first->second;
}

void HostComm::run(const CollArgs& a, const algo::Algorithm& algorithm) {
  in_order();
  const char* what = algo::coll_name(a.coll);
  if (dtype_is_fp8(a.dtype)) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, what, "the host backend has no arithmetic for ", dtype_name(a.dtype),
                  " (fp8 collectives need the NCCL backend, NCCL >= 2.24)");
  }
  // The pre-multiplier of every input element: premul_sum's scalar (validated before the op starts, so a bad one
  // leaves every rank in step), or avg's 1/n on floating types (core/dispatch.h: avg as NCCL computes it).
  unsigned char scale[8];
  bool scaled = false;
  if (algo::coll_reduces(a.coll)) {
    if (a.premul) {
      GPUCOLL_CHECK_ARG(a.op == RedOp::kSum, "premul_sum is a sum; got op ", redop_name(a.op));
      premul_scalar_bytes(a.dtype, a.premul_scalar, scale);
      scaled = true;
    } else if (a.op == RedOp::kAvg) {
      scaled = avg_scalar_bytes(a.dtype, opt_.nranks, scale);
    }
  } else {
    GPUCOLL_CHECK_ARG(!a.premul, "premul_sum applies to all_reduce, reduce and reduce_scatter; got ", what);
  }
  begin_op(what, static_cast<int>(a.coll));
  algo::Params p;
  p.coll = a.coll;
  p.nranks = opt_.nranks;
  p.root = a.root;
  p.local_size = a.local_size > 0 ? a.local_size : opt_.nranks;
  // A compressed call runs its own schedule: the signature carries its format instead of an algorithm.
  const bool compressed = a.wire != Wire::kNone;
  algo::CallSig sig = algo::make_call_sig(
      static_cast<uint32_t>(op_seq_), static_cast<int32_t>(a.coll), static_cast<int32_t>(a.dtype),
      a.premul ? algo::kSigPremulSum : static_cast<int32_t>(a.op), a.root, a.count,
      compressed ? -1 : algo_index(algorithm), !compressed && uses_local_size(algorithm) ? p.local_size : 0,
      a.auto_algo && !compressed);
  sig.wire = static_cast<uint8_t>(a.wire);
  trace_id_ = trace_.begin(op_seq_, sig, a.count * static_cast<int64_t>(dtype_size(a.dtype)), TraceBackend::kHost,
                           awake_ns_, awake_ns_);
  // Checked after the signatures are compared (below), so that a call no rank can run fails on every rank alike
  // and one that only some ranks made is reported as a mismatch.
  const char* why = compressed ? compress_unusable(a) : algorithm.unusable(p);
  auto refuse = [&]() {
    if (compressed) {
      GPUCOLL_THROW(ErrorCode::kInvalidArgument, what, "compress='", wire_name(a.wire), "' cannot run ", what,
                    " here: ", why, "; got dtype ", dtype_name(a.dtype), ", op ",
                    a.premul ? "premul_sum" : redop_name(a.op));
    }
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, what, "algorithm '", algorithm.name, "' cannot run ", what,
                  " here: ", why);
  };
  if (why != nullptr && !call_check_) refuse();
  if (a.segs != nullptr) {
    int64_t total = 0;
    for (int64_t i = 0; i < a.nsegs; ++i) total += a.segs[i].elems;
    GPUCOLL_INTERNAL_CHECK(total == a.count && !compressed);
  }
  const uint64_t pieces_before = pieces_;
  try {
    if (why != nullptr || (a.count == 0 && call_check_)) {
      // Nothing to move, but the call is still compared: another rank may be moving something.
      post_sig(sig);
      complete_sync_step();
      check_arrivals(sig);
    } else if (compressed) {
      run_compressed(a, sig);
    } else {
      run_pieces(a, plan_for(algorithm, p), sig, scaled ? scale : nullptr);
    }
  } catch (const CallMismatch&) {
    // Every rank raises it after the same one step; only the work-buffer half must be put back, as a rank with
    // nothing to move took none.
    pieces_ = pieces_before;
    end_op(static_cast<int>(a.coll), TraceState::kMismatch);
    throw;
  } catch (const Error& e) {
    fail(what, &e);
    throw;
  } catch (...) {
    fail(what, nullptr);
    throw;
  }
  if (why != nullptr) {
    // The same call on every rank (the check passed), so every rank refuses it here, in step.
    end_op(static_cast<int>(a.coll), TraceState::kFailed);
    refuse();
  }
  end_op(static_cast<int>(a.coll));
}

void HostComm::run_pieces(const CollArgs& a, const Plan& plan, const algo::CallSig& sig,
                          const unsigned char* scale) {
  using algo::Coll;
  const Coll coll = a.coll;
  const int P = opt_.nranks;
  const int me = opt_.rank;
  const bool blocked = algo::coll_is_blocked(coll);
  const int nchunks = plan.shape.nchunks;
  GPUCOLL_INTERNAL_CHECK(!blocked || nchunks == P);
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t cap = opt_.buffer_bytes / 2 / es;  // elements per work-buffer half
  const int64_t seg = std::max<int64_t>(opt_.segment_bytes / es, 1);
  const int64_t n = a.count;
  // Piece length: of the full vector (non-blocked) or of each rank's block (blocked). Aim for chunks of about
  // one segment so that a step's data stays in cache, within the work buffer.
  const int64_t piece = blocked ? std::max<int64_t>(std::min<int64_t>(seg, cap / P), 1)
                                : std::max<int64_t>(std::min<int64_t>(seg * nchunks, cap), nchunks);
  const bool is_root = me == a.root;
  const bool rooted = algo::coll_is_rooted(coll);
  const bool gets_result = !rooted || coll == Coll::kBroadcast || coll == Coll::kScatter || is_root;
  const char* in = static_cast<const char*>(a.in);
  char* out = static_cast<char*>(a.out);
  // A fused all-reduce (a.segs): where each array starts in the vector; `each_seg` hands f(ptr, shift, count) every
  // part of elements [off, off + len) that one array holds, `shift` counted from `off`.
  GPUCOLL_INTERNAL_CHECK(a.segs == nullptr || coll == Coll::kAllReduce);
  std::vector<int64_t> seg_start;
  if (a.segs != nullptr) {
    seg_start.resize(static_cast<size_t>(a.nsegs) + 1, 0);
    for (int64_t i = 0; i < a.nsegs; ++i) seg_start[static_cast<size_t>(i) + 1] = seg_start[i] + a.segs[i].elems;
  }
  auto each_seg = [&](int64_t off, int64_t len, auto f) {
    auto i = static_cast<size_t>(std::upper_bound(seg_start.begin(), seg_start.end(), off) - seg_start.begin()) - 1;
    for (int64_t done = 0; done < len; ++i) {
      const int64_t at = off + done - seg_start[i];
      const int64_t take = std::min(len - done, a.segs[i].elems - at);
      if (take > 0) f(a.segs[i].ptr + at * es, done, take);
      done += std::max<int64_t>(take, 0);
    }
  };
  post_sig(sig);
  for (int64_t begin = 0; begin < n; begin += piece) {
    const int64_t L = std::min(piece, n - begin);
    const int half = static_cast<int>(pieces_++ % 2);
    char* my_work = work(me, half);
    auto wchunk_off = [&](int c) { return blocked ? c * L : algo::chunk_begin(L, nchunks, c); };
    auto chunk_len = [&](int c) { return blocked ? L : algo::chunk_begin(L, nchunks, c + 1) - wchunk_off(c); };
    auto out_chunk = [&](int c) -> char* {
      if (!blocked) return out + (begin + wchunk_off(c)) * es;
      if (coll == Coll::kReduceScatter || coll == Coll::kScatter) return out + begin * es;
      return out + (static_cast<int64_t>(c) * n + begin) * es;
    };

    // Copy-in is a step of its own: peers read this rank's work buffer only after it completes. The pre-op of
    // avg and premul_sum is applied here, once to each input element, as NCCL applies it when it first reads one.
    auto copy_in = [&](void* dst, const void* src, int64_t len) {
      if (scale != nullptr) {
        premul_copy(dst, src, len, a.dtype, scale);
      } else {
        copy_elems(dst, src, len, a.dtype);
      }
    };
    wait_war(half);
    switch (coll) {
      case Coll::kAllReduce:
      case Coll::kReduce:
        if (a.segs != nullptr) {
          each_seg(begin, L, [&](char* p, int64_t d, int64_t m) { copy_in(my_work + d * es, p, m); });
        } else {
          copy_in(my_work, in + begin * es, L);
        }
        break;
      case Coll::kBroadcast:
        if (is_root) copy_elems(my_work, in + begin * es, L, a.dtype);
        break;
      case Coll::kAllGather:
      case Coll::kGather:
        copy_elems(my_work + static_cast<int64_t>(me) * L * es, in + begin * es, L, a.dtype);
        break;
      case Coll::kReduceScatter:
      case Coll::kAllToAll:
      case Coll::kScatter:
        if (coll != Coll::kScatter || is_root) {
          for (int c = 0; c < P; ++c) copy_in(my_work + c * L * es, in + (static_cast<int64_t>(c) * n + begin) * es, L);
        }
        break;
    }
    complete_step({}, half);
    if (begin == 0) check_arrivals(sig);

    for (const StepPlan& sp : plan.steps) {
      wait_war(half);
      for (int q : sp.raw_peers) wait_done(q, done_);
      const size_t nops = sp.ops.size();
      for (size_t i = 0; i < nops;) {
        const algo::Op& op = sp.ops[i];
        const int64_t len = chunk_len(op.dst_chunk);
        // Fuse a run of ops into the same destination chunk (a copy followed by reduces, or reduces) into one
        // multi-source pass, in the schedule's order.
        size_t j = i + 1;
        while (j < nops && j - i < kMaxFused && sp.ops[j].action == algo::Action::kReduce &&
               sp.ops[j].dst == op.dst && sp.ops[j].dst_chunk == op.dst_chunk) {
          ++j;
        }
        // Writes elements [shift, shift + m) of the destination chunk at `dst`.
        auto apply = [&](char* dst, int64_t shift, int64_t m) {
          if (j - i == 1 && op.action == algo::Action::kCopy) {
            copy_elems(dst, work(op.peer, half) + (wchunk_off(op.src_chunk) + shift) * es, m, a.dtype);
          } else {
            const void* srcs[kMaxFused];
            for (size_t k = i; k < j; ++k) {
              srcs[k - i] = work(sp.ops[k].peer, half) + (wchunk_off(sp.ops[k].src_chunk) + shift) * es;
            }
            reduce_multi(dst, srcs, static_cast<int>(j - i), op.action == algo::Action::kReduce, m, a.dtype, a.op);
          }
        };
        if (op.dst == algo::Space::kWork) {
          apply(my_work + wchunk_off(op.dst_chunk) * es, 0, len);
        } else if (a.segs != nullptr) {
          each_seg(begin + wchunk_off(op.dst_chunk), len, apply);
        } else {
          apply(out_chunk(op.dst_chunk), 0, len);
        }
        i = j;
      }
      complete_step(sp.readers, half);
    }

    // Copy-out reads only this rank's own buffer, which no peer writes: no step needed.
    if (plan.shape.result == algo::Space::kWork && gets_result && !(coll == Coll::kBroadcast && is_root)) {
      if (a.segs != nullptr) {
        each_seg(begin, L, [&](char* p, int64_t d, int64_t m) { copy_elems(p, my_work + d * es, m, a.dtype); });
      } else if (!blocked) {
        copy_elems(out + begin * es, my_work, L, a.dtype);
      } else if (coll == Coll::kReduceScatter || coll == Coll::kScatter) {
        copy_elems(out + begin * es, my_work + static_cast<int64_t>(me) * L * es, L, a.dtype);
      } else {
        for (int c = 0; c < P; ++c) copy_elems(out_chunk(c), my_work + c * L * es, L, a.dtype);
      }
    }
  }
  if (a.op == RedOp::kAvg && algo::coll_reduces(coll) && gets_result) {
    if (a.segs != nullptr) {
      each_seg(0, n, [&](char* p, int64_t, int64_t m) { avg_divide(p, m, a.dtype, P); });
    } else {
      avg_divide(out, n, a.dtype, P);
    }
  }
}

void HostComm::barrier() {
  in_order();
  begin_op("barrier");
  const algo::CallSig sig = algo::make_call_sig(static_cast<uint32_t>(op_seq_), algo::kSigBarrier, 0, 0, -1, 0, -1,
                                                0, false);
  trace_id_ = trace_.begin(op_seq_, sig, 0, TraceBackend::kHost, awake_ns_, awake_ns_);
  try {
    post_sig(sig);
    complete_sync_step();
    wait_all_arrived();
    check_arrivals(sig);
  } catch (const CallMismatch&) {
    end_op(-1, TraceState::kMismatch);
    throw;
  } catch (const Error& e) {
    fail("barrier", &e);
    throw;
  } catch (...) {
    fail("barrier", nullptr);
    throw;
  }
  end_op(-1);
}

}  // namespace gpucoll::host
