#include "select/selector.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "algo/checker.h"
#include "core/config.h"
#include "core/error.h"

namespace gpucoll::algo {

namespace {

int online_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

// Per (algorithm, collective, P, local size): steps and the busiest rank's traffic for a unit message,
// scaled linearly by the piece size (schedules move fixed fractions of the buffer).
struct Counts {
  bool ok = false;
  std::string error;
  int32_t steps = 0;
  int32_t nchunks = 1;
  bool copy_out = true;  // the result ends in the work buffer and is copied out (not written straight to out)
  double sent_per_byte = 0;
  double recv_per_byte = 0;
};

const Counts& counts_for(const Algorithm& a, Coll coll, int nranks, int local_size) {
  static std::mutex mu;
  static std::map<std::tuple<const Algorithm*, int, int, int>, Counts> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(&a, static_cast<int>(coll), nranks, local_size);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Counts c;
  Params p{coll, nranks, 0, local_size > 0 ? local_size : nranks};
  if (!a.supports(coll)) {
    c.error = std::string("it does not implement ") + coll_name(coll);
  } else if (const char* why = a.unusable(p)) {
    c.error = why;
  } else {
    const Shape shape = a.shape(p);
    // A unit divisible by every chunk count in use keeps the byte counts exact.
    const int64_t unit = static_cast<int64_t>(std::max(shape.nchunks, 1)) * nranks * 4096;
    const CheckResult r = check_schedule(a, p, unit);
    if (!r.ok) {
      c.error = "its schedule failed the checker: " + r.error;
    } else {
      c.ok = true;
      c.steps = r.nsteps;
      c.nchunks = r.nchunks;
      c.copy_out = shape.result == Space::kWork;
      c.sent_per_byte = static_cast<double>(r.max_bytes_sent()) / static_cast<double>(unit);
      c.recv_per_byte = static_cast<double>(r.max_bytes_recv()) / static_cast<double>(unit);
    }
  }
  return cache.emplace(key, std::move(c)).first->second;
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string known_names() {
  std::string s;
  for (const Algorithm* a : algorithms()) s += (s.empty() ? "" : ", ") + std::string(a->name);
  return s;
}

}  // namespace

CostParams host_cost_params() {
  // Read once per process: this sits on every collective call with algo="auto".
  static const CostParams cached = [] {
  CostParams cp;
  // a and b (selector.h defaults) were fitted with bench/calibrate_host.py (least squares over every
  // allreduce algorithm at 4 KiB..16 MiB on 2 and 4 ranks) on the 2-core development machine, 2026-11-21:
  // a = 8-16 us per step and b = 0.11-0.16 ns per byte depending on background load; the defaults sit in
  // between. Selection depends on their ratio more than on their values.
  cp.segment_bytes = config_bytes("GPUCOLL_HOST_SEGMENT_BYTES");
  cp.buffer_bytes = config_bytes("GPUCOLL_HOST_BUFFER_BYTES");
  cp.cores = online_cores();
  return cp;
  }();
  return cached;
}

Prediction predict(const Algorithm& a, Coll coll, int nranks, int64_t nbytes, int local_size, const CostParams& cp) {
  Prediction pr;
  const Counts& c = counts_for(a, coll, nranks, local_size);
  if (!c.ok) {
    pr.reason = c.error;
    return pr;
  }
  pr.usable = true;
  pr.steps = c.steps;
  pr.bytes_sent = static_cast<int64_t>(std::llround(c.sent_per_byte * static_cast<double>(nbytes)));
  pr.bytes_recv = static_cast<int64_t>(std::llround(c.recv_per_byte * static_cast<double>(nbytes)));
  if (nbytes <= 0) return pr;
  // Piece size as the executor cuts it (host_comm.cc run_pieces).
  const bool blocked = coll_is_blocked(coll);
  const int64_t piece = blocked ? std::max<int64_t>(std::min<int64_t>(cp.segment_bytes * nranks, cp.buffer_bytes), nranks)
                                : std::max<int64_t>(std::min<int64_t>(cp.segment_bytes * c.nchunks, cp.buffer_bytes), 1);
  pr.pieces = (nbytes + piece - 1) / piece;
  const int cores = cp.cores > 0 ? cp.cores : online_cores();
  const double oversub = std::max(1.0, static_cast<double>(nranks) / cores);
  // Bytes through this rank's caches: what it reads from peers, the copy-in, and the copy-out when the result
  // is not written straight to the output.
  const double moved =
      (c.recv_per_byte + 1.0 + (c.copy_out ? 1.0 : 0.0)) * static_cast<double>(nbytes);
  pr.seconds = oversub * (static_cast<double>(pr.pieces) * (c.steps + 1) * cp.a_s + moved * cp.b_s_per_byte);
  return pr;
}

std::string algo_override(Coll coll) {
  const std::string spec = config_raw("GPUCOLL_ALGO");
  size_t pos = 0;
  std::string bare;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    pos = end + 1;
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      bare = lower(item);
      continue;
    }
    Coll c;
    const std::string coll_text = lower(item.substr(0, colon));
    if (!parse_coll(coll_text, &c)) {
      GPUCOLL_THROW(ErrorCode::kInvalidArgument, "GPUCOLL_ALGO", "GPUCOLL_ALGO='", spec, "': unknown collective '",
                    coll_text, "' (expected e.g. allreduce, broadcast, reduce_scatter)");
    }
    if (c == coll) return lower(item.substr(colon + 1));
  }
  if (!bare.empty()) {
    const Algorithm* a = find_algorithm(bare);
    if (a == nullptr || a->supports(coll)) return bare;
  }
  return {};
}

