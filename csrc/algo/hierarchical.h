// Hierarchical two-level all_reduce: keep most of the traffic on the fast links inside a node and send only
// 1/L of the data per rank over the slow links between nodes.
//
// Ranks are grouped into N = P / L nodes of L = Params.local_size consecutive ranks: node = rank / L, local
// index li = rank % L. The buffer is cut into L slices, one per local index, and every slice into N
// sub-chunks, so nchunks = L * N and chunk s*N + j is sub-chunk j of slice s (slices are contiguous).
//
// Phase 1, intra-node reduce-scatter, L-1 steps: a ring over the node's L ranks moving whole slices. At step
//   t local rank li reduces slice (li - t - 2) mod L from local rank li-1 (N reduce ops, one per sub-chunk,
//   contiguous). As in ring.h, after L-1 hops local rank li holds slice li summed over its node.
// Phase 2, inter-node all_reduce, 2(N-1) steps: the N ranks with the same local index - one per node, each
//   holding its node's sum of slice li - run a ring all_reduce on that slice over its N sub-chunks: N-1
//   steps where node n reduces sub-chunk (n - t - 2) mod N from node n-1, then N-1 steps where it copies
//   sub-chunk (n - t - 1) mod N. The L slices are reduced across nodes concurrently, by disjoint rank sets,
//   so every node's L links to the network are busy at once.
// Phase 3, intra-node all-gather, L-1 steps: the ring again, copying slice (li - t - 1) mod L from li-1.
// Steps: 2(L-1) + 2(N-1), against the flat ring's 2(LN-1).
//
// Cost in the a + b*l model, with (a_i, b_i) inside a node and (a_x, b_x) between nodes, S = buffer bytes:
//   2(L-1)(a_i + b_i S/L) + 2(N-1)(a_x + b_x S/(LN)).
// Each rank sends 2(L-1)/L * S inside its node and 2(N-1)/N * S/L across nodes: the node as a whole puts
// 2(N-1)/N * S on the network, the minimum for an all_reduce between N nodes, and only 2(N-1) steps pay the
// slow link's latency. A flat ring over all P ranks crosses the network on some hop of every one of its
// 2(P-1) steps, and a step lasts as long as its slowest hop: 2(P-1)(a_x + b_x S/P). L = 1 is a plain ring
// over the nodes; N = 1 is a plain ring inside the node.
//
// Races: phases 1 and 3 are ring.h's schedule on slices - in a step rank li writes slice (li-t-2) or
// (li-t-1) while li+1 reads the next slice down. In phase 2 a rank writes sub-chunk (n-t-2) or (n-t-1) of
// its slice while node n+1 reads sub-chunk (n-t-1) or (n-t) of it, and ranks of other local indices read
// nothing from it. So no chunk is read and written in the same step.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct Hierarchical {
  static constexpr const char* kName = "hierarchical";
  static constexpr const char* kSummary =
      "two-level all_reduce: ring reduce-scatter inside each node, ring all_reduce across nodes on 1/L of "
      "the data per rank, ring all-gather inside the node; 2(L-1)+2(N-1) steps for N nodes of L ranks";

  GPUCOLL_HD static bool supports(Coll c) { return c == Coll::kAllReduce; }

  GPUCOLL_HD static const char* unusable(const Params& p) {
    if (p.local_size < 1) return reason(p.local_size, 0);
    if (p.nranks % p.local_size != 0) return reason(p.local_size, p.nranks);
    return nullptr;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    const int32_t L = p.local_size;
    const int32_t N = p.nranks / L;
    Shape s;
    s.nchunks = L * N;
    s.nsteps = 2 * (L - 1) + 2 * (N - 1);
    s.max_ops = N;  // a whole slice per intra-node step
    s.result = Space::kWork;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t L = p.local_size;
    const int32_t N = p.nranks / L;
    const int32_t node = rank / L;
    const int32_t li = rank % L;
    const int32_t local_prev = node * L + mod(li - 1, L);
    const int32_t node_prev = mod(node - 1, N) * L + li;
    int32_t t = step;
    if (t < L - 1) return slice_ops(local_prev, mod(li - t - 2, L), N, Action::kReduce, out);
    t -= L - 1;
    if (t < N - 1) {
      const int32_t c = li * N + mod(node - t - 2, N);
      out[0] = make_op(node_prev, c, c, Action::kReduce);
      return 1;
    }
    t -= N - 1;
    if (t < N - 1) {
      const int32_t c = li * N + mod(node - t - 1, N);
      out[0] = make_op(node_prev, c, c, Action::kCopy);
      return 1;
    }
    t -= N - 1;
    return slice_ops(local_prev, mod(li - t - 1, L), N, Action::kCopy, out);
  }

 private:
  // One op per sub-chunk of slice s, read from `peer`.
  GPUCOLL_HD static int slice_ops(int32_t peer, int32_t s, int32_t N, Action action, Op* out) {
    for (int32_t j = 0; j < N; ++j) out[j] = make_op(peer, s * N + j, s * N + j, action);
    return N;
  }

  // "local_size=3 does not divide world size 8". Host code formats into a per-thread buffer that callers
  // copy at once (no allocation); device code never reports reasons and gets the fixed sentence.
  GPUCOLL_HD static const char* reason(int32_t local_size, int32_t nranks) {
#if defined(__CUDA_ARCH__)
    (void)local_size;
    (void)nranks;
    return "local_size must be >= 1 and divide the world size";
#else
    static thread_local char buf[96];
    int n = 0;
    auto put = [&](const char* s) {
      while (*s && n < static_cast<int>(sizeof(buf)) - 1) buf[n++] = *s++;
    };
    auto put_int = [&](int32_t x) {
      char digits[12];
      int k = 0;
      int64_t v = x;
      if (v < 0) {
        put("-");
        v = -v;
      }
      do {
        digits[k++] = static_cast<char>('0' + v % 10);
        v /= 10;
      } while (v != 0);
      while (k > 0 && n < static_cast<int>(sizeof(buf)) - 1) buf[n++] = digits[--k];
    };
    put("local_size=");
    put_int(local_size);
    put(local_size < 1 ? " must be >= 1" : " does not divide world size ");
    if (local_size >= 1) put_int(nranks);
    buf[n] = '\0';
    return buf;
#endif
  }
};

}  // namespace gpucoll::algo
