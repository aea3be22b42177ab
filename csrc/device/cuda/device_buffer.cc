#include "device/cuda/device_buffer.h"

#include "device/cuda/cuda_util.h"
#include "core/error.h"

namespace gpucoll::cuda {

DeviceBuffer::DeviceBuffer(size_t bytes, int device) : bytes_(bytes), device_(device) {
  DeviceGuard guard(device);
  if (bytes > 0) GPUCOLL_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

void DeviceBuffer::release() noexcept {
  free_on_device(ptr_, device_);
  ptr_ = nullptr;
}

void copy_sync(void* dst, const void* src, size_t n, int device) {
  if (n == 0) return;
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaMemcpy(dst, src, n, cudaMemcpyDefault));
  GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void fill_sync(void* dst, int byte, size_t n, int device) {
  if (n == 0) return;
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaMemset(dst, byte, n));
  GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void copy_async(void* dst, const void* src, size_t n, cudaStream_t stream, int device) {
  if (n == 0) return;
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
}

}  // namespace gpucoll::cuda
