// Portability macros shared by host C++ and CUDA device code.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define GPUCOLL_HD __host__ __device__
#define GPUCOLL_DEVICE __device__
#define GPUCOLL_INLINE __forceinline__
#else
#define GPUCOLL_HD
#define GPUCOLL_DEVICE
#define GPUCOLL_INLINE inline __attribute__((always_inline))
#endif
