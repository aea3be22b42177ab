// Waiting on peers and, when a wait fails, whom to blame (HostComm members; see host_comm.h).
//
// A wait spins briefly, then sleeps on the peer's counter in 20 ms slices; after each slice it looks for
// evidence that the peer will not come: it gave up (broken, with the cause it recorded), it closed the
// communicator, its process is gone, or the deadline passed. Blame follows evidence, never who was slowest:
//  1. a rank whose process has exited (kill(pid, 0), or a zombie's /proc state);
//  2. else the end of the chain of who waits for whom, starting at the peer this rank waits for: a rank that
//     waits for nobody, or whose awaited step is already there (it is not running: stopped, starved);
//  3. else the peer itself.
// A rank that was not running for more than kStallNs inside one operation (SIGSTOP, a debugger) moves its
// deadline by that long: its peers did not make it wait. If a peer gave up on it meanwhile, it reports its own
// lateness instead of blaming the peer that gave up.
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "backends/host/host_comm.h"
#include "backends/host/region.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::host {

namespace {
constexpr int64_t kSliceNs = 20'000'000;      // a sleeping waiter looks for evidence this often
constexpr int64_t kStallNs = 1'000'000'000;  // a gap this long between two looks: this process was not running

std::string secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

const char* coll_label(int32_t coll) {
  return coll < 0 ? "barrier" : algo::coll_name(static_cast<algo::Coll>(coll));
}
}  // namespace

std::string HostComm::whereabouts(int peer) const {
  const Ctl* c = ctl(peer);
  const uint64_t entered = c->op_seq.load(std::memory_order_acquire);
  const uint64_t done = c->done_seq.load(std::memory_order_acquire);
  const int64_t now = now_ns();
  if (entered > done) {
    return std::string("it is inside ") + coll_label(c->in_coll.load(std::memory_order_relaxed)) + " #" +
           std::to_string(entered) + ", entered " +
           secs(static_cast<uint32_t>(now / 1000 - c->arrived_us[entered & 1].load(std::memory_order_relaxed)) *
                1e-6) +
           " ago";
  }
  const uint64_t p2p = c->p2p_begun.load(std::memory_order_acquire);
  if (p2p > c->p2p_done.load(std::memory_order_acquire)) {
    static const char* const kinds[] = {"send", "recv", "group"};
    const int32_t kind = c->p2p_kind.load(std::memory_order_relaxed);
    const int32_t with = c->p2p_peer.load(std::memory_order_relaxed);
    std::string s = std::string("it is inside ") + kinds[std::clamp(kind, 0, 2)] + " #" + std::to_string(p2p);
    if (with >= 0) s += std::string(kind == 0 ? " to" : " from") + " rank " + std::to_string(with);
    return s + ", entered " + secs((now - c->p2p_ns.load(std::memory_order_relaxed)) * 1e-9) + " ago (point-to-point)";
  }
  if (done == 0) return "it had completed no collective";
  return std::string("its last completed: ") + coll_label(c->done_coll.load(std::memory_order_relaxed)) + " #" +
         std::to_string(done) + ", " + secs((now - c->done_ns.load(std::memory_order_relaxed)) * 1e-9) + " ago";
}

std::vector<HostComm::PeerState> HostComm::peer_states() const {
  std::vector<PeerState> out(static_cast<size_t>(opt_.nranks));
  const int64_t now = now_ns();
  for (int r = 0; r < opt_.nranks; ++r) {
    const Ctl* c = ctl(r);
    PeerState& p = out[static_cast<size_t>(r)];
    p.pid = c->pid.load(std::memory_order_relaxed);
    p.exited = r != opt_.rank && peer_dead(r);
    p.broken = c->broken.load(std::memory_order_acquire) != 0;
    p.entered = c->op_seq.load(std::memory_order_acquire);
    p.done = c->done_seq.load(std::memory_order_acquire);
    p.in_coll = c->in_coll.load(std::memory_order_relaxed);
    p.done_coll = c->done_coll.load(std::memory_order_relaxed);
    if (p.entered > p.done) {
      p.in_for_s = static_cast<uint32_t>(now / 1000 - c->arrived_us[p.entered & 1].load(std::memory_order_relaxed)) *
                   1e-6;
    }
    if (p.done > 0) p.done_ago_s = (now - c->done_ns.load(std::memory_order_relaxed)) * 1e-9;
    p.in_p2p = c->p2p_begun.load(std::memory_order_acquire) > c->p2p_done.load(std::memory_order_acquire);
    p.where = whereabouts(r);
  }
  return out;
}

