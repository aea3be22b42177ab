// One-shot: all_reduce in ONE step. Every rank reads every rank's whole buffer and reduces it into its own
// private output, in the fixed rank order 0, 1, ..., P-1 (a copy from rank 0, then reduces from 1..P-1).
//
// nchunks = 1, result in `out`. Because every rank applies the same ops to the same inputs in the same order,
// every rank computes identical bits without any rank broadcasting its result - the property the
// "custom allreduce" kernels of vLLM/TensorRT-LLM rely on for small messages.
//
// No same-step read/write race: the step reads only work buffers (the inputs, written by copy-in in the
// previous step) and writes only the executing rank's private output, which no peer can read.
//
// Cost in the a + b*l model: one step, i.e. one synchronisation instead of the ring's 2(P-1); but each rank
// pulls (P-1)*N bytes instead of the ring's 2(P-1)/P*N, and does P-1 reductions of N elements. Where a step's
// reads run concurrently (shared memory, NVSwitch) that is about a + b*(P-1)*N: the best choice while a
// dominates, i.e. for small messages. In the seed notes' one-message-at-a-time model the reads serialise into
// (P-1)(a + b*N): half the ring's latency terms but P/2 times its bandwidth term, so it wins there only while
// b*N*(1 - 2/P) < a. One-shot is an algorithm for all-to-all fabrics.
//
// all_gather, broadcast and reduce have the same "read what you need from everyone at once" shape; they are
// the direct schedules (direct.h) and are offered under this name too, so `oneshot` can serve a whole
// latency-bound workload.
#pragma once

#include "algo/direct.h"
#include "algo/schedule.h"

namespace gpucoll::algo {

struct OneShot {
  static constexpr const char* kName = "oneshot";
  static constexpr const char* kSummary =
      "one step: every rank reads all P buffers and reduces in rank order; latency-optimal, (P-1)N per rank";

  GPUCOLL_HD static bool supports(Coll c) {
    return c == Coll::kAllReduce || c == Coll::kAllGather || c == Coll::kBroadcast || c == Coll::kReduce;
  }

  GPUCOLL_HD static Shape shape(const Params& p) {
    if (p.coll != Coll::kAllReduce) return Direct::shape(p);
    Shape s;
    s.nsteps = 1;
    s.nchunks = 1;
    s.max_ops = p.nranks;
    s.result = Space::kOut;
    return s;
  }

  GPUCOLL_HD static int step_ops(const Params& p, int32_t rank, int32_t step, Op* out) {
    if (p.coll != Coll::kAllReduce) return Direct::step_ops(p, rank, step, out);
    if (step != 0) return 0;
    return direct::reduce_in_rank_order(p.nranks, 0, Space::kOut, out);
  }

  GPUCOLL_HD static const char* unusable(const Params&) { return nullptr; }
};

}  // namespace gpucoll::algo
