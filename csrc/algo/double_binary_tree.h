// Double binary tree all_reduce (Sanders, Speck, Traeff 2009, "Two-tree algorithms for full bandwidth
// broadcast, reduction and scan"; NCCL's tree algorithm).
//
// One binary tree reduces to its root and broadcasts back in 2*height steps - logarithmic latency - but its
// leaves, half the ranks, only ever send once and receive once, so half the links idle. Two trees in which
// every rank is an inner node in one tree and a leaf in the other fix that: each tree carries half the data
// (nchunks = 2: chunk 0 on tree 0, chunk 1 on tree 1), both run in the same steps, and every rank does inner-
// node work for exactly one half.
//
// The building block is NCCL's in-order binary tree over labels [0, n) (ncclGetBtree): label l > 0 with
// lowest set bit b has children l - b/2 and the first of l + b/2, l + b/4, ... below n, and height log2(b);
// odd labels are leaves, even labels l > 0 are inner nodes; label 0 is a root with a single child, the
// largest power of two below n. Removing label 0 leaves the "trimmed" tree over labels [1, n), rooted at
// pow2_floor(n-1), in which the inner nodes are exactly the even labels.
//   tree 1, every P: the trimmed tree over labels [1, P], rank r = label r+1. Leaves (odd labels) are the
//     even ranks, inner nodes the odd ranks. Height floor(log2 P).
//   tree 0, P even: the same trimmed tree mirrored, rank r = label P-r. Leaves are the odd ranks, inner nodes
//     the even ranks. Height floor(log2 P).
//   tree 0, P odd: the untrimmed tree over labels [0, P), rank r = label r (NCCL's tree 0). Leaves are the odd
//     ranks, inner nodes the even ranks (rank 0 is the root with one child). Height ceil(log2 P).
// So for every P >= 2 each rank is an inner node in exactly one tree and a leaf in the other. P odd needs
// the untrimmed tree: the trimmed tree over [1, P] then has (P-1)/2 inner nodes, so the other tree must
// have (P+1)/2 inner nodes and only (P-1)/2 leaves, which costs ceil(log2 P) levels here. (NCCL uses the
// untrimmed tree for both, mirrored for even P and shifted by one rank for odd P: for even P that is a
// level taller than needed unless P is a power of two, e.g. 3 levels instead of 2 at P = 6, and for odd P
// rank 0 is an inner node in both trees.)
// P = 1: both trees are the single rank 0 and there is nothing to do (0 steps).
//
// Steps: tree k (height h_k) reduces in steps 0..h_k-1: a node of height h reduces its children's chunk k
// (first child first, a fixed order) into its own at step h-1. A child of height h' < h finished its own
// subtree at step h'-1 <= h-2, and nobody writes it afterwards in this phase. Tree k then broadcasts in
// steps h_k..2h_k-1: a node of depth d copies chunk k from its parent at step h_k + d - 1, one step after
// the parent got it. nsteps = 2 * max(h_0, h_1) = 2*floor(log2 P) for even P, 2*ceil(log2 P) for odd P. All
// ranks end with the root's bits for each half, so the result is identical everywhere.
//
// No same-step read/write race: each tree touches only its own chunk, so the trees never collide. Within a
// tree, a node's chunk is written at step h-1 (reduce) or h_k+d-1 (broadcast), and is read at step
// h_parent-1 >= h (by its parent) or h_k+d (by its children) - always a later step.
//
// Cost in the a + b*l model: 2h steps (h = max(h_0, h_1), about log2 P) of messages of l = N/2. In one step a
// rank exchanges at most three of them (with its two children in the tree where it is inner, one in the
// other tree), and over the whole collective about 2N bytes each way (1.5N in its inner tree, N/2 as a leaf;
// 2(P-1)N in total over all ranks), against the ring's 2(P-1)/P*N. Unpipelined that is at most
// 2h*3*(a + b*N/2) with messages serialised, 2h*(a + 1.5*b*N) with concurrent reads: logarithmic latency
// instead of the ring's 2(P-1)*a, for a larger bandwidth term - the tree's regime is small and mid-size
// messages at large P. An executor that overlaps successive pieces down the tree (k pieces) brings it to
// about (2h + k)(a + 1.5*b*N/k); the host executor takes each rank through all 2h steps of one piece before
// the next.
#pragma once

#include "algo/schedule.h"

namespace gpucoll::algo {

struct DoubleBinaryTree {
  static constexpr const char* kName = "dbt";
  static constexpr const char* kSummary =
      "double binary tree: two trees, each rank inner in one and leaf in the other; 2*log2(P) steps";