const Algorithm& AutoChoice::choose(Coll coll, int nranks, int64_t nbytes, int local_size) {
  std::string spec = config_raw("GPUCOLL_ALGO");
  if (last_ != nullptr && coll == coll_ && nranks == nranks_ && nbytes == nbytes_ && local_size == local_size_ &&
      spec == spec_) {
    return *last_;
  }
  const Algorithm& a = select_algorithm(coll, nranks, nbytes, local_size, "auto");
  last_ = &a;
  coll_ = coll;
  nranks_ = nranks;
  nbytes_ = nbytes;
  local_size_ = local_size;
  spec_ = std::move(spec);
  return a;
}

const Algorithm& select_algorithm(Coll coll, int nranks, int64_t nbytes, int local_size, const std::string& requested) {
  std::string name = lower(requested);
  std::string source = "algo";
  if (name.empty() || name == "auto") {
    name = algo_override(coll);
    source = "GPUCOLL_ALGO";
  }
  if (!name.empty() && name != "auto") {
    const Algorithm* a = find_algorithm(name);
    if (a == nullptr) {
      GPUCOLL_THROW(ErrorCode::kInvalidArgument, coll_name(coll), source, " must be 'auto' or one of ", known_names(),
                    "; got '", name, "'");
    }
    const Counts& c = counts_for(*a, coll, nranks, local_size);
    if (!c.ok) {
      GPUCOLL_THROW(ErrorCode::kInvalidArgument, coll_name(coll), source, "='", name, "' cannot run ",
                    coll_name(coll), " on ", nranks, " ranks", (local_size > 0 ? " with local_size=" : ""),
                    (local_size > 0 ? std::to_string(local_size) : std::string()), ": ", c.error);
    }
    return *a;
  }
  const CostParams cp = host_cost_params();
  const Algorithm* best = nullptr;
  double best_s = 0;
  for (const Algorithm* a : algorithms()) {
    const Prediction p = predict(*a, coll, nranks, nbytes, local_size, cp);
    if (p.usable && (best == nullptr || p.seconds < best_s)) {
      best = a;
      best_s = p.seconds;
    }
  }
  if (best == nullptr) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, coll_name(coll), "no registered algorithm can run ", coll_name(coll),
                  " on ", nranks, " ranks");
  }
  return *best;
}

}  // namespace gpucoll::algo
