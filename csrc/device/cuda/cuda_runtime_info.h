// What the CUDA runtime gpucoll was linked with reports. Declared for plain host code (no CUDA headers);
// defined in runtime_info.cu, which exists only in CUDA builds: callers guard with GPUCOLL_WITH_CUDA.
#pragma once

#include <string>

namespace gpucoll::cuda {

// cudaRuntimeGetVersion of the linked (static) runtime, e.g. 13000; 0 if the call fails.
int runtime_version();

// cudaGetDeviceCount. 0 when no device is usable, with `why` (if given) set to the runtime's error, e.g.
// "cudaErrorInsufficientDriver (35): CUDA driver version is insufficient for CUDA runtime version".
int device_count(std::string* why);

}  // namespace gpucoll::cuda
