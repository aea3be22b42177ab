#include "device/cuda/cuda_util.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "device/cuda_probe.h"
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

namespace {
// cuda.h's CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active); CUdevice is
// an int ordinal. Declared here so that this file needs no driver header or -lcuda.
using PFN_cuDevicePrimaryCtxGetState = int (*)(int, unsigned int*, int*);

PFN_cuDevicePrimaryCtxGetState primary_ctx_state_fn() {
  // RTLD_NOLOAD: the driver the CUDA runtime already opened; nothing to open when there is none.
  static const PFN_cuDevicePrimaryCtxGetState fn = []() -> PFN_cuDevicePrimaryCtxGetState {
    void* handle = dlopen(cuda_driver_library(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle == nullptr) return nullptr;
    return reinterpret_cast<PFN_cuDevicePrimaryCtxGetState>(dlsym(handle, "cuDevicePrimaryCtxGetState"));
  }();
  return fn;
}
}  // namespace

bool primary_context_active(int device) noexcept {
  const PFN_cuDevicePrimaryCtxGetState fn = primary_ctx_state_fn();
  if (fn == nullptr) return true;
  unsigned int flags = 0;
  int active = 0;
  if (fn(device, &flags, &active) != 0) return true;
  return active != 0;
}

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  GPUCOLL_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    // Decided before the switch: afterwards only `device`'s context is known to exist.
    const bool restore = primary_context_active(current);
    GPUCOLL_CUDA_CHECK(cudaSetDevice(device));
    if (restore) previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  // Restoring cannot reasonably fail (the device was current a moment ago); a destructor must not throw.
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

void free_on_device(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device) cudaSetDevice(device);
  if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
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

void stream_wait_stream(cudaStream_t consumer, cudaStream_t producer, int device) {
  if (consumer == producer || stream_is_capturing(consumer) || stream_is_capturing(producer)) return;
  DeviceGuard guard(device);
  // The wait takes the event's state at call time, so the event goes back to the pool at once.
  cudaEvent_t e = event_get(device);
  cudaError_t err = cudaEventRecord(e, producer);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(consumer, e, 0);
  event_put(device, e);
  if (err != cudaSuccess) {
    throw_cuda(err, "cudaEventRecord + cudaStreamWaitEvent (consumer after producer)", __FILE__, __LINE__);
  }
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