std::string HostComm::late_note(std::vector<int>* ranks) const {
  if (in_p2p_) return "";
  std::string late;
  for (int r = 0; r < opt_.nranks; ++r) {
    if (r == opt_.rank || ctl(r)->op_seq.load(std::memory_order_acquire) >= op_seq_) continue;
    late += (late.empty() ? "" : ", ") + std::to_string(r) + " (" + whereabouts(r) + ")";
    if (std::find(ranks->begin(), ranks->end(), r) == ranks->end()) ranks->push_back(r);
  }
  return late.empty() ? "" : "; rank(s) that had not entered it: " + late;
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

int HostComm::culprit(int peer, int32_t* how) const {
  for (int r = 0; r < opt_.nranks; ++r) {
    if (r != opt_.rank && peer_dead(r)) {
      *how = static_cast<int32_t>(Blame::kExited);
      return r;
    }
  }
  int r = peer;
  for (int hop = 0; hop < opt_.nranks; ++hop) {
    const uint64_t w = ctl(r)->waiting.load(std::memory_order_acquire);
    const int next = static_cast<int>(w >> 32) - 1;
    const auto target = static_cast<uint32_t>(w);
    if (w == 0 || next < 0 || next >= opt_.nranks) break;  // r waits for nobody: r holds the others up
    if (target != kP2PWait && reached(ctl(next)->done.value.load(std::memory_order_acquire), target)) {
      *how = static_cast<int32_t>(Blame::kStalled);  // r's wait is over, yet r has not moved on
      return r;
    }
    if (next == opt_.rank) break;  // r waits for this rank, which waits for r: out of step
    r = next;
  }
  *how = static_cast<int32_t>(Blame::kWaited);
  return r;
}

void HostComm::raise_timeout(int peer) {
  int32_t how = 0;
  const int blamed = culprit(peer, &how);
  std::vector<int> ranks{blamed};
  std::string msg = op_label() + " on rank " + std::to_string(opt_.rank);
  const std::string b = std::to_string(blamed);
  switch (static_cast<Blame>(how)) {
    case Blame::kExited:
      msg += " failed: rank " + b + " has exited";
      break;
    case Blame::kStalled:
      msg += " timed out after " + secs(opt_.timeout_s) + ": rank " + b +
             " is not running (what it waits for is there, but it did not go on: stopped or starved of CPU?)";
      break;
    default:
      msg += " timed out after " + secs(opt_.timeout_s) + " waiting for rank " + std::to_string(peer);
      if (blamed != peer) msg += ", which waits (through others) for rank " + b + ", which waits for no rank";
      break;
  }
  msg += late_note(&ranks);
  last_blame_ = {blamed, how};
  throw Error(ErrorCode::kTimeout, msg, current_, __FILE__, __LINE__, ranks);
}

void HostComm::raise_peer_failed(int peer) {
  const Ctl* c = ctl(peer);
  const auto code = static_cast<ErrorCode>(c->fail_code.load(std::memory_order_relaxed));
  const int blamed = c->fail_rank.load(std::memory_order_relaxed);
  const auto how = static_cast<Blame>(c->fail_how.load(std::memory_order_relaxed));
  const std::string head = op_label() + " failed on rank " + std::to_string(opt_.rank) + ": ";
  const std::string p = std::to_string(peer);
  if (blamed == opt_.rank) {
    // The peer gave up waiting for this rank: this rank was the late one, whatever it was waiting for now.
    last_blame_ = {opt_.rank, static_cast<int32_t>(Blame::kWaited)};
    std::string msg = head + "rank " + p + " gave up waiting for this rank (its " + secs(opt_.timeout_s) +
                      " timeout ran out); this rank was late";
    if (stalled_ns_ > 0) msg += ": it did not run for " + secs(stalled_ns_ * 1e-9) + " (stopped or starved of CPU)";
    throw Error(ErrorCode::kTimeout, msg + "; the communicator is unusable", current_, __FILE__, __LINE__,
                {opt_.rank});
  }
  if (blamed >= 0 && how != Blame::kNone) {
    // Pass the root cause on: the rank the peer blamed, on the peer's evidence, is the one missing.
    const bool dead = how == Blame::kExited || peer_dead(blamed);
    last_blame_ = {blamed, static_cast<int32_t>(dead ? Blame::kExited : how)};
    const std::string b = std::to_string(blamed);
    std::string why = dead                   ? " has exited"
                      : how == Blame::kClosed ? " closed the communicator while ranks still waited for it"
                      : how == Blame::kStalled ? " is not running (stopped or starved of CPU?)"
                                              : " did not complete it";
    std::vector<int> ranks{blamed};
    const std::string late = late_note(&ranks);
    throw Error(code, head + "rank " + b + why + " (reported by rank " + p + ")" + late +
                    "; the communicator is unusable",
                current_, __FILE__, __LINE__, ranks);
  }
  last_blame_ = {peer, static_cast<int32_t>(Blame::kNone)};
  throw Error(ErrorCode::kRemote,
              head + "rank " + p + " failed (" + error_code_name(code) + "); the communicator is unusable",
              current_, __FILE__, __LINE__, {peer});
}

void HostComm::raise_peer_closed(int peer, uint64_t after) {
  last_blame_ = {peer, static_cast<int32_t>(Blame::kClosed)};
  throw Error(ErrorCode::kInvalidArgument,
              op_label() + " cannot complete on rank " + std::to_string(opt_.rank) + ": rank " +
                  std::to_string(peer) + " closed the communicator after " + std::to_string(after) +
                  " collective(s)" + (in_p2p_ ? "" : ", and this is collective #" + std::to_string(op_seq_)) +
                  ": ranks made different calls (every rank must make the same collective calls in the same order, "
                  "and post a matching call for every send and recv)",
              current_, __FILE__, __LINE__, {peer});
}

std::string HostComm::op_label() const {
  return std::string(current_) + " #" + std::to_string(in_p2p_ ? p2p_seq_ : op_seq_);
}

void HostComm::check_peer(int peer) {
  if (aborted_.load(std::memory_order_acquire)) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, current_, op_label(), " was aborted while it waited for rank ", peer,
                  " (", abort_reason_, ")");
  }
  const Ctl* c = ctl(peer);
  if (c->broken.load(std::memory_order_acquire) != 0) raise_peer_failed(peer);
  if (c->closed.load(std::memory_order_acquire) != 0) {
    raise_peer_closed(peer, c->closed_after.load(std::memory_order_relaxed));
  }
  if (now_ns() >= deadline_ns_ || peer_dead(peer)) raise_timeout(peer);
}

