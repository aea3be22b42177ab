// Configuration and devices of the emulated runtime: the device shape (gpucoll_emu_configure, called by gpucoll._C
// with the GPUCOLL_EMU_* values of the config registry), the current device, attributes, occupancy, versions, and
// the driver entry points gpucoll looks up by name (cuda_probe, cuMemGetAddressRange, primary-context state).
#include <pthread.h>
#include <time.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

constexpr int kMaxDevices = 16;
constexpr int kVersion = 13000;  // the CUDA API level the emulator follows (driver and runtime alike)
constexpr const char* kName = "gpucoll emulated CUDA device (CPU; not a GPU)";

std::mutex g_config_mu;
gpucoll_emu_config g_config = {1, 8, 2, 9, 0, 1, 16ull << 30, 0, 0, 0, 0};
std::atomic<bool> g_used{false};
std::atomic<bool> g_forked{false};
std::atomic<bool> g_touched[kMaxDevices];
thread_local int t_device = 0;
thread_local bool t_in_host_fn = false;

void on_fork_child() {
  // CUDA cannot be used in a child forked after it was initialised: such a child gets cudaErrorInitializationError
  // from every call, as it would from NVIDIA's runtime (the parent's threads and mappings are not there).
  if (g_used.load()) g_forked.store(true);
}

bool valid_config(const gpucoll_emu_config& c) {
  return c.devices >= 1 && c.devices <= kMaxDevices && c.sms >= 1 && c.sms <= 1024 && c.blocks_per_sm >= 1 &&
         c.blocks_per_sm <= 32 && c.cc_major >= 1 && c.cc_minor >= 0 && c.memory > 0 &&
         c.jitter_ns <= 1000000000ull && c.shuffle_threads <= 1 &&
         c.host_fence <= 1;
}

}  // namespace

const gpucoll_emu_config& config() {
  if (!g_used.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(g_config_mu);
    if (!g_used.load()) {
      static std::once_flag once;
      std::call_once(once, [] { pthread_atfork(nullptr, nullptr, on_fork_child); });
      g_used.store(true, std::memory_order_release);
    }
  }
  return g_config;
}

cudaError_t check_init() {
  config();
  if (g_forked.load(std::memory_order_relaxed)) return cudaErrorInitializationError;
  if (t_in_host_fn) return cudaErrorNotPermitted;
  return sticky();
}

bool valid_device(int device) { return device >= 0 && device < config().devices; }
int current_device() { return t_device; }
void touch_device(int device) {
  if (device >= 0 && device < kMaxDevices) g_touched[device].store(true);
}
bool device_touched(int device) { return device >= 0 && device < kMaxDevices && g_touched[device].load(); }
bool in_host_function() { return t_in_host_fn; }
void set_in_host_function(bool on) { t_in_host_fn = on; }

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

namespace {

int attribute(int attr, int device, int* out) {
  const gpucoll_emu_config& c = config();
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY:
      *out = 1024;
      return 0;
    case cudaDevAttrMaxBlockDimZ:
      *out = 64;
      return 0;
    case cudaDevAttrMaxGridDimX:
      *out = 2147483647;
      return 0;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ:
      *out = 65535;
      return 0;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *out = 48 * 1024;
      return 0;
    case cudaDevAttrWarpSize:
      *out = 32;
      return 0;
    case cudaDevAttrMultiProcessorCount:
      *out = c.sms;
      return 0;
    case cudaDevAttrIntegrated:
      *out = 0;
      return 0;
    case cudaDevAttrConcurrentKernels:
    case cudaDevAttrUnifiedAddressing:
      *out = 1;
      return 0;
    case cudaDevAttrPciBusId:
      *out = 0xe0 + device;
      return 0;
    case cudaDevAttrPciDeviceId:
    case cudaDevAttrPciDomainId:
      *out = 0;
      return 0;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *out = 1024 * c.blocks_per_sm;
      return 0;
    case cudaDevAttrMaxBlocksPerMultiprocessor:
      *out = c.blocks_per_sm;
      return 0;
    case cudaDevAttrComputeCapabilityMajor:
      *out = c.cc_major;
      return 0;
    case cudaDevAttrComputeCapabilityMinor:
      *out = c.cc_minor;
      return 0;
    default:
      return -1;
  }
}

}  // namespace
}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

