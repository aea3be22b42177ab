// gpucoll's emulated CUDA device: the vector types of CUDA's vector_types.h that gpucoll's sources use (uint3 for
// threadIdx/blockIdx, dim3 for launch shapes and blockDim/gridDim, uint4 for 16-byte packs), with CUDA's layout.
// First on the include path only in GPUCOLL_CUDA=emulate builds (csrc/emulation/README.md).
#pragma once

struct uint3 {
  unsigned int x, y, z;
};

// CUDA aligns uint4 to 16 bytes: a 16-byte pack load (ld.global.v4) needs it, and so do our unions with it.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