int64_t HostComm::note_awake(int64_t now) {
  if (now - awake_ns_ > kStallNs) {
    // This process did not run for that long: not the peers' doing, so not counted against them.
    deadline_ns_ += now - awake_ns_;
    stalled_ns_ += now - awake_ns_;
  }
  awake_ns_ = now;
  return now;
}

void HostComm::wait_done(int peer, uint32_t target) { wait_word(&ctl(peer)->done, target, peer, target); }

void HostComm::wait_word(WaitWord* w, uint32_t target, int peer, uint32_t published) {
  if (reached(w->value.load(std::memory_order_acquire), target)) return;
  // Short spin first: on an idle core the peer is usually microseconds away. Yielding inside the spin lets
  // an oversubscribed peer run on this core.
  const int64_t spin_end = note_awake(now_ns()) + spin_ns_;
  do {
    for (int i = 0; i < 64; ++i) {
      if (reached(w->value.load(std::memory_order_acquire), target)) return;
      cpu_relax();
    }
    sched_yield();
  } while (note_awake(now_ns()) < spin_end);
  std::atomic<uint64_t>& waiting = ctl(opt_.rank)->waiting;
  waiting.store((static_cast<uint64_t>(peer) + 1) << 32 | published, std::memory_order_release);
  for (;;) {
    const int64_t now = note_awake(now_ns());
    w->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = w->value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(&w->value, v, std::min<int64_t>(deadline_ns_ - now, kSliceNs));
    w->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(w->value.load(std::memory_order_acquire), target)) break;
    const int64_t after = now_ns();
    if (after - awake_ns_ > kStallNs) continue;  // stopped inside the sleep: account for it first
    check_peer(peer);
  }
  waiting.store(0, std::memory_order_release);
}

void HostComm::abandon() noexcept {
  broken_ = true;
  if (shm_.data() == nullptr) return;
  Ctl* me = ctl(opt_.rank);
  me->fail_code.store(static_cast<int32_t>(ErrorCode::kRemote), std::memory_order_relaxed);
  me->fail_rank.store(-1, std::memory_order_relaxed);
  me->fail_how.store(static_cast<int32_t>(Blame::kNone), std::memory_order_relaxed);
  me->broken.store(1, std::memory_order_seq_cst);
  futex_wake_all(&me->done.value);
  for (int q = 0; q < opt_.nranks; ++q) {
    futex_wake_all(&pair(opt_.rank, q)->sent.value);
    futex_wake_all(&pair(q, opt_.rank)->acked.value);
  }
}

void HostComm::fail(const char* what, const Error* cause) noexcept {
  broken_ = true;
  trace_.end(trace_id_, TraceState::kFailed, now_ns());
  if (shm_.data() == nullptr) return;
  Ctl* me = ctl(opt_.rank);
  int32_t code = static_cast<int32_t>(ErrorCode::kInternal);
  int32_t blamed = -1;
  int32_t how = static_cast<int32_t>(Blame::kNone);
  if (cause != nullptr) {
    code = static_cast<int32_t>(cause->code());
    blamed = last_blame_.rank;
    how = last_blame_.how;
  }
  me->waiting.store(0, std::memory_order_relaxed);
  me->fail_code.store(code, std::memory_order_relaxed);
  me->fail_rank.store(blamed, std::memory_order_relaxed);
  me->fail_how.store(how, std::memory_order_relaxed);
  me->broken.store(1, std::memory_order_seq_cst);
  // Waiters re-check the broken flag when woken; the counter itself must not move.
  futex_wake_all(&me->done.value);
  // Peers blocked in p2p wait on this rank's pair counters: wake those too.
  for (int q = 0; q < opt_.nranks; ++q) {
    futex_wake_all(&pair(opt_.rank, q)->sent.value);
    futex_wake_all(&pair(q, opt_.rank)->acked.value);
  }
  GPUCOLL_WARN(what, " #", in_p2p_ ? p2p_seq_ : op_seq_, " failed; communicator marked broken");
}

}  // namespace gpucoll::host
