#include "backends/host/host_comm.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "backends/host/kernels.h"
#include "core/premul.h"
#include "backends/host/region.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::host {

namespace {
constexpr size_t kMaxFused = 16;
}  // namespace

HostComm::HostComm(const HostOptions& options, const std::string& shm_name, bool create) : opt_(options) {
  GPUCOLL_CHECK_ARG(opt_.nranks >= 1, "world_size must be >= 1, got ", opt_.nranks);
  GPUCOLL_CHECK_ARG(opt_.rank >= 0 && opt_.rank < opt_.nranks, "rank must be in [0, ", opt_.nranks, "), got ",
                    opt_.rank);
  GPUCOLL_CHECK_ARG(opt_.buffer_bytes >= 4096, "GPUCOLL_HOST_BUFFER_BYTES must be at least 4096, got ",
                    opt_.buffer_bytes);
  opt_.buffer_bytes = static_cast<int64_t>(align_up(static_cast<size_t>(opt_.buffer_bytes), kPageAlign));
  opt_.segment_bytes = std::max<int64_t>(opt_.segment_bytes, 64);
  spin_ns_ = std::max<int64_t>(opt_.spin_us, 0) * 1000;
  debug_checks_ = opt_.debug_checks;
  // p2p slots: up to 1 MiB each, shrinking with P^2 so that the region stays within 256 MiB of address space
  // (tmpfs only backs the pages that are touched, so unused pairs cost nothing).
  const size_t P = static_cast<size_t>(opt_.nranks);
  slot_bytes_ = std::clamp<size_t>((size_t{256} << 20) / (2 * P * P), size_t{64} << 10, size_t{1} << 20);
  slot_bytes_ = align_up(slot_bytes_, kPageAlign) - kSlotHeaderBytes;
  const RegionLayout layout(opt_.nranks, static_cast<size_t>(opt_.buffer_bytes), slot_bytes_);
  work_offset_ = layout.work_offset;
  pair_offset_ = layout.pair_offset;
  slot_offset_ = layout.slot_offset;
  if (create) {
    shm_.create(shm_name, layout.total);
    auto* h = static_cast<RegionHeader*>(shm_.data());
    h->magic = kRegionMagic;
    h->nranks = opt_.nranks;
    h->buffer_bytes = static_cast<uint64_t>(opt_.buffer_bytes);
    h->slot_bytes = slot_bytes_;
  } else {
    shm_.attach(shm_name);
    const auto* h = static_cast<const RegionHeader*>(shm_.data());
    if (shm_.size() < sizeof(RegionHeader) || h->magic != kRegionMagic) {
      GPUCOLL_THROW(ErrorCode::kInternal, "attach(" + shm_name + ")", "shared-memory region ", shm_name,
                    " is not a gpucoll region");
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
  if (h->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(opt_.nranks)) {
    shm_.unlink();  // last to arrive: from now on nothing can be left behind in /dev/shm
  }
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
      shm_.unlink();
      std::string list;
      for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
      throw Error(ErrorCode::kTimeout,
                  "host communicator set-up timed out after " + std::to_string(opt_.timeout_s) +
                      " s: rank(s) " + list + " never attached to the shared-memory region",
                  "HostComm::wait_attached", __FILE__, __LINE__, missing);
    }
    usleep(200);
  }
  shm_.unlink();  // already gone when the last rank attached; harmless otherwise
  GPUCOLL_DEBUG("host communicator ready: ", opt_.nranks, " ranks, ", opt_.buffer_bytes, "-byte work buffers");
}

void HostComm::close() noexcept {
  if (closed_) return;
  closed_ = true;
  shm_.unlink();
  shm_.unmap();
}

void HostComm::check_usable(const char* what) const {
  if (closed_) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, what, what, " on a closed communicator (close() was called)");
  }
  if (broken_) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, what, what,
                  " on a broken communicator: an earlier collective failed (timeout or peer failure), so ranks "
                  "are out of step; create a new communicator");
  }
}

void HostComm::begin_op(const char* what) {
  check_usable(what);
  current_ = what;
  ++op_seq_;
  ctl(opt_.rank)->op_seq.store(op_seq_, std::memory_order_release);
  deadline_ns_ = now_ns() + static_cast<int64_t>(opt_.timeout_s * 1e9);
}