void gpucoll_emu_default_config(gpucoll_emu_config* out) {
  if (out != nullptr) *out = gpucoll_emu_config{1, 8, 2, 9, 0, 1, 16ull << 30, 0, 0, 0, 0};
}

cudaError_t gpucoll_emu_configure(const gpucoll_emu_config* c) {
  if (c == nullptr || !valid_config(*c)) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(g_config_mu);
  if (g_used.load()) {
    // The same shape again is harmless (a second import of the configuring module, a harness that configures
    // after a query); a different one would change a device that is already in use.
    return std::memcmp(c, &g_config, sizeof(*c)) == 0 ? cudaSuccess : cudaErrorIllegalState;
  }
  g_config = *c;
  return cudaSuccess;
}

void gpucoll_emu_get_config(gpucoll_emu_config* out) {
  if (out != nullptr) *out = config();
}

const char* gpucoll_emu_device_name(void) { return kName; }

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (v == nullptr) return fail(cudaErrorInvalidValue);
  *v = kVersion;
  return ok();
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (v == nullptr) return fail(cudaErrorInvalidValue);
  *v = kVersion;
  return ok();
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = config().devices;
  return ok();
}

cudaError_t cudaGetDevice(int* device) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = t_device;
  return ok();
}

cudaError_t cudaSetDevice(int device) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
  t_device = device;
  touch_device(device);  // CUDA 12+: cudaSetDevice creates the device's primary context
  return ok();
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
  if (attribute(attr, device, value) != 0) return fail(cudaErrorInvalidValue);
  return ok();
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (can == nullptr) return fail(cudaErrorInvalidValue);
  if (!valid_device(device) || !valid_device(peer)) return fail(cudaErrorInvalidDevice);
  *can = device != peer && config().p2p ? 1 : 0;
  return ok();
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (free_bytes == nullptr || total == nullptr) return fail(cudaErrorInvalidValue);
  const int d = t_device;
  touch_device(d);
  const uint64_t used = allocated_bytes(d);
  *total = static_cast<size_t>(config().memory);
  *free_bytes = used >= config().memory ? 0 : static_cast<size_t>(config().memory - used);
  return ok();
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* func, int block_size,
                                                          size_t shared_bytes) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (blocks == nullptr || block_size <= 0) return fail(cudaErrorInvalidValue);
  gpucoll_emu_pack_fn pack;
  gpucoll_emu_invoke_fn invoke;
  gpucoll_emu_free_fn destroy;
  if (!lookup_kernel(func, &pack, &invoke, &destroy)) return fail(cudaErrorInvalidDeviceFunction);
  // The executor's own occupancy model, so that what this answers is what the block scheduler will co-schedule.
  *blocks = shared_bytes > 48 * 1024 ? 0 : resident_blocks(block_size, shared_bytes);
  return ok();
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags, cudaDriverEntryPointQueryResult* status) {
  (void)flags;
  if (symbol == nullptr || fn == nullptr) return fail(cudaErrorInvalidValue);
  struct Entry {
    const char* name;
    void* fn;
    unsigned int since;
  };
  static const Entry kEntries[] = {
      {"cuInit", reinterpret_cast<void*>(&cuInit), 2000},
      {"cuDriverGetVersion", reinterpret_cast<void*>(&cuDriverGetVersion), 2020},
      {"cuDeviceGetCount", reinterpret_cast<void*>(&cuDeviceGetCount), 2000},
      {"cuDeviceGet", reinterpret_cast<void*>(&cuDeviceGet), 2000},
      {"cuDeviceGetName", reinterpret_cast<void*>(&cuDeviceGetName), 2000},
      {"cuDeviceGetAttribute", reinterpret_cast<void*>(&cuDeviceGetAttribute), 2000},
      {"cuDeviceTotalMem", reinterpret_cast<void*>(&cuDeviceTotalMem_v2), 3020},
      {"cuDeviceGetPCIBusId", reinterpret_cast<void*>(&cuDeviceGetPCIBusId), 4010},
      {"cuDeviceCanAccessPeer", reinterpret_cast<void*>(&cuDeviceCanAccessPeer), 4000},
      {"cuDevicePrimaryCtxGetState", reinterpret_cast<void*>(&cuDevicePrimaryCtxGetState), 7000},
      {"cuMemGetAddressRange", reinterpret_cast<void*>(&cuMemGetAddressRange_v2), 3020},
      {"cuGetErrorName", reinterpret_cast<void*>(&cuGetErrorName), 6000},
      {"cuGetErrorString", reinterpret_cast<void*>(&cuGetErrorString), 6000},
  };
  *fn = nullptr;
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, symbol) != 0) continue;
    if (version < e.since) {
      if (status != nullptr) *status = cudaDriverEntryPointVersionNotSufficent;
      return ok();
    }
    *fn = e.fn;
    if (status != nullptr) *status = cudaDriverEntryPointSuccess;
    return ok();
  }
  if (status != nullptr) *status = cudaDriverEntryPointSymbolNotFound;
  return ok();
}

