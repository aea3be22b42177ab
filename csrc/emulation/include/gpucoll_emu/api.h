// gpucoll's emulated CUDA device: the emulator's own C API, beside the CUDA runtime it emulates. For gpucoll._C
// (which configures the device from the config registry at import), the C++ test harnesses, and other libraries
// that run on the emulated device (the NCCL stand-in). See csrc/emulation/README.md.
#pragma once

#include <stdint.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// The emulated device's shape. Every process reads the same GPUCOLL_EMU_* variables (csrc/core/config.cc) and
// configures its emulator before its first CUDA call; devices in different processes are independent copies.
struct gpucoll_emu_config {
  int devices;               // visible devices (cudaGetDeviceCount)
  int sms;                   // multiprocessors per device
  int blocks_per_sm;         // a cap on resident blocks per SM, below the occupancy model (executor.cc); 1 to 32
  int cc_major, cc_minor;    // compute capability
  int p2p;                   // whether distinct devices can map each other's memory (IPC, cudaDeviceCanAccessPeer)
  unsigned long long memory; // bytes per device (cudaMalloc beyond it fails with cudaErrorMemoryAllocation)
  // Stream jitter: each stream operation (kernel, copy, fill, host function, event record, wait) starts after a
  // delay of 0 to jitter_ns drawn from `seed`, the stream's creation number and the operation's, so that work on
  // different streams interleaves differently from run to run, as on a GPU, and a missing dependency shows. 0: none.
  unsigned long long jitter_ns;
  unsigned long long seed;
  // Thread order: 0 runs a block's threads in index order at every turn (thread 0 first); 1 starts each turn at a
  // thread drawn from `seed` and the block's dispatch, so code that needs a __syncthreads it lacks reads before the
  // write it depends on; each global access of device code is then also a switch point, after a drawn number of them.
  unsigned long long shuffle_threads;
  // Host fence: 1 closes device memory to the process while the device is idle (runtime/region.cc), so that host
  // code dereferencing a device pointer segfaults as on a GPU. Off by default: each idle/busy transition costs an
  // mprotect over every mapped page (the suite runs it on a sample, the thorough run everywhere).
  unsigned long long host_fence;
};

// Device memory is closed to host code while the device is idle (runtime/region.cc). A thread of a library that
// stands in for a device-side agent and touches device memory outside stream work (the NCCL stand-in's bootstrap,
// which moves its records through device-memory mailboxes where NCCL's goes over sockets) brackets that with these:
// the memory stays open in between, as during device work.
GPUCOLL_EMU_API void gpucoll_emu_agent_begin(void);
GPUCOLL_EMU_API void gpucoll_emu_agent_end(void);

// The defaults (1 device, 8 SMs x 2 blocks, sm_90, P2P, 16 GiB, no jitter).
GPUCOLL_EMU_API void gpucoll_emu_default_config(struct gpucoll_emu_config* out);
// Applies `c`. cudaErrorInvalidValue for a nonsensical shape; cudaErrorIllegalState once the device was used
// (the first CUDA call fixes the shape for the life of the process).
GPUCOLL_EMU_API cudaError_t gpucoll_emu_configure(const struct gpucoll_emu_config* c);
GPUCOLL_EMU_API void gpucoll_emu_get_config(struct gpucoll_emu_config* out);
// "gpucoll emulated CUDA device (CPU; not a GPU)": the name cudaGetDeviceProperties/cuDeviceGetName report.
GPUCOLL_EMU_API const char* gpucoll_emu_device_name(void);
// Work the runtime has in flight right now, for tests of its bookkeeping: live streams, events, device
// allocations (own, not IPC mappings), open IPC mappings, graphs and graph execs.
struct gpucoll_emu_counts {
  int64_t streams, events, allocations, ipc_mappings, graphs, graph_execs;
};
GPUCOLL_EMU_API void gpucoll_emu_get_counts(struct gpucoll_emu_counts* out);

// The driver entry points gpucoll resolves by name (dlsym on the emulator, which the probe opens in place of
// libcuda.so.1, or cudaGetDriverEntryPointByVersion). CUresult is an int, CUdevice an ordinal.
GPUCOLL_EMU_API int cuInit(unsigned int flags);
GPUCOLL_EMU_API int cuDriverGetVersion(int* version);
GPUCOLL_EMU_API int cuDeviceGetCount(int* count);
GPUCOLL_EMU_API int cuDeviceGet(int* device, int ordinal);
GPUCOLL_EMU_API int cuDeviceGetName(char* name, int len, int device);
GPUCOLL_EMU_API int cuDeviceGetAttribute(int* value, int attrib, int device);
GPUCOLL_EMU_API int cuDeviceComputeCapability(int* major, int* minor, int device);
GPUCOLL_EMU_API int cuDeviceTotalMem_v2(size_t* bytes, int device);
GPUCOLL_EMU_API int cuDeviceGetPCIBusId(char* bus_id, int len, int device);
GPUCOLL_EMU_API int cuDeviceCanAccessPeer(int* can, int device, int peer);
GPUCOLL_EMU_API int cuDevicePrimaryCtxGetState(int device, unsigned int* flags, int* active);
GPUCOLL_EMU_API int cuMemGetAddressRange_v2(unsigned long long* base, size_t* size, unsigned long long ptr);
GPUCOLL_EMU_API int cuGetErrorName(int error, const char** name);
GPUCOLL_EMU_API int cuGetErrorString(int error, const char** text);

#ifdef __cplusplus
}
#endif
