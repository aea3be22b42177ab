// Ring: ranks form a cycle r-1 -> r -> r+1 and every step moves one chunk (1/P of the data) to the next rank.
//
// all_reduce = reduce-scatter + all-gather, 2(P-1) steps; each rank sends 2(P-1)/P * N bytes, the minimum
// any allreduce can send, so the ring is bandwidth-optimal (cost 2(P-1)(a + b*N/P)) but its latency term
// grows linearly with P.
//
// reduce-scatter step s (0 <= s < P-1): rank r reads chunk c = (r - s - 2) mod P from rank r-1 and reduces
//   it into its own copy. Chunk c starts at rank c+1 (step 0 reads the untouched input of c+1) and gains one
//   contribution per hop, so after P-1 hops it is complete at rank c: rank r owns chunk r, which is exactly
//   reduce_scatter's result.
// all-gather step s: rank r copies chunk (r - s - 1) mod P from rank r-1; at s = 0 that is r-1's own chunk.
// In the same step rank r writes chunk (r-s-2) or (r-s-1) while r+1 reads the next one down, so no chunk is
// read and written at once.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct Ring {
  static constexpr const char* kName = "ring";
  static constexpr const char* kSummary =
      "ring reduce-scatter + all-gather: 2(P-1) steps, bandwidth-optimal, latency linear in P";

  GPUCOLL_HD static bool supports(Coll c) {
    return c == Coll::kAllReduce || c == Coll::kReduceScatter || c == Coll::kAllGather;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    Shape s;
    s.nchunks = p.nranks;
    s.max_ops = 1;
    s.result = Space::kWork;
    const int32_t half = p.nranks - 1;
    s.nsteps = p.coll == Coll::kAllReduce ? 2 * half : half;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    const int32_t prev = mod(rank - 1, P);
    bool reduce_phase = p.coll == Coll::kReduceScatter || (p.coll == Coll::kAllReduce && step < P - 1);
    if (reduce_phase) {
      const int32_t c = mod(rank - step - 2, P);
      out[0] = make_op(prev, c, c, Action::kReduce);
    } else {
      const int32_t s = p.coll == Coll::kAllReduce ? step - (P - 1) : step;
      const int32_t c = mod(rank - s - 1, P);
      out[0] = make_op(prev, c, c, Action::kCopy);
    }
    return 1;
  }

  GPUCOLL_HD static const char* unusable(const Params&) { return nullptr; }
};

}  // namespace gpucoll::algo
