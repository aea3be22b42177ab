// A GPU executor for the pull schedules of csrc/algo/: the kernel calls the schedule's own step_ops (the
// generators are GPUCOLL_HD, no STL) for its rank and step, so the ring and the double binary tree run on the
// GPU exactly as the host backend runs them and as the CPU tests check them. One schedule, several executors.
//
// Per block b (slice b of every chunk, see peer_ops.cuh):
//   copy-in        slice b of every chunk of `in` -> this rank's staging half (the schedule's work buffer),
//                  applying avg's pre-op (floating types: times 1/n) as the host backend's copy-in does.
//   barrier 0      every rank made this same call (open_call), and staged its input
//   step t         the rank's ops for step t, in list order. Consecutive ops that write the same chunk of the
//                  same space from the same chunk index form one group and are applied in one pass: a group
//                  that starts with a copy computes dst = src_0 op src_1 ..., one that starts with a reduce
//                  dst = dst op src_0 op ...; half types accumulate in float and round once per group.
//   barrier t+1    between steps: the ordering contract of algo/schedule.h (RAW: step t+1 reads what peers
//                  wrote in step t; WAR: nobody overwrites a chunk a peer still reads). Not after the last step:
//                  copy-out reads only this rank's own buffer, and the half is next written two calls later
//                  (see staging() in peer_ops.cuh).
//   __syncthreads  the block's own writes of the last step, before other threads of it copy them out.
//   copy-out       result space (work) -> out, applying avg's finish once per element (integer types: / n).
// Pipelining: blocks are independent (block b waits only for block b of its peers), so a fast block runs
// ahead into later steps of its slice while a slow one finishes earlier steps: the slices are the pieces.
//
// Every op must read and write the same chunk index (true of every all_reduce schedule here): a block's
// slice of the source chunk is then exactly the slice it writes. The launcher checks it (schedule_ok).
#pragma once

#include "algo/schedule.h"
#include "backends/custom/kernels/custom_dispatch.cuh"
#include "backends/custom/kernels/peer_ops.cuh"
#include "backends/custom/kernels/peer_sync.cuh"

namespace gpucoll::cuda::custom {

// Ops of one rank in one step: a group's sources (Srcs, kMaxRanks + 1 entries) are these plus `dst` itself.
constexpr int kMaxStepOps = kMaxRanks;

GPUCOLL_HD inline algo::Params allreduce_params(int nranks) {
  algo::Params p;
  p.coll = algo::Coll::kAllReduce;
  p.nranks = nranks;
  p.root = 0;
  p.local_size = nranks;
  return p;
}

template <class Sched, class T, class Op, class Fin>
__device__ __forceinline__ void run_schedule(const AllReduceArgs& a, Op op, Fin fin) {
  const Sync s = begin_call(a);
  if (s.skip) return;
  const algo::Params p = allreduce_params(a.nranks);
  const algo::Shape sh = Sched::shape(p);
  stage_input<T>(a, s.calls, sh.nchunks, fin);
  if (!open_call(s, a)) {  // ranks made different calls: nothing was touched (peer_sync.cuh)
    end_call(s);
    return;
  }
  T* work = static_cast<T*>(staging(a, a.rank, s.calls));
  for (int32_t step = 0; step < sh.nsteps; ++step) {
    algo::Op ops[kMaxStepOps];
    const int n = Sched::step_ops(p, a.rank, step, ops);
    const bool last = step + 1 == sh.nsteps;
    for (int i = 0; i < n;) {
      const algo::Op& head = ops[i];
      int j = i + 1;
      while (j < n && ops[j].action == algo::Action::kReduce && ops[j].dst == head.dst &&
             ops[j].dst_chunk == head.dst_chunk && ops[j].src_chunk == head.src_chunk) {
        ++j;
      }
      const Range r = block_slice<T>(chunk_range(a.count, sh.nchunks, head.dst_chunk));
      T* dst = (head.dst == algo::Space::kWork ? work : static_cast<T*>(a.out)) + r.begin;
      Srcs<T> src;
      src.n = 0;
      if (head.action == algo::Action::kReduce) src.p[src.n++] = dst;
      for (int k = i; k < j; ++k) src.p[src.n++] = static_cast<const T*>(staging(a, ops[k].peer, s.calls)) + r.begin;
      if (head.dst == algo::Space::kOut && last) {
        block_reduce(dst, src, r.count, op, FinishOnly<Fin>{fin});
      } else {
        block_reduce(dst, src, r.count, op, NoFinish{});
      }
      i = j;
    }
    if (!last) barrier(s, static_cast<uint32_t>(step + 1));
  }
  if (sh.result == algo::Space::kWork) {
    // The copy-out reads work elements that other threads of this block wrote in the last step: which thread
    // moves which element follows the pointers' alignment (pack_split), and `out` may sit at another offset
    // within 16 bytes than the staging buffer (a misaligned user buffer: all scalar), so the last step's writer
    // of an element is not its reader here. (Found by the emulated device: P=2 ring, out 4 bytes off.)
    __syncthreads();
    for (int c = 0; c < sh.nchunks; ++c) {
      const Range r = block_slice<T>(chunk_range(a.count, sh.nchunks, c));
      block_copy(static_cast<T*>(a.out) + r.begin, work + r.begin, r.count, FinishOnly<Fin>{fin});
    }
  }
  end_call(s);
}

// Host check of what run_schedule assumes: at most kMaxStepOps ops per step, src chunk == dst chunk, and
// no more barriers than a call's epoch range holds.
template <class Sched>
bool schedule_ok(int nranks) {
  const algo::Params p = allreduce_params(nranks);
  const algo::Shape sh = Sched::shape(p);
  if (sh.max_ops > kMaxStepOps || sh.nsteps + 1 > static_cast<int32_t>(kBarrierStride)) return false;
  for (int r = 0; r < nranks; ++r) {
    for (int32_t t = 0; t < sh.nsteps; ++t) {
      algo::Op ops[kMaxStepOps];
      const int n = Sched::step_ops(p, r, t, ops);
      for (int i = 0; i < n; ++i) {
        if (ops[i].src_chunk != ops[i].dst_chunk) return false;
      }
    }
  }
  return true;
}

// The launch of a schedule kernel: it always stages (the schedules write their work buffer in place).
template <class Sched, class K>
cudaError_t launch_schedule(const AllReduceArgs& a, cudaStream_t stream) {
  if (a.nranks < 1 || a.nranks > kMaxRanks || !schedule_ok<Sched>(a.nranks)) return cudaErrorInvalidValue;
  return launch_kernel<K>(a, true, stream);
}

}  // namespace gpucoll::cuda::custom
