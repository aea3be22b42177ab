// Error names and strings (CUDA's own, so messages read the same on the emulator and on a GPU), the per-thread
// last error, and the driver API's names for the few CUresult values the emulated driver entry points return.
#include <atomic>
#include <cstddef>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

struct ErrorText {
  int code;
  const char* name;
  const char* text;
};

// The codes of cuda_runtime_api.h, with the name and string NVIDIA's runtime (13.0) gives each.
constexpr ErrorText kRuntimeErrors[] = {
    {0, "cudaSuccess", "no error"},
    {1, "cudaErrorInvalidValue", "invalid argument"},
    {2, "cudaErrorMemoryAllocation", "out of memory"},
    {3, "cudaErrorInitializationError", "initialization error"},
    {4, "cudaErrorCudartUnloading", "driver shutting down"},
    {9, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {17, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {21, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {35, "cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"},
    {98, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {100, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {101, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {201, "cudaErrorDeviceUninitialized", "invalid device context"},
    {205, "cudaErrorMapBufferObjectFailed", "mapping of buffer object failed"},
    {217, "cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices"},
    {304, "cudaErrorOperatingSystem", "OS call failed or operation not supported on this OS"},
    {400, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {401, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
    {500, "cudaErrorSymbolNotFound", "named symbol not found"},
    {600, "cudaErrorNotReady", "device not ready"},
    {700, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {701, "cudaErrorLaunchOutOfResources", "too many resources requested for launch"},
    {716, "cudaErrorMisalignedAddress", "misaligned address"},
    {719, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {800, "cudaErrorNotPermitted", "operation not permitted"},
    {801, "cudaErrorNotSupported", "operation not supported"},
    {900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
    {901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"},
    {902, "cudaErrorStreamCaptureMerge", "operation would result in a merge of separate capture sequences"},
    {903, "cudaErrorStreamCaptureUnmatched", "capture was not ended in the same stream as it began"},
    {904, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"},
    {905, "cudaErrorStreamCaptureIsolation", "dependency created on uncaptured work in another stream"},
    {906, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {999, "cudaErrorUnknown", "unknown error"},
};

// CUresult values of the emulated driver entry points (cuda.h's numbering).
constexpr ErrorText kDriverErrors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
};

template <size_t N>
const ErrorText* find(const ErrorText (&table)[N], int code) {
  for (const ErrorText& e : table) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

thread_local cudaError_t t_last_error = cudaSuccess;
std::atomic<int> g_sticky{cudaSuccess};

}  // namespace

cudaError_t sticky() { return static_cast<cudaError_t>(g_sticky.load(std::memory_order_acquire)); }

bool set_sticky(cudaError_t e) {
  int none = cudaSuccess;
  return g_sticky.compare_exchange_strong(none, e, std::memory_order_acq_rel);
}

cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* e = find(kRuntimeErrors, static_cast<int>(error));
  return e != nullptr ? e->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* e = find(kRuntimeErrors, static_cast<int>(error));
  return e != nullptr ? e->text : "unrecognized error code";
}

// A sticky error is every thread's last error for good: CUDA cannot clear a context fault either.
cudaError_t cudaGetLastError(void) {
  if (const cudaError_t s = sticky()) return s;
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  if (const cudaError_t s = sticky()) return s;
  return t_last_error;
}

int cuGetErrorName(int error, const char** name) {
  const ErrorText* e = find(kDriverErrors, error);
  if (name == nullptr || e == nullptr) return 1;
  *name = e->name;
  return 0;
}

int cuGetErrorString(int error, const char** text) {
  const ErrorText* e = find(kDriverErrors, error);
  if (text == nullptr || e == nullptr) return 1;
  *text = e->text;
  return 0;
}

}  // extern "C"
