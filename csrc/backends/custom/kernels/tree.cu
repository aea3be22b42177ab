// Double binary tree allreduce over peer memory: algo/double_binary_tree.h's schedule (two trees, each rank
// inner in one and a leaf in the other; each tree reduces one half of the message to its root and broadcasts
// it back, 2*log2(P) steps), run by the executor of schedule_exec.cuh. The children of a node are reduced in
// one pass (float accumulation for half types), in the schedule's child order.
#include "algo/double_binary_tree.h"
#include "backends/custom/kernels/schedule_exec.cuh"

namespace gpucoll::cuda::custom {
namespace {

template <class T, class Op, class Fin>
__global__ void __launch_bounds__(kThreads) tree_kernel(AllReduceArgs a, Op op, Fin fin) {
  run_schedule<algo::DoubleBinaryTree, T>(a, op, fin);
}

struct TreeKernel {
  template <class T, class Op, class Fin>
  static auto kernel() {
    return &tree_kernel<T, Op, Fin>;
  }
};

}  // namespace

cudaError_t launch_tree(const AllReduceArgs& a, cudaStream_t stream) {
  return launch_schedule<algo::DoubleBinaryTree, TreeKernel>(a, stream);
}

cudaError_t tree_blocks_per_sm(DType dtype, RedOp op, int* out) {
  return kernel_blocks_per_sm<TreeKernel>(dtype, op, out);
}

}  // namespace gpucoll::cuda::custom
