// 16-bit floating storage types with conversions that compile for host and device.
//
// The core keeps f16/bf16 as plain 16-bit words so that no CUDA header is needed to build the host
// backend. Arithmetic always happens in float: convert, operate, round back with round-to-nearest-even.
// For +, -, *, / on f16/bf16 that gives the correctly rounded result (float carries more than 2p+2 bits),
// so host results match NumPy and the GPU's native half arithmetic bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/macros.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace gpucoll {

struct alignas(2) f16_t {
  uint16_t bits;
};
struct alignas(2) bf16_t {
  uint16_t bits;
};

GPUCOLL_HD GPUCOLL_INLINE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

GPUCOLL_HD GPUCOLL_INLINE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

GPUCOLL_HD GPUCOLL_INLINE float to_float(f16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#else
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal: normalise the mantissa into float's implicit-one form.
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return bits_float(sign | (exp << 23) | (mant << 13));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

GPUCOLL_HD GPUCOLL_INLINE f16_t f16_from_float(float f) {
#if defined(__CUDA_ARCH__)
  return f16_t{__half_as_ushort(__float2half_rn(f))};
#else
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (x >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to infinity
  if (x < 0x38800000u) {                                                      // below f16's smallest normal
    if (x < 0x33000000u) return f16_t{static_cast<uint16_t>(sign)};
    const uint32_t e = x >> 23;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return f16_t{static_cast<uint16_t>(sign | r)};
  }
  uint32_t h = (x - 0x38000000u) >> 13;
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return f16_t{static_cast<uint16_t>(sign | h)};
#endif
}

GPUCOLL_HD GPUCOLL_INLINE float to_float(bf16_t b) { return bits_float(static_cast<uint32_t>(b.bits) << 16); }

GPUCOLL_HD GPUCOLL_INLINE bf16_t bf16_from_float(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((x >> 16) | 0x40u)};  // quiet NaN
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(rounded >> 16)};
}

}  // namespace gpucoll
