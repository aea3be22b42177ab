// The schedule checker: runs a schedule symbolically and proves it computes its collective.
//
// No data moves. Every chunk holds the set of contributions it carries, a contribution being (origin rank,
// origin chunk). Copy-in seeds the sets as the executors do (schedule.h), a copy replaces the destination's
// set, a reduce unions it in - and fails if the sets overlap (something would be counted twice) or if it
// mixes different chunk positions. At the end each rank must hold exactly what the collective promises.
// The checker also enforces the ordering contract (nobody reads a chunk its owner writes in the same step)
// and counts steps and bytes per rank, which the cost model uses as its one source of truth.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "algo/registry.h"

namespace gpucoll::algo {

struct CheckResult {
  bool ok = false;
  std::string error;                 // first violation, with rank/step/chunk
  int32_t nsteps = 0;
  int32_t nchunks = 0;
  std::vector<int64_t> bytes_sent;   // per rank (read by peers from its work buffer)
  std::vector<int64_t> bytes_recv;   // per rank (read by it from peers)
  std::vector<int32_t> active_steps; // per rank: steps in which it reads from at least one peer
  int64_t max_bytes_sent() const;
  int64_t max_bytes_recv() const;
};

// `nbytes` is the size of the collective's full buffer (N for all_reduce, P*n for blocked collectives);
// byte counts assume a one-byte element, i.e. they are exact for that many bytes.
CheckResult check_schedule(const Algorithm& algorithm, const Params& params, int64_t nbytes);

}  // namespace gpucoll::algo
