// Two-shot: all_reduce = reduce-scatter + all-gather, each done in ONE step of direct reads.
//
// nchunks = P; rank r owns chunk r.
//   step 0 (reduce-scatter): rank r reduces chunk r of every peer into chunk r of its own work buffer. The
//     order is fixed: its own input first (it is already in place), then the peers in ascending rank order
//     skipping r, i.e. x_r + x_0 + x_1 + ... - deterministic from run to run. (It is not the 0..P-1 order of
//     one-shot for r >= 2: without a scratch chunk the accumulator has to start from the owner's input.)
//   step 1 (all-gather): rank r copies chunk p from rank p, for every p (itself included), straight into its
//     output. Every rank thus ends up with the owner's bits for each chunk, identical everywhere, and no
//     copy-out pass is needed: on shared memory that saves a read and a write of the whole message.
// reduce_scatter is step 0 alone (result in the work buffer, copy-out takes chunk r), all_gather is step 1
// alone (copy-in put each rank's block at chunk r, which is its own chunk; result in the output).
//
// No same-step read/write race: in step 0 rank r writes only chunk r of its own buffer and peers read only
// chunks q != r of it; in step 1 nobody writes a work buffer at all (every write goes to the private output).
//
// Cost in the a + b*l model: 2 steps; every rank sends and receives 2(P-1)/P*N bytes - the ring's volume,
// the minimum for all_reduce - with 2 synchronisations instead of the ring's 2(P-1). Where a step's reads
// run concurrently (shared memory, NVSwitch) that is about 2a + b*2(P-1)/P*N: the mid-size choice between
// one-shot (a + b(P-1)N) and the ring. In the one-message-at-a-time model the reads serialise into
// 2(P-1)(a + b*N/P), exactly the ring's cost.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct TwoShot {
  static constexpr const char* kName = "twoshot";
  static constexpr const char* kSummary =
      "direct-read reduce-scatter + all-gather: 2 steps, 2(P-1)/P*N per rank (ring volume, constant latency)";

  GPUCOLL_HD static bool supports(Coll c) {
    return c == Coll::kAllReduce || c == Coll::kReduceScatter || c == Coll::kAllGather;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    Shape s;
    s.nchunks = p.nranks;
    s.nsteps = p.coll == Coll::kAllReduce ? 2 : 1;
    s.max_ops = p.nranks;
    s.result = p.coll == Coll::kReduceScatter ? Space::kWork : Space::kOut;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    const bool reduce_phase = p.coll == Coll::kReduceScatter || (p.coll == Coll::kAllReduce && step == 0);
    int n = 0;
    for (int32_t q = 0; q < P; ++q) {
      // Reduce-scatter pulls the peer's copy of my chunk; all-gather pulls each owner's chunk into the output.
      if (reduce_phase) {
        if (q != rank) out[n++] = make_op(q, rank, rank, Action::kReduce);
      } else {
        out[n++] = make_op(q, q, q, Action::kCopy, Space::kOut);
      }
    }
    return n;
  }

  GPUCOLL_HD static const char* unusable(const Params&) { return nullptr; }
};

}  // namespace gpucoll::algo
