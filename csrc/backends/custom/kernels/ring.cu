// Ring allreduce over peer memory: algo/ring.h's schedule (P-1 reduce-scatter steps, then P-1 all-gather
// steps; rank r pulls one chunk per step from rank r-1), run by the executor of schedule_exec.cuh. Never
// chosen automatically on an all-to-all fabric (two-shot moves the same bytes with 2 barriers instead of
// 2(P-1)); it is here so the ring schedule runs, and is tested, on the GPU.
#include "algo/ring.h"
#include "backends/custom/kernels/schedule_exec.cuh"

namespace gpucoll::cuda::custom {
namespace {

template <class T, class Op, class Fin>
__global__ void __launch_bounds__(kThreads) ring_kernel(AllReduceArgs a, Op op, Fin fin) {
  run_schedule<algo::Ring, T>(a, op, fin);
}

struct RingKernel {
  template <class T, class Op, class Fin>
  static auto kernel() {
    return &ring_kernel<T, Op, Fin>;
  }
};

}  // namespace

cudaError_t launch_ring(const AllReduceArgs& a, cudaStream_t stream) {
  return launch_schedule<algo::Ring, RingKernel>(a, stream);
}

cudaError_t ring_blocks_per_sm(DType dtype, RedOp op, int* out) {
  return kernel_blocks_per_sm<RingKernel>(dtype, op, out);
}

}  // namespace gpucoll::cuda::custom
