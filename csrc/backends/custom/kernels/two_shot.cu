// Two-shot allreduce over peer memory (the schedule of algo/two_shot.h): reduce-scatter then all-gather, each
// one step of direct reads. Rank r owns chunk r of the P balanced chunks of algo/schedule.h's chunk_begin.
// Each rank moves 2(P-1)/P of the message, the ring's volume, with two synchronisations: the mid and large
// message choice on an all-to-all fabric.
//
// Per block b (slice b of every chunk, see peer_ops.cuh):
//   staged input:  copy slice b of every chunk of `in` into this rank's staging half.
//   barrier 0      every rank's input slices are readable (RAW), and every rank made this same call (open_call).
//   reduce         staging[chunk r, slice b] = fin(pre(x_0) op ... op pre(x_{P-1})) over every rank's chunk r
//                  (their staging half, or their registered input). Rank order 0..P-1 with float accumulation: the
//                  schedule's order (own input first) exists only because the host executor accumulates in
//                  place; here the sum lives in registers. avg happens here, once, in the chunk's owner: pre
//                  multiplies each floating input by 1/n, fin divides an integer sum by n.
//                  Peers read only chunks q != r of this rank's staging half in this step, so writing chunk r
//                  in place races nobody.
//   barrier 1      every owner's reduced chunk is readable (RAW), and every rank finished reading our input
//                  (WAR: a registered input may be reused once the kernel completes).
//   all-gather     out[chunk q, slice b] = staging of rank q [chunk q, slice b], for every q.
// No end barrier: peers may still be reading our staging half when we return, but the next call uses the
// other half, and the call after that starts writing this half only after its predecessor's barrier 0, which
// every peer reaches only after finishing this call.
#include "backends/custom/kernels/custom_dispatch.cuh"
#include "backends/custom/kernels/peer_ops.cuh"
#include "backends/custom/kernels/peer_sync.cuh"

namespace gpucoll::cuda::custom {
namespace {

template <class T, class Op, class Fin>
__global__ void __launch_bounds__(kThreads) two_shot_kernel(AllReduceArgs a, Op op, Fin fin) {
  const Sync s = begin_call(a);
  if (s.skip) return;
  const int P = a.nranks;
  const bool staged = a.inputs == nullptr;
  if (staged) stage_input<T>(a, s.calls, P);
  if (!open_call(s, a)) {  // ranks made different calls: nothing was touched (peer_sync.cuh)
    end_call(s);
    return;
  }
  const Range mine = block_slice<T>(chunk_range(a.count, P, a.rank));
  Srcs<T> src;
  src.n = P;
  for (int q = 0; q < P; ++q) {
    src.p[q] = staged ? at<T>(staging(a, q, s.calls), mine.begin)
                      : at<T>(static_cast<const void*>(a.inputs->ptr[q]), a.in_offset + mine.begin);
  }
  block_reduce(at<T>(staging(a, a.rank, s.calls), mine.begin), src, mine.count, op, fin);
  barrier(s, 1);
  for (int i = 0; i < P; ++i) {
    // Start at the next rank so the P ranks' blocks pull from different peers at once instead of all from rank 0.
    const int q = (a.rank + 1 + i) % P;
    const Range c = block_slice<T>(chunk_range(a.count, P, q));
    block_copy(at<T>(a.out, c.begin), at<T>(staging(a, q, s.calls), c.begin), c.count, NoFinish{});
  }
  end_call(s);
}

struct TwoShotKernel {
  template <class T, class Op, class Fin>
  static auto kernel() {
    return &two_shot_kernel<T, Op, Fin>;
  }
};

}  // namespace

// The reduced chunks always go through the staging half, registered input or not.
cudaError_t launch_two_shot(const AllReduceArgs& a, cudaStream_t stream) {
  return launch_kernel<TwoShotKernel>(a, true, stream);
}

cudaError_t two_shot_blocks_per_sm(DType dtype, RedOp op, int* out) {
  return kernel_blocks_per_sm<TwoShotKernel>(dtype, op, out);
}

}  // namespace gpucoll::cuda::custom
