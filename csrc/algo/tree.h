// Binomial tree: the latency-optimal schedule for rooted collectives. The set of ranks that hold the data
// (broadcast, scatter) or still have something to contribute (reduce, gather) doubles or halves every step,
// so P ranks are done in L = ceil(log2 P) steps instead of the ring's P-1.
//
// Everything is written in relative ranks v = (rank - root) mod P, so the root is v = 0 and the tree is the
// same shape for every root; ops name absolute ranks and, for blocked collectives, absolute chunk indices
// (chunk c is rank c's block). all_reduce has no root and uses rank 0.
//
// broadcast, step k (0 <= k < L): every v with 2^k <= v < 2^(k+1) copies the whole buffer from its parent
//   v - 2^k. The parent is < 2^k, so it got the data at an earlier step (or is the root): after step k the
//   ranks 0 .. 2^(k+1)-1 hold it. That is "ranks < 2^k send to v + 2^k" written in the pull model.
// reduce, step k: every v with v mod 2^(k+1) == 0 and v + 2^k < P reduces the buffer of v + 2^k into its
//   own. v + 2^k has bit k set and lower bits clear; in steps 0..k-1 it has already absorbed its subtree
//   v+2^k .. v+2^(k+1)-1, so after step k v holds v .. v+2^(k+1)-1 and after L steps the root holds all.
//   The mirror image of broadcast: the same edges, walked in the other direction.
// all_reduce = reduce to rank 0 (L steps) + broadcast from rank 0 (L steps): 2L steps. The result is
//   computed once, on rank 0, and copied everywhere, so every rank holds identical bits.
// gather (blocked, nchunks = P), step k: the same edges as reduce, but v copies the chunks of the whole
//   subtree of v + 2^k, i.e. relative ranks [v + 2^k, min(v + 2^(k+1), P)): up to 2^k chunks, contiguous
//   in relative order, so a message-passing executor can send them as one message.
// scatter (blocked), step j with k = L-1-j (distance halving): every v with v mod 2^(k+1) == 2^k copies its
//   subtree's chunks [v, min(v + 2^k, P)) from v - 2^k. The root first hands the upper half of the ranks to
//   v = 2^(L-1), and so on down: the exact reverse of gather.
//
// Cost in the a + b*l model (l = message bytes, N = full buffer bytes):
//   broadcast, reduce: L(a + bN). Latency log P instead of the ring's P-1, but every step moves the whole
//     buffer, so for large N the ring (or scatter + all-gather) wins. The root sends (reduce: receives) the
//     buffer L times; leaves touch it once.
//   all_reduce: 2L(a + bN).
//   gather, scatter: L*a + b(P-1)/P*N. The root receives (sends) everyone else's block exactly once; the
//     step-k messages carry 2^k blocks, so the bandwidth term is the same as a direct gather while the
//     latency term is log P. (The textbook a log p + (p-1) b l with l = N/P.)
//
// Races: at step k the writers are the ranks with bit k of v set (broadcast, scatter) or clear (reduce,
// gather) and the ranks read are exactly the other class, so no rank's chunk is read and written in the same
// step. (For gather/scatter the readers and the read ranks also differ in that bit, and the reader only
// writes chunk positions of the other subtree.)
//
// Whole-buffer chunks (nchunks 1) for broadcast/reduce/all_reduce: the executor pipelines large messages by
// cutting them into pieces and running the schedule once per piece.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct Tree {
  static constexpr const char* kName = "tree";
  static constexpr const char* kSummary =
      "binomial tree: broadcast/reduce/gather/scatter in ceil(log2 P) steps, all_reduce = reduce + broadcast "
      "in 2 ceil(log2 P); latency-optimal, whole buffer per step";

  GPUCOLL_HD static bool supports(Coll c) {
    return c == Coll::kAllReduce || c == Coll::kBroadcast || c == Coll::kReduce || c == Coll::kGather ||
           c == Coll::kScatter;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    const int32_t L = ceil_log2(p.nranks);
    Shape s;
    s.nchunks = coll_is_blocked(p.coll) ? p.nranks : 1;
    s.nsteps = p.coll == Coll::kAllReduce ? 2 * L : L;
    // A gather/scatter step moves at most min(2^k, P - 2^k) <= P/2 blocks per rank.
    s.max_ops = coll_is_blocked(p.coll) && p.nranks > 1 ? p.nranks / 2 : 1;
    s.result = Space::kWork;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    const int32_t root = coll_is_rooted(p.coll) ? p.root : 0;
    const int32_t v = mod(rank - root, P);
    const int32_t L = ceil_log2(P);
    switch (p.coll) {
      case Coll::kBroadcast:
        return broadcast_op(P, root, v, step, out);
      case Coll::kReduce:
        return reduce_op(P, root, v, step, out);
      case Coll::kAllReduce:
        return step < L ? reduce_op(P, root, v, step, out) : broadcast_op(P, root, v, step - L, out);
      case Coll::kGather: {
        const int32_t half = 1 << step;
        if (v % (2 * half) != 0 || v + half >= P) return 0;
        const int32_t end = v + 2 * half < P ? v + 2 * half : P;
        int n = 0;
        for (int32_t u = v + half; u < end; ++u) {
          const int32_t c = mod(u + root, P);
          out[n++] = make_op(mod(v + half + root, P), c, c, Action::kCopy);
        }
        return n;
      }
      case Coll::kScatter: {
        const int32_t half = 1 << (L - 1 - step);
        if (v % (2 * half) != half) return 0;
        const int32_t end = v + half < P ? v + half : P;
        int n = 0;
        for (int32_t u = v; u < end; ++u) {
          const int32_t c = mod(u + root, P);
          out[n++] = make_op(mod(v - half + root, P), c, c, Action::kCopy);
        }
        return n;
      }
      default:
        return 0;
    }
  }

  GPUCOLL_HD static const char* unusable(const Params& p) {
    if (coll_is_rooted(p.coll) && (p.root < 0 || p.root >= p.nranks)) return "root is not a rank of the group";
    return nullptr;
  }

 private:
  // Relative rank v in [2^k, 2^(k+1)) copies the buffer from its parent v - 2^k.
  GPUCOLL_HD static int broadcast_op(int32_t P, int32_t root, int32_t v, int32_t k, Op* out) {
    const int32_t half = 1 << k;
    if (v < half || v >= 2 * half) return 0;
    out[0] = make_op(mod(v - half + root, P), 0, 0, Action::kCopy);
    return 1;
  }

  // Relative rank v with v mod 2^(k+1) == 0 reduces its child v + 2^k's partial result, if that child exists.
  GPUCOLL_HD static int reduce_op(int32_t P, int32_t root, int32_t v, int32_t k, Op* out) {
    const int32_t half = 1 << k;
    if (v % (2 * half) != 0 || v + half >= P) return 0;
    out[0] = make_op(mod(v + half + root, P), 0, 0, Action::kReduce);
    return 1;
  }
};

}  // namespace gpucoll::algo
