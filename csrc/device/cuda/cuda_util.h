// Small CUDA runtime helpers for the NCCL communicator: checked calls that throw CudaError naming the call,
// a device guard, a process-wide pool of completion events, pointer and capture queries.
//
// This directory is compiled only in CUDA builds (CMake adds it to gpucoll_cuda, which links cudart
// statically); callers outside it guard with GPUCOLL_WITH_CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace gpucoll::cuda {

// "cudaErrorInvalidValue (1): invalid argument"
std::string describe(cudaError_t err);

// Clears the runtime's last-error slot (so the failure does not resurface from an unrelated
// cudaGetLastError, e.g. torch's after its next kernel) and throws Error(kCuda) naming `call`.
[[noreturn]] void throw_cuda(cudaError_t err, const char* call, const char* file, int line);

#define GPUCOLL_CUDA_CHECK(expr)                                        \
  do {                                                                  \
    const cudaError_t gpucoll_err_ = (expr);                            \
    if (gpucoll_err_ != cudaSuccess) {                                  \
      ::gpucoll::cuda::throw_cuda(gpucoll_err_, #expr, __FILE__, __LINE__); \
    }                                                                   \
  } while (0)

// Makes `device` current for the scope and restores the previous device. cudaGetDevice is a thread-local
// read, so a guard costs nothing when the device is already current (the usual case: one GPU per rank).
//
// The previous device is restored only when its primary context already exists (torch's MaybeSetDevice rule).
// A thread that never chose a device reads 0 from cudaGetDevice, and since CUDA 12 cudaSetDevice(0) creates
// device 0's context: restoring blindly would put a context (about 500 MB) on GPU 0 in every rank of a node,
// from the user's thread and from every watchdog poll. Left unrestored, the thread simply stays on `device`.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// cudaFree(ptr) with `device` current, the previous device restored; errors cleared and dropped (teardown paths
// never throw). A null ptr does nothing.
void free_on_device(void* ptr, int device) noexcept;

// Timing-free events, recycled: creating and destroying one per collective would cost about as much as
// the NCCL launch itself. event_get needs `device` current; events are never destroyed (a few hundred bytes
// of driver state each, and destroying them at exit races the runtime's own teardown).
cudaEvent_t event_get(int device);
void event_put(int device, cudaEvent_t event) noexcept;

// Whether `stream` is being captured into a CUDA graph. A query error (for example the legacy stream while
// another stream is captured in global mode) counts as capturing: the caller then skips every eager event
// operation, and NCCL itself reports the illegal use.
bool stream_is_capturing(cudaStream_t stream) noexcept;

// Switches the calling thread to relaxed capture mode for the scope: a watchdog thread must be able to query
// events while some other thread captures a graph in global mode (which would otherwise forbid the query
// and invalidate that capture).
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept;
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode previous_;
  bool ok_ = false;
};

// Whether `device`'s primary context exists in this process (cuDevicePrimaryCtxGetState, resolved from the
// driver the runtime loaded; never creates a context). True when the driver cannot be asked: then a guard
// restores as before.
bool primary_context_active(int device) noexcept;

// Makes `consumer` wait (on the GPU) for the work queued so far on `producer`, both on `device`: the consumer
// side of __cuda_array_interface__'s "stream" and of DLPack's stream handshake. Does nothing when the two are
// the same or either is being captured: an eager event cannot join a capture, and inside one the capture's own
// order already covers the producer (the legacy stream must not even be touched while a global capture runs).
void stream_wait_stream(cudaStream_t consumer, cudaStream_t producer, int device);

struct PointerInfo {
  bool device_memory = false;  // device or managed memory: usable by NCCL kernels
  int device = -1;             // owning device, -1 when unknown (host memory)
  std::string kind;            // "device", "managed", "host (pinned)", "unregistered host"
};
// What `ptr` points to (cudaPointerGetAttributes). Throws CudaError when the query itself fails.
PointerInfo pointer_info(const void* ptr);

}  // namespace gpucoll::cuda
