#include "backends/nccl_cuda/cuda_util.h"

#include <mutex>
#include <vector>

#include "core/error.h"

namespace gpucoll::cuda {

std::string describe(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + std::to_string(static_cast<int>(err)) +
         "): " + cudaGetErrorString(err);
}

void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  cudaGetLastError();
  throw Error(ErrorCode::kCuda, std::string(call) + " failed: " + describe(err), call, file, line);
}

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  GPUCOLL_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    GPUCOLL_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  // Restoring cannot reasonably fail (the device was current a moment ago); a destructor must not throw.
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

namespace {
std::mutex g_pool_mu;
std::vector<std::vector<cudaEvent_t>> g_pool;  // free events, per device
}  // namespace

cudaEvent_t event_get(int device) {
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    if (device >= 0 && static_cast<size_t>(device) < g_pool.size() && !g_pool[device].empty()) {
      cudaEvent_t e = g_pool[device].back();
      g_pool[device].pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  GPUCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void event_put(int device, cudaEvent_t event) noexcept {
  if (event == nullptr || device < 0) return;
  try {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    if (static_cast<size_t>(device) >= g_pool.size()) g_pool.resize(device + 1);
    g_pool[device].push_back(event);
  } catch (...) {
    // Out of memory growing the free list: dropping the event only leaks it.
  }
}

bool stream_is_capturing(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

RelaxedCaptureMode::RelaxedCaptureMode() noexcept : previous_(cudaStreamCaptureModeRelaxed) {
  ok_ = cudaThreadExchangeStreamCaptureMode(&previous_) == cudaSuccess;
  if (!ok_) cudaGetLastError();
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (ok_ && cudaThreadExchangeStreamCaptureMode(&previous_) != cudaSuccess) cudaGetLastError();
}

PointerInfo pointer_info(const void* ptr) {
  cudaPointerAttributes attr{};
  GPUCOLL_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  PointerInfo info;
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      info.device_memory = true;
      info.device = attr.device;
      info.kind = "device";
      break;
    case cudaMemoryTypeManaged:
      info.device_memory = true;
      info.device = attr.device;
      info.kind = "managed";
      break;
    case cudaMemoryTypeHost:
      info.device = attr.device;
      info.kind = "host (pinned)";
      break;
    case cudaMemoryTypeUnregistered:
      info.kind = "unregistered host";
      break;
  }
  return info;
}

}  // namespace gpucoll::cuda
