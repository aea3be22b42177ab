// Launchers of the kernels a harness build leaves out (GPUCOLL_KERNELS in CMakeLists.txt): a check that needs one
// kernel (ThreadSanitizer with a weakened release) then recompiles one kernel file instead of four. They fail like
// a launcher without a kernel for the dtype, and the harness runs only the algorithms that were built.
#include "backends/custom/kernels/custom_allreduce.h"

namespace gpucoll::cuda::custom {

#define GPUCOLL_MISSING(name)                                                                                   \
  cudaError_t launch_##name(const AllReduceArgs&, cudaStream_t) { return cudaErrorNotSupported; }             \
  cudaError_t name##_blocks_per_sm(DType, RedOp, int* out) {                                                  \
    int device = 0;                                                                                            \
    cudaGetDevice(&device);                                                                                    \
    return cudaDeviceGetAttribute(out, cudaDevAttrMaxBlocksPerMultiprocessor, device);                         \
  }

#ifdef GPUCOLL_MISSING_ONE_SHOT
GPUCOLL_MISSING(one_shot)
#endif
#ifdef GPUCOLL_MISSING_TWO_SHOT
GPUCOLL_MISSING(two_shot)
#endif
#ifdef GPUCOLL_MISSING_RING
GPUCOLL_MISSING(ring)
#endif
#ifdef GPUCOLL_MISSING_TREE
GPUCOLL_MISSING(tree)
#endif

#undef GPUCOLL_MISSING

#ifdef GPUCOLL_MISSING_COMPRESSED
cudaError_t launch_compressed(const AllReduceArgs&, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t compressed_blocks_per_sm(DType, int* out) {
  int device = 0;
  cudaGetDevice(&device);
  return cudaDeviceGetAttribute(out, cudaDevAttrMaxBlocksPerMultiprocessor, device);
}
#endif

}  // namespace gpucoll::cuda::custom