bool HostComm::peer_dead(int peer) const {
  const int pid = ctl(peer)->pid.load(std::memory_order_relaxed);
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // An exited child that its parent has not reaped yet still answers kill(); its state is Z.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[256] = {0};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* paren = std::strrchr(buf, ')');
  return n > 0 && paren != nullptr && (paren[2] == 'Z' || paren[2] == 'X');
}

void HostComm::raise_timeout(int peer) {
  std::vector<int> missing;
  for (int r = 0; r < opt_.nranks; ++r) {
    if (r != opt_.rank && ctl(r)->op_seq.load(std::memory_order_acquire) < op_seq_) missing.push_back(r);
  }
  if (std::find(missing.begin(), missing.end(), peer) == missing.end()) missing.insert(missing.begin(), peer);
  std::string list;
  for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
  const bool dead = peer_dead(peer);
  std::string msg = std::string(current_) + " #" + std::to_string(op_seq_) + " on rank " +
                    std::to_string(opt_.rank) + (dead ? " failed: rank " + std::to_string(peer) + " has exited"
                                                      : " timed out after " + std::to_string(opt_.timeout_s) +
                                                            " s waiting for rank " + std::to_string(peer)) +
                    "; rank(s) that had not completed it: " + list;
  throw Error(ErrorCode::kTimeout, msg, current_, __FILE__, __LINE__, missing);
}

void HostComm::wait_done(int peer, uint32_t target) { wait_word(&ctl(peer)->done, target, peer); }

void HostComm::wait_word(WaitWord* w, uint32_t target, int peer) {
  if (reached(w->value.load(std::memory_order_acquire), target)) return;
  // Short spin first: on an idle core the peer is usually microseconds away. Yielding inside the spin lets
  // an oversubscribed peer run on this core.
  const int64_t spin_end = now_ns() + spin_ns_;
  do {
    for (int i = 0; i < 64; ++i) {
      if (reached(w->value.load(std::memory_order_acquire), target)) return;
      cpu_relax();
    }
    sched_yield();
  } while (now_ns() < spin_end);
  for (;;) {
    w->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = w->value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) {
      const int64_t left = deadline_ns_ - now_ns();
      // Wake at least every 20 ms to notice a dead or failed peer without waiting for the full timeout.
      futex_wait(&w->value, v, std::min<int64_t>(left, 20'000'000));
    }
    w->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(w->value.load(std::memory_order_acquire), target)) return;
    if (ctl(peer)->broken.load(std::memory_order_acquire) != 0) raise_peer_failed(peer);
    if (now_ns() >= deadline_ns_ || peer_dead(peer)) raise_timeout(peer);
  }
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

void HostComm::fail(const char* what, const Error* cause) noexcept {
  broken_ = true;
  if (shm_.data() == nullptr) return;
  Ctl* me = ctl(opt_.rank);
  int32_t code = static_cast<int32_t>(ErrorCode::kInternal);
  int32_t blamed = -1;
  if (cause != nullptr) {
    code = static_cast<int32_t>(cause->code());
    if (!cause->ranks().empty()) blamed = cause->ranks().front();
  }
  me->fail_code.store(code, std::memory_order_relaxed);
  me->fail_rank.store(blamed, std::memory_order_relaxed);
  me->broken.store(1, std::memory_order_seq_cst);
  // Waiters re-check the broken flag when woken; the counter itself must not move.
  futex_wake_all(&me->done.value);
  // Peers blocked in p2p wait on this rank's pair counters: wake those too.
  for (int q = 0; q < opt_.nranks; ++q) {
    futex_wake_all(&pair(opt_.rank, q)->sent.value);
    futex_wake_all(&pair(q, opt_.rank)->acked.value);
  }
  GPUCOLL_WARN(what, " #", op_seq_, " failed; communicator marked broken");
}

