#include "device/cuda_probe.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>

namespace gpucoll {
namespace {

// The few driver-API types and entry points the probe needs, as declared in cuda.h. CUresult and CUdevice
// are ints; the attribute numbers are stable across releases.
using CUresult = int;
using CUdevice = int;
constexpr CUresult kCudaSuccess = 0;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;

using PFN_cuDriverGetVersion = CUresult (*)(int*);
using PFN_cuInit = CUresult (*)(unsigned int);
using PFN_cuDeviceGetCount = CUresult (*)(int*);
using PFN_cuDeviceGet = CUresult (*)(CUdevice*, int);
using PFN_cuDeviceGetName = CUresult (*)(char*, int, CUdevice);
using PFN_cuDeviceGetAttribute = CUresult (*)(int*, int, CUdevice);
using PFN_cuDeviceComputeCapability = CUresult (*)(int*, int*, CUdevice);
using PFN_cuDeviceTotalMem = CUresult (*)(size_t*, CUdevice);
using PFN_cuDeviceGetPCIBusId = CUresult (*)(char*, int, CUdevice);
using PFN_cuGetErrorString = CUresult (*)(CUresult, const char**);
using PFN_cuGetErrorName = CUresult (*)(CUresult, const char**);

template <class F>
F symbol(void* handle, const char* name) {
  return reinterpret_cast<F>(dlsym(handle, name));
}

struct Driver {
  PFN_cuGetErrorString get_error_string = nullptr;
  PFN_cuGetErrorName get_error_name = nullptr;

  // "CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"
  std::string describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (get_error_name == nullptr || get_error_name(r, &name) != kCudaSuccess) name = nullptr;
    if (get_error_string == nullptr || get_error_string(r, &text) != kCudaSuccess) text = nullptr;
    std::string out = name != nullptr ? name : "CUresult";
    out += " (" + std::to_string(r) + ")";
    if (text != nullptr) out += std::string(": ") + text;
    return out;
  }
};

CudaProbe probe() {
  CudaProbe out;
#ifdef GPUCOLL_CUDA_EMULATION
  out.emulated = true;
#endif
  dlerror();
  // Kept open for the life of the process: the CUDA runtime opens the same library, and unloading the
  // driver after cuInit is not supported.
  void* handle = dlopen(cuda_driver_library(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    out.reason = std::string("no CUDA driver: ") + cuda_driver_library() + " not found (" +
                 (e != nullptr ? e : "dlopen failed") + ")";
    return out;
  }
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    out.driver_path = map->l_name;
  }

  Driver drv;
  drv.get_error_string = symbol<PFN_cuGetErrorString>(handle, "cuGetErrorString");
  drv.get_error_name = symbol<PFN_cuGetErrorName>(handle, "cuGetErrorName");
  auto get_version = symbol<PFN_cuDriverGetVersion>(handle, "cuDriverGetVersion");
  auto init = symbol<PFN_cuInit>(handle, "cuInit");
  auto get_count = symbol<PFN_cuDeviceGetCount>(handle, "cuDeviceGetCount");
  auto get_device = symbol<PFN_cuDeviceGet>(handle, "cuDeviceGet");
  auto get_name = symbol<PFN_cuDeviceGetName>(handle, "cuDeviceGetName");
  auto get_attr = symbol<PFN_cuDeviceGetAttribute>(handle, "cuDeviceGetAttribute");
  auto compute_cap = symbol<PFN_cuDeviceComputeCapability>(handle, "cuDeviceComputeCapability");
  // cuda.h maps these names to their _v2 ABI; the unsuffixed symbols are the 32-bit-size legacy versions.
  auto total_mem = symbol<PFN_cuDeviceTotalMem>(handle, "cuDeviceTotalMem_v2");
  auto pci_bus_id = symbol<PFN_cuDeviceGetPCIBusId>(handle, "cuDeviceGetPCIBusId");

  if (get_version != nullptr) {
    int v = 0;
    if (get_version(&v) == kCudaSuccess) out.driver_version = v;
  }
  if (init == nullptr || get_count == nullptr) {
    out.reason = std::string(cuda_driver_library()) + " at " + out.driver_path + " lacks cuInit/cuDeviceGetCount";
    return out;
  }
  const CUresult ri = init(0);
  if (ri != kCudaSuccess) {
    out.reason = "cuInit failed: " + drv.describe(ri);
    return out;
  }
  out.driver_available = true;
  int count = 0;
  const CUresult rc = get_count(&count);
  if (rc != kCudaSuccess) {
    out.reason = "cuDeviceGetCount failed: " + drv.describe(rc);
    return out;
  }
  if (count == 0) {
    out.reason = "the driver reports no CUDA device (check CUDA_VISIBLE_DEVICES)";
    return out;
  }
  out.device_count = count;
  for (int i = 0; i < count; ++i) {
    CudaDeviceInfo info;
    info.index = i;
    CUdevice dev = i;
    if (get_device != nullptr && get_device(&dev, i) != kCudaSuccess) dev = i;
    char buf[256] = {};
    if (get_name != nullptr && get_name(buf, static_cast<int>(sizeof(buf)) - 1, dev) == kCudaSuccess) info.name = buf;
    if (get_attr != nullptr) {
      if (get_attr(&info.major, kAttrComputeCapabilityMajor, dev) != kCudaSuccess) info.major = 0;
      if (get_attr(&info.minor, kAttrComputeCapabilityMinor, dev) != kCudaSuccess) info.minor = 0;
    }
    // Drivers without the attribute path are older than anything we support, but the deprecated call costs
    // nothing to try.
    if (info.major == 0 && compute_cap != nullptr && compute_cap(&info.major, &info.minor, dev) != kCudaSuccess) {
      info.major = info.minor = 0;
    }
    size_t bytes = 0;
    if (total_mem != nullptr && total_mem(&bytes, dev) == kCudaSuccess) info.total_memory = bytes;
    char bus[64] = {};
    if (pci_bus_id != nullptr && pci_bus_id(bus, static_cast<int>(sizeof(bus)) - 1, dev) == kCudaSuccess) {
      info.pci_bus_id = bus;
    }
    out.devices.push_back(std::move(info));
  }
  return out;
}

}  // namespace

const char* cuda_driver_library() {
#ifdef GPUCOLL_CUDA_EMULATION
  return "libgpucoll_cudaemu.so";
#else
  return "libcuda.so.1";
#endif
}

std::string cuda_version_string(int version) {
  if (version <= 0) return "";
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

CudaProbe cuda_probe() noexcept {
  static std::once_flag once;
  static CudaProbe result;
  try {
    std::call_once(once, [] { result = probe(); });
    return result;
  } catch (...) {
    // Only allocation can fail here; report it rather than let it escape a noexcept function.
    CudaProbe failed;
    failed.reason = "CUDA probe failed: out of memory";
    return failed;
  }
}

}  // namespace gpucoll
