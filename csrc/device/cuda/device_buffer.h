// Device memory that Python owns without torch or CuPy (gpucoll.testing.DeviceArray: tests, and the benchmark on
// machines without a CUDA framework, such as the emulated device), and the copies in and out of it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace gpucoll::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, int device);  // cudaMalloc on `device`; contents undefined
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(ptr_); }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  // cudaFree (which waits for the device's work); idempotent, never throws.
  void release() noexcept;

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  int device_;
};

// Copies of `n` bytes, complete on return: a cudaMemcpy followed by a synchronisation of the legacy stream, since a
// cudaMemcpy from pageable host memory may return before the data reached the device, and work on non-blocking
// streams is not ordered after it. kind: cudaMemcpyDefault (the pointers say the direction).
void copy_sync(void* dst, const void* src, size_t n, int device);
// cudaMemset of `n` bytes to `byte`, complete on return.
void fill_sync(void* dst, int byte, size_t n, int device);
// cudaMemcpyAsync on `stream`: ordered with the work of that stream (the benchmark's uploads on a rank's stream).
void copy_async(void* dst, const void* src, size_t n, cudaStream_t stream, int device);

}  // namespace gpucoll::cuda
