// Direct: every collective except all_reduce as ONE step of direct reads - each rank pulls exactly the
// chunks it needs straight from the rank that holds them, with no intermediate hops.
//
// The shapes (P = nranks, n = per-rank block, N = full buffer; result space in brackets):
//   broadcast      nchunks 1: every non-root copies the root's buffer into its work buffer.      [work]
//   reduce         nchunks 1: the root copies rank 0's buffer into its output, then reduces ranks
//                  1..P-1 into it in that order; the other ranks have no ops.                     [out]
//   all_gather     nchunks P: rank r copies block p of rank p into out block p, for every p.      [out]
//   reduce_scatter nchunks P: rank r copies block r of rank 0 into out, then reduces block r of
//                  ranks 1..P-1 into it in that order.                                            [out]
//   all_to_all     nchunks P: rank r copies block r of rank p into out block p, for every p.      [out]
//   gather         nchunks P: the root copies block p of rank p into out block p, for every p.    [out]
//   scatter        nchunks P: rank r != root copies block r of the root into its work block r.    [work]
// Self-reads (peer == rank) are part of the lists where the result lives in `out`, so the copy into the
// output is the step itself and the executor's copy-out pass has nothing left to do.
//
// Why there are no same-step read/write races: only broadcast and scatter write work buffers, and they
// write non-roots' buffers, which nobody reads; every other shape writes only the executing rank's private
// output, which no peer can read at all. That is also why all_to_all cannot work in place: peers read
// block p of rank p's work buffer during the same step in which rank p would overwrite it.
//
// Reductions run in the fixed rank order 0, 1, ..., P-1 whatever the executing rank, so reduce and
// reduce_scatter give the same bits as the one-shot all_reduce (one_shot.h) and do not depend on the root.
//
// Cost in the a + b*l model (a per message, b per byte): one step, i.e. one synchronisation. A rank pulls
// (P-1)*N bytes for broadcast/reduce (root)/gather (root: (P-1)*n) and (P-1)*n = (P-1)/P*N for all_gather,
// reduce_scatter and all_to_all. Where a step's reads proceed concurrently (shared memory, NVSwitch) that
// is about a + b*(bytes pulled) - the latency-optimal choice for small messages; in the one-message-at-a-
// time model of the seed notes the reads serialise into (P-1)(a + b*l) with l = N or n. Rooted shapes
// concentrate all traffic on the root (reduce/gather) or on its work buffer (broadcast/scatter), so they
// are for small P and small messages; trees and rings take over beyond.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

// Helpers shared by the one-step shapes of OneShot and TwoShot.
namespace direct {

// dst_space[chunk] = work[0][chunk] (+) work[1][chunk] (+) ... in rank order; the first op copies.
GPUCOLL_HD inline int reduce_in_rank_order(int32_t P, int32_t chunk, Space dst, Op* out) {
  for (int32_t p = 0; p < P; ++p) out[p] = make_op(p, chunk, chunk, p == 0 ? Action::kCopy : Action::kReduce, dst);
  return P;
}

// out[p] = work[p][src_of_p] for every p: src_chunk = p (all_gather/gather) or the executing rank's block
// (all_to_all).
GPUCOLL_HD inline int copy_from_all(int32_t P, int32_t fixed_src, bool src_is_peer, Op* out) {
  for (int32_t p = 0; p < P; ++p) out[p] = make_op(p, src_is_peer ? p : fixed_src, p, Action::kCopy, Space::kOut);
  return P;
}

}  // namespace direct

struct Direct {
  static constexpr const char* kName = "direct";
  static constexpr const char* kSummary =
      "one step of direct reads for every collective but all_reduce: latency-optimal, (P-1) blocks per rank";

  GPUCOLL_HD static bool supports(Coll c) { return c != Coll::kAllReduce; }

  GPUCOLL_HD static Shape shape(const Params& p) {
    Shape s;
    s.nsteps = 1;
    s.nchunks = coll_is_blocked(p.coll) ? p.nranks : 1;
    s.max_ops = p.nranks;
    s.result = p.coll == Coll::kBroadcast || p.coll == Coll::kScatter ? Space::kWork : Space::kOut;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    if (step != 0) return 0;
    switch (p.coll) {
      case Coll::kBroadcast:
        if (rank == p.root) return 0;
        out[0] = make_op(p.root, 0, 0, Action::kCopy);
        return 1;
      case Coll::kReduce:
        return rank == p.root ? direct::reduce_in_rank_order(P, 0, Space::kOut, out) : 0;
      case Coll::kAllGather:
        return direct::copy_from_all(P, 0, true, out);
      case Coll::kReduceScatter:
        return direct::reduce_in_rank_order(P, rank, Space::kOut, out);
      case Coll::kAllToAll:
        return direct::copy_from_all(P, rank, false, out);
      case Coll::kGather:
        return rank == p.root ? direct::copy_from_all(P, 0, true, out) : 0;
      case Coll::kScatter:
        if (rank == p.root) return 0;
        out[0] = make_op(p.root, rank, rank, Action::kCopy);
        return 1;
      case Coll::kAllReduce:
        break;
    }
    return 0;
  }

  GPUCOLL_HD static const char* unusable(const Params&) { return nullptr; }
};

}  // namespace gpucoll::algo