void HostComm::raise_peer_failed(int peer) {
  const Ctl* c = ctl(peer);
  const auto code = static_cast<ErrorCode>(c->fail_code.load(std::memory_order_relaxed));
  const int blamed = c->fail_rank.load(std::memory_order_relaxed);
  const std::string head = std::string(current_) + " #" + std::to_string(op_seq_) + " failed on rank " +
                           std::to_string(opt_.rank) + ": ";
  if ((code == ErrorCode::kTimeout || code == ErrorCode::kRemote) && blamed >= 0 && blamed != opt_.rank) {
    // Pass the root cause on: the rank the peer was waiting for is the one missing, not the peer.
    const bool dead = peer_dead(blamed);
    throw Error(code == ErrorCode::kTimeout || dead ? ErrorCode::kTimeout : ErrorCode::kRemote,
                head + "rank " + std::to_string(blamed) + (dead ? " has exited" : " did not complete it") +
                    " (reported by rank " + std::to_string(peer) + "); the communicator is unusable",
                current_, __FILE__, __LINE__, {blamed});
  }
  throw Error(ErrorCode::kRemote,
              head + "rank " + std::to_string(peer) + " failed (" + error_code_name(code) +
                  "); the communicator is unusable",
              current_, __FILE__, __LINE__, {peer});
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
  begin_op(what);
  algo::Params p;
  p.coll = a.coll;
  p.nranks = opt_.nranks;
  p.root = a.root;
  p.local_size = a.local_size > 0 ? a.local_size : opt_.nranks;
  if (const char* why = algorithm.unusable(p)) {
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, what, "algorithm '", algorithm.name, "' cannot run ", what,
                  " here: ", why);
  }
  const Plan& plan = plan_for(algorithm, p);
  try {
    // A signature mismatch leaves every buffer untouched and every rank in step: not a failure of the
    // communicator, only of this call.
    if (debug_checks_) debug_check(a);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) fail(what, &e);
    throw;
  }
  try {
    run_pieces(a, plan, scaled ? scale : nullptr);
  } catch (const Error& e) {
    fail(what, &e);
    throw;
  } catch (...) {
    fail(what, nullptr);
    throw;
  }
}

void HostComm::run_pieces(const CollArgs& a, const Plan& plan, const unsigned char* scale) {
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
        copy_in(my_work, in + begin * es, L);
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

    for (const StepPlan& sp : plan.steps) {
      wait_war(half);
      for (int q : sp.raw_peers) wait_done(q, done_);
      const size_t nops = sp.ops.size();
      for (size_t i = 0; i < nops;) {
        const algo::Op& op = sp.ops[i];
        char* dst = op.dst == algo::Space::kWork ? my_work + wchunk_off(op.dst_chunk) * es : out_chunk(op.dst_chunk);
        const int64_t len = chunk_len(op.dst_chunk);
        // Fuse a run of ops into the same destination chunk (a copy followed by reduces, or reduces) into one
        // multi-source pass, in the schedule's order.
        size_t j = i + 1;
        while (j < nops && j - i < kMaxFused && sp.ops[j].action == algo::Action::kReduce &&
               sp.ops[j].dst == op.dst && sp.ops[j].dst_chunk == op.dst_chunk) {
          ++j;
        }
        if (j - i == 1 && op.action == algo::Action::kCopy) {
          copy_elems(dst, work(op.peer, half) + wchunk_off(op.src_chunk) * es, len, a.dtype);
        } else {
          const void* srcs[kMaxFused];
          for (size_t k = i; k < j; ++k) srcs[k - i] = work(sp.ops[k].peer, half) + wchunk_off(sp.ops[k].src_chunk) * es;
          reduce_multi(dst, srcs, static_cast<int>(j - i), op.action == algo::Action::kReduce, len, a.dtype, a.op);
        }
        i = j;
      }
      complete_step(sp.readers, half);
    }

    // Copy-out reads only this rank's own buffer, which no peer writes: no step needed.
    if (plan.shape.result == algo::Space::kWork && gets_result && !(coll == Coll::kBroadcast && is_root)) {
      if (!blocked) {
        copy_elems(out + begin * es, my_work, L, a.dtype);
      } else if (coll == Coll::kReduceScatter || coll == Coll::kScatter) {
        copy_elems(out + begin * es, my_work + static_cast<int64_t>(me) * L * es, L, a.dtype);
      } else {
        for (int c = 0; c < P; ++c) copy_elems(out_chunk(c), my_work + c * L * es, L, a.dtype);
      }
    }
  }
  if (a.op == RedOp::kAvg && algo::coll_reduces(coll) && gets_result) {
    avg_divide(out, n, a.dtype, P);
  }
}

void HostComm::barrier() {
  begin_op("barrier");
  try {
    complete_sync_step();
    for (int q = 0; q < opt_.nranks; ++q) {
      if (q != opt_.rank) wait_done(q, done_);
    }
  } catch (const Error& e) {
    fail("barrier", &e);
    throw;
  } catch (...) {
    fail("barrier", nullptr);
    throw;
  }
}

}  // namespace gpucoll::host
