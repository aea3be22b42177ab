#include <cuda_runtime_api.h>

#include <cstdlib>

#include "device/cuda/cuda_runtime_info.h"

namespace gpucoll::cuda {

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

int device_count(std::string* why) {
  // Initialised because a failing cudaGetDeviceCount (no driver: cudaErrorInsufficientDriver) leaves the
  // output untouched.
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // Not sticky, but it would otherwise surface from the next cudaGetLastError() of an unrelated caller.
    cudaGetLastError();
    if (why != nullptr) {
      *why = std::string(cudaGetErrorName(err)) + " (" + std::to_string(static_cast<int>(err)) +
             "): " + cudaGetErrorString(err);
    }
    return 0;
  }
  if (n == 0 && why != nullptr) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    *why = "the CUDA runtime sees no device";
    if (visible != nullptr) *why += std::string(" (CUDA_VISIBLE_DEVICES='") + visible + "')";
  }
  return n;
}

}  // namespace gpucoll::cuda
