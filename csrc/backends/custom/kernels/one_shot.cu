// One-shot allreduce over peer memory (the schedule of algo/one_shot.h): every rank reads every rank's input
// and reduces it, in rank order 0..P-1, straight into its own output. One data step: the choice for small
// messages, whose cost is the synchronisation.
//
// Per block b (slice b of the message, see peer_ops.cuh):
//   staged input:     copy slice b of `in` into this rank's staging half; registered input: nothing.
//   barrier 0         every rank's slice b is readable (RAW), and every rank made this same call (open_call:
//                     on a mismatch every block stops here, before touching peer data or `out`).
//   reduce            out[slice b] = fin(pre(x_0) op ... op pre(x_{P-1})), accumulating in float for f16/bf16
//                     (avg: pre multiplies floating inputs by 1/n, fin divides integer sums; primitives.cuh).
//   barrier 1         every rank has finished reading slice b of our input (WAR). A registered input is the
//                     user's own buffer, which the user may overwrite as soon as this kernel completes; the
//                     staged path runs the same barrier so both paths take the same number of barriers
//                     (ranks that disagreed about registration then read wrong data instead of deadlocking).
// Registered input and `out` overlapping it (in place): writing out[slice b] before barrier 1 would overwrite
// our input while peers' block b may still be reading it (their reduce can start after ours). So such a rank
// reduces into its own staging half (which nobody reads in a registered call) and copies to `out` after
// barrier 1. The decision is this rank's alone: peers' kernels are the same either way.
// Every rank reduces the same P values in the same order, so all ranks get identical bits.
#include "backends/custom/kernels/custom_dispatch.cuh"
#include "backends/custom/kernels/peer_ops.cuh"
#include "backends/custom/kernels/peer_sync.cuh"

namespace gpucoll::cuda::custom {
namespace {

template <class T, class Op, class Fin>
__global__ void __launch_bounds__(kThreads) one_shot_kernel(AllReduceArgs a, Op op, Fin fin) {
  const Sync s = begin_call(a);
  if (s.skip) return;
  const bool staged = a.inputs == nullptr;
  const Range r = block_slice<T>(Range{0, a.count});
  if (staged) block_copy(at<T>(staging(a, a.rank, s.calls), r.begin), at<T>(a.in, r.begin), r.count, NoFinish{});
  if (!open_call(s, a)) {  // ranks made different calls: nothing was touched (peer_sync.cuh)
    end_call(s);
    return;
  }
  Srcs<T> src;
  src.n = a.nranks;
  for (int q = 0; q < a.nranks; ++q) {
    src.p[q] = staged ? at<T>(staging(a, q, s.calls), r.begin)
                      : at<T>(static_cast<const void*>(a.inputs->ptr[q]), a.in_offset + r.begin);
  }
  const uintptr_t in_b = reinterpret_cast<uintptr_t>(a.in), out_b = reinterpret_cast<uintptr_t>(a.out);
  const size_t bytes = a.count * sizeof(T);
  const bool hold = !staged && out_b < in_b + bytes && in_b < out_b + bytes;
  T* dst = hold ? at<T>(staging(a, a.rank, s.calls), r.begin) : at<T>(a.out, r.begin);
  block_reduce(dst, src, r.count, op, fin);
  barrier(s, 1);
  if (hold) block_copy(at<T>(a.out, r.begin), static_cast<const T*>(dst), r.count, NoFinish{});
  end_call(s);
}

struct OneShotKernel {
  template <class T, class Op, class Fin>
  static auto kernel() {
    return &one_shot_kernel<T, Op, Fin>;
  }
};

}  // namespace

// Staging must hold the call even with a registered input: an in-place rank holds its result there.
cudaError_t launch_one_shot(const AllReduceArgs& a, cudaStream_t stream) {
  return launch_kernel<OneShotKernel>(a, true, stream);
}

cudaError_t one_shot_blocks_per_sm(DType dtype, RedOp op, int* out) {
  return kernel_blocks_per_sm<OneShotKernel>(dtype, op, out);
}

}  // namespace gpucoll::cuda::custom
