// Schedules: what every rank does at every step of a collective algorithm, as data.
//
// One schedule, several executors. The host backend (csrc/backends/host/) and the CUDA kernels
// (csrc/backends/custom/kernels/) both run the ops produced here, so the CPU tests check the same logic the GPU
// runs. The generator side (everything in csrc/algo/*.h) is header-only and compiles as host C++ and as CUDA device
// code: no STL, no exceptions, no allocation - callers pass an output array of Schedule::max_ops entries.
//
// The model is "pull": every rank owns a work buffer that its peers can read (shared memory on the host,
// peer-mapped memory on GPUs). An op reads one chunk of some rank's work buffer and copies or reduces it
// into a chunk of the executing rank's own work buffer or private output. A message-passing executor (NCCL
// send/recv, a network) turns each op into a send on the peer and a matching receive on the executing rank;
// step_ops(peer, ...) tells the peer what it must send.
//
// Ordering contract every executor honours (and the checker verifies schedules against):
//  * RAW: an op at step t that reads rank p's chunk sees p's buffer as it was after p completed step t-1.
//  * WAR: a rank starts step t only after every rank that read from it at step t-1 has completed step t-1.
//  * Within one step a rank applies its ops in list order (fixed reduction order => identical bits on all
//    ranks), and no op reads a chunk that another rank writes during the same step.
#pragma once

#include <cstdint>

#include "core/macros.h"

namespace gpucoll::algo {

enum class Coll : int32_t {
  kAllReduce = 0,
  kBroadcast = 1,
  kReduce = 2,
  kAllGather = 3,
  kReduceScatter = 4,
  kAllToAll = 5,
  kGather = 6,
  kScatter = 7,
};
constexpr int kNumColls = 8;

enum class Action : uint8_t { kCopy = 0, kReduce = 1 };
enum class Space : uint8_t { kWork = 0, kOut = 1 };

// One data movement executed by a rank: dst_space[dst_chunk] (op)= work_of(peer)[src_chunk].
struct Op {
  int32_t peer;       // rank whose work buffer is read; may be the executing rank itself
  int32_t src_chunk;  // chunk index in that work buffer
  int32_t dst_chunk;  // chunk index in the destination
  Action action;
  Space dst;
};

// Parameters every generator receives. A schedule depends on nothing else, so all ranks derive the same
// plan from the same call without exchanging anything.
struct Params {
  Coll coll;
  int32_t nranks;
  int32_t root;        // rooted collectives; 0 otherwise
  int32_t local_size;  // ranks per node for hierarchical schedules (divides nranks); nranks when flat
};

// The shape of a schedule for given Params.
struct Shape {
  int32_t nchunks;  // the collective's full buffer is split into this many balanced chunks
  int32_t nsteps;
  int32_t max_ops;  // upper bound on ops per (rank, step)
  Space result;     // where the result is when the last step completes (see executor copy-out rules)
};

// Chunk c of n over `count` elements: [chunk_begin(c), chunk_begin(c+1)). Balanced: sizes differ by <= 1.
GPUCOLL_HD inline int64_t chunk_begin(int64_t count, int32_t nchunks, int32_t c) {
  return count / nchunks * c + (c < count % nchunks ? c : count % nchunks);
}

GPUCOLL_HD inline int32_t mod(int32_t a, int32_t n) {
  const int32_t r = a % n;
  return r < 0 ? r + n : r;
}

// floor(log2(x)) for x >= 1, and the largest power of two <= x.
GPUCOLL_HD inline int32_t ilog2(int32_t x) {
  int32_t l = 0;
  while ((x >> (l + 1)) != 0) ++l;
  return l;
}
GPUCOLL_HD inline int32_t pow2_floor(int32_t x) { return 1 << ilog2(x); }
GPUCOLL_HD inline int32_t ceil_log2(int32_t x) {
  int32_t l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

GPUCOLL_HD inline Op make_op(int32_t peer, int32_t src_chunk, int32_t dst_chunk, Action action,
                             Space dst = Space::kWork) {
  Op op;
  op.peer = peer;
  op.src_chunk = src_chunk;
  op.dst_chunk = dst_chunk;
  op.action = action;
  op.dst = dst;
  return op;
}

// Where each collective's data lives (executor rules; P = nranks, n = per-rank block, N = count):
//   all_reduce     full = N.    copy-in: x -> work.          copy-out: result space -> out.
//   broadcast      full = N.    copy-in: root's x -> work.   copy-out: work -> x on non-roots.
//   reduce         full = N.    copy-in: x -> work.          copy-out on root: result space -> out.
//   all_gather     full = P*n.  copy-in: x -> work[chunk r]. copy-out: result space -> out.
//   reduce_scatter full = P*n.  copy-in: x -> work.          copy-out: result space [chunk r] -> out.
//   all_to_all     full = P*n.  copy-in: x -> work.          copy-out: result space -> out.
//   gather         full = P*n.  copy-in: x -> work[chunk r]. copy-out on root: result space -> out.
//   scatter        full = P*n.  copy-in: root's x -> work.   copy-out: result space [chunk r] -> out.
// Blocked collectives (full = P*n) require nchunks == P so that chunk r is exactly rank r's block.
GPUCOLL_HD inline bool coll_is_blocked(Coll c) {
  return c == Coll::kAllGather || c == Coll::kReduceScatter || c == Coll::kAllToAll || c == Coll::kGather ||
         c == Coll::kScatter;
}
GPUCOLL_HD inline bool coll_is_rooted(Coll c) {
  return c == Coll::kBroadcast || c == Coll::kReduce || c == Coll::kGather || c == Coll::kScatter;
}
GPUCOLL_HD inline bool coll_reduces(Coll c) {
  return c == Coll::kAllReduce || c == Coll::kReduce || c == Coll::kReduceScatter;
}

}  // namespace gpucoll::algo
