// Who arrives late at collectives: the barrel effect (the slowest rank sets everyone's pace), measured.
//
// A backend that learns every rank's arrival time at a collective for free hands them here, one collective at a
// time; the window keeps the last `capacity` of them and answers per-rank statistics over it. Lateness is taken
// against the first rank to arrive, so clocks need only agree within one machine (the host backend's ranks all
// read CLOCK_MONOTONIC, the same clock for every process). A rank's lateness is what the others waited for it;
// "last" is the rank that arrived last, the one the barrel effect is about.
//
// A mutex guards the window: the backend adds from the thread that runs its collectives (with the GIL released),
// and stats may be asked from another (torch's worker thread runs the collectives of a torch job). Uncontended, it
// costs tens of nanoseconds per collective.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gpucoll {

struct RankLateness {
  double median_s = 0;   // median lateness over the window
  double p90_s = 0;      // 90th percentile
  double max_s = 0;
  int64_t last = 0;      // collectives of the window at which this rank arrived last (strictly after every other)
};

class StragglerWindow {
 public:
  StragglerWindow(int nranks, int capacity);
  // One collective: arrival_ns[r] is rank r's arrival time, in nanoseconds of one clock. Returns how many
  // collectives were added since construction or clear(), this one included.
  int64_t add(const int64_t* arrival_ns);
  void clear();
  int capacity() const { return capacity_; }
  int nranks() const { return nranks_; }
  struct Snapshot {
    int64_t samples = 0;  // collectives held (at most capacity)
    int64_t total = 0;    // collectives added since construction or clear()
    std::vector<RankLateness> ranks;
  };
  Snapshot stats() const;
  // One line: the `top` ranks that arrived last most often, with their lateness ("rank 2 last in 10% (median
  // 0 ms, p90 201 ms, max 210 ms late); ...") over the window.
  std::string summary(int top = 3) const;
  static std::string summary(const Snapshot& s, int top = 3);

 private:
  mutable std::mutex mu_;
  int nranks_;
  int capacity_;
  int64_t filled_ = 0;  // samples held (at most capacity_)
  int64_t next_ = 0;    // ring position of the next sample
  int64_t total_ = 0;
  std::vector<int64_t> late_ns_;  // [capacity][nranks]
  std::vector<int32_t> last_;     // [capacity]: the rank that arrived last, -1 for a tie at the top
};

}  // namespace gpucoll
