// gpucoll's emulated CUDA device: the CUDA runtime API that gpucoll's sources call, declared for the emulator
// (libgpucoll_cudaemu.so) instead of NVIDIA's runtime. First on the include path only in GPUCOLL_CUDA=emulate
// builds; see csrc/emulation/README.md for what each function does there and where it is stricter or looser than
// CUDA.
//
// Every enumerator, error code and flag has the value NVIDIA's headers give it (CUDA 13): codes and names appear
// in gpucoll's error messages, and a test written against the emulator must read the same on a GPU. Only what
// gpucoll uses (and a few neighbours a caller would expect) is declared; anything else does not compile, which is
// the point: a new CUDA call in gpucoll needs an emulated twin before the emulated tests can cover it.
#pragma once

#include <stddef.h>

#include "vector_types.h"

#if defined(__GNUC__)
#define GPUCOLL_EMU_API __attribute__((visibility("default")))
#else
#define GPUCOLL_EMU_API
#endif

#define CUDART_VERSION 13000
#define CUDA_IPC_HANDLE_SIZE 64

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorCudartUnloading = 4,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInsufficientDriver = 35,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorDeviceUninitialized = 201,
  cudaErrorMapBufferObjectFailed = 205,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorOperatingSystem = 304,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorSymbolNotFound = 500,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotPermitted = 800,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureMerge = 902,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorCapturedEvent = 907,
  cudaErrorStreamCaptureWrongThread = 908,
  cudaErrorUnknown = 999
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3
};

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};

enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2,
  cudaDevAttrMaxBlockDimY = 3,
  cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrIntegrated = 18,
  cudaDevAttrConcurrentKernels = 31,
  cudaDevAttrPciBusId = 33,
  cudaDevAttrPciDeviceId = 34,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrUnifiedAddressing = 41,
  cudaDevAttrPciDomainId = 50,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxBlocksPerMultiprocessor = 106
};

enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2
};

enum cudaGetDriverEntryPointFlags { cudaEnableDefault = 0x0, cudaEnableLegacyStream = 0x1, cudaEnablePerThreadDefaultStream = 0x2 };

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
typedef void (*cudaHostFn_t)(void* userData);

typedef struct cudaIpcMemHandle_st {
  char reserved[CUDA_IPC_HANDLE_SIZE];
} cudaIpcMemHandle_t;

struct cudaPointerAttributes {
  enum cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaEventInterprocess 0x04
#define cudaIpcMemLazyEnablePeerAccess 0x01

#ifdef __cplusplus
extern "C" {
#define GPUCOLL_EMU_DEFAULT(v) = v
#else
#define GPUCOLL_EMU_DEFAULT(v)
#endif

// Errors and versions.
GPUCOLL_EMU_API const char* cudaGetErrorName(cudaError_t error);
GPUCOLL_EMU_API const char* cudaGetErrorString(cudaError_t error);
GPUCOLL_EMU_API cudaError_t cudaGetLastError(void);
GPUCOLL_EMU_API cudaError_t cudaPeekAtLastError(void);
GPUCOLL_EMU_API cudaError_t cudaRuntimeGetVersion(int* runtimeVersion);
GPUCOLL_EMU_API cudaError_t cudaDriverGetVersion(int* driverVersion);
GPUCOLL_EMU_API cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr,
                                                              unsigned int cudaVersion, unsigned long long flags,
                                                              enum cudaDriverEntryPointQueryResult* driverStatus
                                                                  GPUCOLL_EMU_DEFAULT(NULL));

// Devices.
GPUCOLL_EMU_API cudaError_t cudaGetDeviceCount(int* count);
GPUCOLL_EMU_API cudaError_t cudaGetDevice(int* device);
GPUCOLL_EMU_API cudaError_t cudaSetDevice(int device);
GPUCOLL_EMU_API cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device);
GPUCOLL_EMU_API cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice);
GPUCOLL_EMU_API cudaError_t cudaDeviceSynchronize(void);
GPUCOLL_EMU_API cudaError_t cudaMemGetInfo(size_t* free, size_t* total);

// Memory.
GPUCOLL_EMU_API cudaError_t cudaMalloc(void** devPtr, size_t size);
GPUCOLL_EMU_API cudaError_t cudaFree(void* devPtr);
GPUCOLL_EMU_API cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind);
GPUCOLL_EMU_API cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                                            cudaStream_t stream GPUCOLL_EMU_DEFAULT(0));
GPUCOLL_EMU_API cudaError_t cudaMemset(void* devPtr, int value, size_t count);
GPUCOLL_EMU_API cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count,
                                            cudaStream_t stream GPUCOLL_EMU_DEFAULT(0));
GPUCOLL_EMU_API cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr);
GPUCOLL_EMU_API cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* devPtr);
GPUCOLL_EMU_API cudaError_t cudaIpcOpenMemHandle(void** devPtr, cudaIpcMemHandle_t handle, unsigned int flags);
GPUCOLL_EMU_API cudaError_t cudaIpcCloseMemHandle(void* devPtr);

// Streams and events.
GPUCOLL_EMU_API cudaError_t cudaStreamCreate(cudaStream_t* pStream);
GPUCOLL_EMU_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags);
GPUCOLL_EMU_API cudaError_t cudaStreamDestroy(cudaStream_t stream);
GPUCOLL_EMU_API cudaError_t cudaStreamSynchronize(cudaStream_t stream);
GPUCOLL_EMU_API cudaError_t cudaStreamQuery(cudaStream_t stream);
GPUCOLL_EMU_API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                                unsigned int flags GPUCOLL_EMU_DEFAULT(0));
GPUCOLL_EMU_API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData);
GPUCOLL_EMU_API cudaError_t cudaEventCreate(cudaEvent_t* event);
GPUCOLL_EMU_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
GPUCOLL_EMU_API cudaError_t cudaEventDestroy(cudaEvent_t event);
GPUCOLL_EMU_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream GPUCOLL_EMU_DEFAULT(0));
GPUCOLL_EMU_API cudaError_t cudaEventQuery(cudaEvent_t event);
GPUCOLL_EMU_API cudaError_t cudaEventSynchronize(cudaEvent_t event);
GPUCOLL_EMU_API cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

// Stream capture and graphs.
GPUCOLL_EMU_API cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
GPUCOLL_EMU_API cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph);
GPUCOLL_EMU_API cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* pCaptureStatus);
GPUCOLL_EMU_API cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode);
GPUCOLL_EMU_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                                 unsigned long long flags GPUCOLL_EMU_DEFAULT(0));
GPUCOLL_EMU_API cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
GPUCOLL_EMU_API cudaError_t cudaGraphDestroy(cudaGraph_t graph);
GPUCOLL_EMU_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);

// Kernels. A kernel launched through the C entry point must have been launched (or queried) once through the
// typed C++ overload of <cuda_runtime.h>, which is what tells the emulator how to call it; nvcc's registration of
// __global__ functions has no host-compiler equivalent.
GPUCOLL_EMU_API cudaError_t cudaLaunchKernel(const void* func, dim3 gridDim, dim3 blockDim, void** args,
                                             size_t sharedMem, cudaStream_t stream);
GPUCOLL_EMU_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func,
                                                                          int blockSize, size_t dynamicSMemSize);

#ifdef __cplusplus
}
#endif
#undef GPUCOLL_EMU_DEFAULT
