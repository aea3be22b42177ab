// %globaltimer read by one device thread, for the flight recorder of the custom kernels: their CallRecords hold
// device times, and the host brackets this kernel with its own clock to place them on its timeline
// (backends/custom/cuda/kernel_trace.cc). One launch per communicator, at connect.
#include "backends/custom/kernels/custom_allreduce.h"
#include "backends/custom/kernels/sync_primitives.cuh"

namespace gpucoll::cuda::custom {
namespace {

__global__ void read_global_timer_kernel(uint64_t* out) { st_relaxed_sys(out, global_timer_ns()); }

}  // namespace

cudaError_t launch_read_global_timer(uint64_t* out, cudaStream_t stream) {
  if (out == nullptr) return cudaErrorInvalidValue;
  void* params[] = {&out};
  return cudaLaunchKernel(&read_global_timer_kernel, dim3(1), dim3(1), params, 0, stream);
}

}  // namespace gpucoll::cuda::custom
