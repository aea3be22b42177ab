// What the CUDA driver on this machine offers, found without linking it: libcuda.so.1 is opened with
// dlopen, so this works (and says why not) on machines with no driver, no GPU, or a host-only build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpucoll {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int major = 0;  // compute capability
  int minor = 0;
  uint64_t total_memory = 0;  // bytes; 0 when the driver did not say
  std::string pci_bus_id;     // "0000:17:00.0", or empty
};

struct CudaProbe {
  bool driver_available = false;  // libcuda.so.1 was loaded and cuInit succeeded
  // The "driver" is gpucoll's emulated CUDA device (a GPUCOLL_CUDA=emulate build): devices are CPU emulations.
  bool emulated = false;
  std::string driver_path;        // where libcuda.so.1 was found
  int driver_version = 0;         // cuDriverGetVersion, e.g. 13000 (readable even when cuInit fails)
  int device_count = 0;
  // Why device_count is 0: "libcuda.so.1 not found (...)", "cuInit failed: CUDA_ERROR_NO_DEVICE (100): ...".
  std::string reason;
  std::vector<CudaDeviceInfo> devices;
};

// Probes once per process and returns the cached result; never throws.
//
// This calls cuInit, which initialises the driver in the calling process. A process that forks after that
// cannot use CUDA in its children, so launchers that fork ranks should probe in a child (or in the ranks),
// not in the parent.
CudaProbe cuda_probe() noexcept;

// The library that plays the CUDA driver: libcuda.so.1, or in a GPUCOLL_CUDA=emulate build the emulator
// (libgpucoll_cudaemu.so, already loaded as gpucoll._C's dependency), which offers the same entry points.
const char* cuda_driver_library();

// "13.0" from 13000.
std::string cuda_version_string(int version);

}  // namespace gpucoll
