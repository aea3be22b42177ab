#include "core/stragglers.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "core/error.h"

namespace gpucoll {

StragglerWindow::StragglerWindow(int nranks, int capacity)
    : nranks_(nranks), capacity_(capacity),
      late_ns_(static_cast<size_t>(nranks) * static_cast<size_t>(capacity)),
      last_(static_cast<size_t>(capacity)) {
  if (nranks < 1 || capacity < 1) {
    GPUCOLL_INVALID_ARG("a straggler window needs nranks >= 1 and capacity >= 1; got ", nranks, " and ", capacity);
  }
}

int64_t StragglerWindow::add(const int64_t* arrival_ns) {
  const std::lock_guard<std::mutex> lock(mu_);
  int64_t first = arrival_ns[0], latest = arrival_ns[0];
  int latest_rank = 0;
  bool tie = false;
  for (int r = 1; r < nranks_; ++r) {
    first = std::min(first, arrival_ns[r]);
    if (arrival_ns[r] > latest) {
      latest = arrival_ns[r];
      latest_rank = r;
      tie = false;
    } else if (arrival_ns[r] == latest) {
      tie = true;
    }
  }
  int64_t* row = &late_ns_[static_cast<size_t>(next_) * static_cast<size_t>(nranks_)];
  for (int r = 0; r < nranks_; ++r) row[r] = arrival_ns[r] - first;
  last_[static_cast<size_t>(next_)] = nranks_ > 1 && !tie ? latest_rank : -1;
  next_ = (next_ + 1) % capacity_;
  filled_ = std::min<int64_t>(filled_ + 1, capacity_);
  return ++total_;
}

void StragglerWindow::clear() {
  const std::lock_guard<std::mutex> lock(mu_);
  filled_ = 0;
  next_ = 0;
  total_ = 0;
}

StragglerWindow::Snapshot StragglerWindow::stats() const {
  const std::lock_guard<std::mutex> lock(mu_);
  Snapshot out;
  out.samples = filled_;
  out.total = total_;
  out.ranks.resize(static_cast<size_t>(nranks_));
  if (filled_ == 0) return out;
  std::vector<int64_t> col(static_cast<size_t>(filled_));
  // Nearest-rank percentiles of the held samples (their order in the ring does not matter).
  const auto at = [&](double q) {
    const auto k = static_cast<size_t>(std::max<double>(0, q * static_cast<double>(col.size()) - 1e-9));
    std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(k), col.end());
    return static_cast<double>(col[k]) * 1e-9;
  };
  const auto P = static_cast<size_t>(nranks_);
  for (int r = 0; r < nranks_; ++r) {
    for (size_t i = 0; i < col.size(); ++i) col[i] = late_ns_[i * P + static_cast<size_t>(r)];
    RankLateness& s = out.ranks[static_cast<size_t>(r)];
    s.max_s = static_cast<double>(*std::max_element(col.begin(), col.end())) * 1e-9;
    s.median_s = at(0.5);
    s.p90_s = at(0.9);
  }
  for (int64_t i = 0; i < filled_; ++i) {
    const int32_t who = last_[static_cast<size_t>(i)];
    if (who >= 0) ++out.ranks[static_cast<size_t>(who)].last;
  }
  return out;
}

std::string StragglerWindow::summary(int top) const { return summary(stats(), top); }

std::string StragglerWindow::summary(const Snapshot& snap, int top) {
  const std::vector<RankLateness>& s = snap.ranks;
  const int64_t filled = snap.samples;
  std::vector<int> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const RankLateness &x = s[static_cast<size_t>(a)], &y = s[static_cast<size_t>(b)];
    return x.last != y.last ? x.last > y.last : x.median_s > y.median_s;
  });
  std::string out = "stragglers over the last " + std::to_string(filled) + " collectives";
  if (filled == 0) return out + ": none measured yet";
  out += ":";
  char buf[160];
  for (int i = 0; i < std::min<int>(top, static_cast<int>(s.size())); ++i) {
    const RankLateness& x = s[static_cast<size_t>(order[static_cast<size_t>(i)])];
    std::snprintf(buf, sizeof(buf), "%s rank %d last in %.0f%% (median %.3g ms, p90 %.3g ms, max %.3g ms late)",
                  i == 0 ? "" : ";", order[static_cast<size_t>(i)],
                  100.0 * static_cast<double>(x.last) / static_cast<double>(filled), x.median_s * 1e3,
                  x.p90_s * 1e3, x.max_s * 1e3);
    out += buf;
  }
  return out;
}

}  // namespace gpucoll
