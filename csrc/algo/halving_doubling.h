// Recursive halving-doubling (Rabenseifner): all_reduce in 2 log2 P steps that still sends only
// 2(P-1)/P * N bytes per rank, i.e. the ring's bandwidth with a logarithmic latency term.
//
// Power-of-two P = 2^m, nchunks = P. Think of the ranks as the corners of an m-dimensional hypercube.
//
// Reduce-scatter by recursive halving, step k (0 <= k < m), distance d = P / 2^(k+1) (P/2, P/4, ..., 1):
//   before the step, rank r is responsible for an aligned block of 2d chunks, base = r & ~(2d-1), in which
//   every chunk holds the sum over the 2^k ranks r ^ x, x any combination of the distances already used
//   (P/2, ..., 2d): the ranks that agree with r on the bits below 2d. Rank r and its partner r ^ d hold the
//   same block with disjoint contributor sets (they differ in bit d). Each keeps one half - the lower half
//   if bit d of r is clear, else the upper half - and, in pull form, reduces ITS half from the partner's
//   buffer (d reduce ops). The partner does the same for the other half. After step k the block has d chunks with
//   2^(k+1) contributions each; after m steps rank r owns chunk r, complete - exactly reduce_scatter's result.
// All-gather by recursive doubling, step k, distance d = 2^k (1, 2, ..., P/2): rank r holds the finished
//   aligned block of d chunks around chunk r; its partner r ^ d holds the neighbouring block. r copies the
//   partner's block (d copy ops), so the finished block doubles. After m steps every rank holds all chunks.
//   The distances run in the reverse order of the halving, which is why chunk r at rank r fits both.
//
// all_reduce = halving + doubling: 2m steps. Each step's messages are contiguous chunk ranges (one message
// for a message-passing executor). Bytes per rank: sum_k N/2^(k+1) twice = 2(P-1)/P * N.
// Cost in the a + b*l model: 2 log2 P * a + 2(P-1)/P * N * b (plus the reduction work). The ring pays the
// same bandwidth but 2(P-1) latencies; the binomial tree pays 2 log2 P latencies but moves N every step.
// Drawback: partners are far apart in the late/early steps, which hurts on hierarchical networks.
//
// Non-power-of-two P: P' = 2^m = largest power of two <= P, extra = P - P'. nchunks = P', so the halving
// still cuts contiguous halves.
//   fold (1 step): the first 2*extra ranks pair up (2i, 2i+1); odd rank 2i+1 reduces all P' chunks of
//     even rank 2i. The even ranks then sit out.
//   the P' remaining ranks run the power-of-two all_reduce above under new ranks: odd rank 2i+1 -> i for
//     i < extra, rank q >= 2*extra -> q - extra.
//   unfold (1 step): even rank 2i copies all P' chunks of the finished result from 2i+1.
//   Steps: 2m + 2. Cost: 2(a + bN) + 2m*a + 2(P'-1)/P' * N * b. (The standard MPICH fix-up.)
// reduce_scatter / all_gather are blocked (nchunks must equal P, chunk r is rank r's block), so they are
// offered only for powers of two: halving alone (m steps) for reduce_scatter, doubling alone for
// all_gather. With other P the halves do not split P blocks evenly.
//
// Races: in a halving step r writes the half it keeps and its partner reads the other half; in a doubling
// step r writes the partner's block positions and the partner reads r's block. In the fold step only odd
// ranks write and only even ranks are read; in the unfold step the reverse. So no chunk is read and written
// in the same step. Each chunk's final value is reduced once (at its owner) and then copied, so all ranks
// end with identical bits.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct HalvingDoubling {
  static constexpr const char* kName = "halving_doubling";
  static constexpr const char* kSummary =
      "recursive halving reduce-scatter + recursive doubling all-gather (Rabenseifner): 2 log2 P steps, "
      "bandwidth-optimal; non-powers of two fold the extra ranks in and out (+2 steps)";

  GPUCOLL_HD static bool supports(Coll c) {
    return c == Coll::kAllReduce || c == Coll::kReduceScatter || c == Coll::kAllGather;
  }

  GPUCOLL_HD static const char* unusable(const Params& p) {
    if (p.coll != Coll::kAllReduce && pow2_floor(p.nranks) != p.nranks) {
      return "reduce_scatter and all_gather by recursive halving/doubling need a power-of-two world size: "
             "their P blocks are split in halves at every step (all_reduce works for any size)";
    }
    return nullptr;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    const int32_t m = ilog2(p.nranks);
    const int32_t P2 = 1 << m;
    const bool fold = p.nranks != P2;
    Shape s;
    s.result = Space::kWork;
    if (p.coll == Coll::kAllReduce) {
      s.nchunks = P2;
      s.nsteps = 2 * m + (fold ? 2 : 0);
      // The fold/unfold steps move all P' chunks; a halving/doubling step at most P'/2.
      s.max_ops = fold ? P2 : (P2 > 1 ? P2 / 2 : 1);
    } else {
      s.nchunks = p.nranks;
      s.nsteps = m;
      s.max_ops = p.nranks > 1 ? p.nranks / 2 : 1;
    }
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    const int32_t m = ilog2(P);
    const int32_t P2 = 1 << m;
    if (p.coll == Coll::kReduceScatter) return halving(P2, 0, rank, step, out);
    if (p.coll == Coll::kAllGather) return doubling(0, rank, step, out);

    const int32_t extra = P - P2;
    int32_t t = step;
    if (extra > 0) {
      if (t == 0 || t == 2 * m + 1) {
        if (rank >= 2 * extra) return 0;
        // Fold: the odd rank of the pair absorbs the even one. Unfold: the even rank fetches the result.
        const bool fold = t == 0;
        if ((rank % 2 == 1) != fold) return 0;
        const int32_t partner = fold ? rank - 1 : rank + 1;
        for (int32_t c = 0; c < P2; ++c) out[c] = make_op(partner, c, c, fold ? Action::kReduce : Action::kCopy);
        return P2;
      }
      t -= 1;
      if (rank < 2 * extra && rank % 2 == 0) return 0;  // folded away until the unfold step
    }
    const int32_t nr = rank < 2 * extra ? rank / 2 : rank - extra;
    return t < m ? halving(P2, extra, nr, t, out) : doubling(extra, nr, t - m, out);
  }

 private:
  // Rank of new rank nr among the P' ranks that run the power-of-two schedule.
  GPUCOLL_HD static int32_t real_rank(int32_t extra, int32_t nr) { return nr < extra ? 2 * nr + 1 : nr + extra; }

  // Halving step k: keep the half of the current 2d-chunk block selected by bit d of nr; reduce it from the
  // partner, which keeps (and reads from nr) the other half.
  GPUCOLL_HD static int halving(int32_t P2, int32_t extra, int32_t nr, int32_t k, Op* out) {
    const int32_t d = P2 >> (k + 1);
    const int32_t partner = real_rank(extra, nr ^ d);
    const int32_t keep = (nr & ~(2 * d - 1)) + (nr & d);
    for (int32_t i = 0; i < d; ++i) out[i] = make_op(partner, keep + i, keep + i, Action::kReduce);
    return d;
  }

  // Doubling step k: copy the partner's finished block of d = 2^k chunks next to nr's own.
  GPUCOLL_HD static int doubling(int32_t extra, int32_t nr, int32_t k, Op* out) {
    const int32_t d = 1 << k;
    const int32_t pnr = nr ^ d;
    const int32_t base = pnr & ~(d - 1);
    const int32_t partner = real_rank(extra, pnr);
    for (int32_t i = 0; i < d; ++i) out[i] = make_op(partner, base + i, base + i, Action::kCopy);
    return d;
  }
};

}  // namespace gpucoll::algo