// ---- driver entry points ------------------------------------------------------------------------------------------

int cuInit(unsigned int flags) {
  if (flags != 0) return 1;
  config();
  return g_forked.load() ? 3 : 0;
}

int cuDriverGetVersion(int* version) {
  if (version == nullptr) return 1;
  *version = kVersion;
  return 0;
}

int cuDeviceGetCount(int* count) {
  if (count == nullptr) return 1;
  *count = config().devices;
  return 0;
}

int cuDeviceGet(int* device, int ordinal) {
  if (device == nullptr) return 1;
  if (!valid_device(ordinal)) return 101;
  *device = ordinal;
  return 0;
}

int cuDeviceGetName(char* name, int len, int device) {
  if (name == nullptr || len <= 0) return 1;
  if (!valid_device(device)) return 101;
  std::snprintf(name, static_cast<size_t>(len), "%s", kName);
  return 0;
}

int cuDeviceGetAttribute(int* value, int attrib, int device) {
  if (value == nullptr) return 1;
  if (!valid_device(device)) return 101;
  return attribute(attrib, device, value) == 0 ? 0 : 1;
}

int cuDeviceComputeCapability(int* major, int* minor, int device) {
  if (major == nullptr || minor == nullptr) return 1;
  if (!valid_device(device)) return 101;
  *major = config().cc_major;
  *minor = config().cc_minor;
  return 0;
}

int cuDeviceTotalMem_v2(size_t* bytes, int device) {
  if (bytes == nullptr) return 1;
  if (!valid_device(device)) return 101;
  *bytes = static_cast<size_t>(config().memory);
  return 0;
}

int cuDeviceGetPCIBusId(char* bus_id, int len, int device) {
  if (bus_id == nullptr || len <= 0) return 1;
  if (!valid_device(device)) return 101;
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:00.0", 0xe0 + device);
  return 0;
}

int cuDeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return 1;
  if (!valid_device(device) || !valid_device(peer)) return 101;
  *can = device != peer && config().p2p ? 1 : 0;
  return 0;
}

int cuDevicePrimaryCtxGetState(int device, unsigned int* flags, int* active) {
  if (flags == nullptr || active == nullptr) return 1;
  if (!valid_device(device)) return 101;
  *flags = 0;
  *active = device_touched(device) ? 1 : 0;
  return 0;
}

int cuMemGetAddressRange_v2(unsigned long long* base, size_t* size, unsigned long long ptr) {
  Range r;
  if (!find_range(reinterpret_cast<const void*>(ptr), 1, &r)) return 500;  // CUDA_ERROR_NOT_FOUND
  if (base != nullptr) *base = r.base;
  if (size != nullptr) *size = r.size;
  return 0;
}

}  // extern "C"