  // A rank's place in one tree (ranks, -1 where absent).
  struct Node {
    int32_t parent;
    int32_t child[2];
    int32_t nchild;
    int32_t height;  // of the subtree under this node: 0 for a leaf
    int32_t depth;   // 0 for the root
  };

  GPUCOLL_HD static bool supports(Coll c) { return c == Coll::kAllReduce; }

  // Height of tree k over P ranks.
  GPUCOLL_HD static int32_t tree_height(int32_t P, int32_t k) { return k == 0 && P % 2 == 1 ? ceil_log2(P) : ilog2(P); }

  GPUCOLL_HD static Shape shape(const Params& p) {
    Shape s;
    s.nchunks = 2;
    const int32_t h0 = tree_height(p.nranks, 0), h1 = tree_height(p.nranks, 1);
    s.nsteps = 2 * (h0 > h1 ? h0 : h1);
    s.max_ops = 4;  // reduce phase: two children in each tree
    s.result = Space::kWork;
    return s;
  }

  // Tree k over P ranks is NCCL's tree over labels [0, n), trimmed of label 0 or not, with a rank<->label map.
  GPUCOLL_HD static bool trimmed(int32_t P, int32_t k) { return !(k == 0 && P % 2 == 1); }
  GPUCOLL_HD static int32_t nlabels(int32_t P, int32_t k) { return trimmed(P, k) ? P + 1 : P; }
  GPUCOLL_HD static int32_t label_of(int32_t P, int32_t k, int32_t rank) {
    if (k == 1) return rank + 1;
    return P % 2 == 0 ? P - rank : rank;
  }
  GPUCOLL_HD static int32_t rank_of(int32_t P, int32_t k, int32_t label) {
    if (k == 1) return label - 1;
    return P % 2 == 0 ? P - label : label;
  }

  // Parent label of `l` in NCCL's tree over [0, n); -1 for label 0.
  GPUCOLL_HD static int32_t btree_parent(int32_t n, int32_t l) {
    if (l == 0) return -1;
    const int32_t b = l & -l;
    const int32_t up = (l ^ b) | (b << 1);
    return up < n ? up : (l ^ b);
  }

  // Children labels of `l` in NCCL's tree over [0, n); returns how many (0..2).
  GPUCOLL_HD static int btree_children(int32_t n, int32_t l, int32_t* child) {
    if (l == 0) {
      if (n <= 1) return 0;
      child[0] = pow2_floor(n - 1);
      return 1;
    }
    int32_t half = (l & -l) >> 1;
    if (half == 0) return 0;  // odd label: leaf
    int nc = 0;
    child[nc++] = l - half;  // always in range: l - half > 0 and < l < n
    while (half > 0 && l + half >= n) half >>= 1;
    if (half > 0) child[nc++] = l + half;
    return nc;
  }

  // Height of the subtree under label l in NCCL's tree over [0, n).
  GPUCOLL_HD static int32_t btree_height(int32_t n, int32_t l) { return l == 0 ? ceil_log2(n) : ilog2(l & -l); }

  GPUCOLL_HD static Node node(int32_t P, int32_t k, int32_t rank) {
    Node nd;
    const int32_t n = nlabels(P, k);
    const bool trim = trimmed(P, k);
    const int32_t l = label_of(P, k, rank);
    int32_t up = btree_parent(n, l);
    if (trim && up == 0) up = -1;  // label 0 is not part of a trimmed tree
    nd.parent = up < 0 ? -1 : rank_of(P, k, up);
    int32_t kids[2] = {-1, -1};
    nd.nchild = btree_children(n, l, kids);
    nd.child[0] = nd.nchild > 0 ? rank_of(P, k, kids[0]) : -1;
    nd.child[1] = nd.nchild > 1 ? rank_of(P, k, kids[1]) : -1;
    nd.height = btree_height(n, l);
    nd.depth = 0;
    for (int32_t a = up; a > 0 || (a == 0 && !trim); a = btree_parent(n, a)) ++nd.depth;
    return nd;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    const int32_t P = p.nranks;
    int n = 0;
    for (int32_t k = 0; k < 2; ++k) {
      const int32_t h = tree_height(P, k);
      if (step >= 2 * h) continue;
      const Node nd = node(P, k, rank);
      if (step < h) {
        if (nd.nchild > 0 && step == nd.height - 1) {
          for (int i = 0; i < nd.nchild; ++i) out[n++] = make_op(nd.child[i], k, k, Action::kReduce);
        }
      } else if (nd.parent >= 0 && step == h + nd.depth - 1) {
        out[n++] = make_op(nd.parent, k, k, Action::kCopy);
      }
    }
    return n;
  }

  GPUCOLL_HD static const char* unusable(const Params&) { return nullptr; }
};

}  // namespace gpucoll::algo
