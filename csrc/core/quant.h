// Wire formats of the compressed all-reduce: what a rank's float32 values become on their way to a peer.
//
// Values travel in blocks of kQuantBlock elements, numbered from the vector's first element (block b holds
// elements [256b, 256b + 256)), whatever pieces or chunks an executor cuts the vector into: the result is then a
// function of the inputs alone, the same on the host backend and in the kernels, and a NumPy reference can
// reproduce it bit for bit (gpucoll/compression.py). int8 and fp8 records carry one float32 scale per block, so
// one outlier costs the precision of its own block only; bf16 keeps float32's exponent range and needs none.
//
// Non-finite values keep their meaning instead of being clamped into the block's range, which would turn an
// overflowed gradient into a plausible number: a block's scale comes from its finite values only, and ±Inf and
// NaN have codes of their own. int8: finite codes are [-126, 126], 127 = +Inf, -127 = -Inf, -128 = NaN. fp8
// (e4m3, three mantissa bits, no infinities of its own): finite values are scaled to |v| <= 416, ±448 stand
// for ±Inf, 0x7F/0xFF for NaN.
//
// Every product and sum goes through mul_rn/add_rn: nvcc contracts a*b + c into one FMA by default, which rounds
// once instead of twice and would make the kernels' result differ from the host's in the last bit.
//
// The worst-case error of an element, derived in docs/compression.md, is checked by tests/compression/.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "core/macros.h"

namespace gpucoll {

enum class Wire : uint8_t { kNone = 0, kInt8 = 1, kFp8 = 2, kBf16 = 3 };
constexpr int kNumWires = 4;
constexpr int kQuantBlock = 256;

inline const char* wire_name(Wire w) {
  switch (w) {
    case Wire::kInt8: return "int8";
    case Wire::kFp8: return "fp8";
    case Wire::kBf16: return "bf16";
    default: return "none";
  }
}

// The format named `name` ("int8", "fp8", "bf16"); kNone for any other name (the caller says what it expected).
inline Wire wire_from_name(const char* name) {
  for (int w = 1; w < kNumWires; ++w) {
    const char* a = wire_name(static_cast<Wire>(w));
    const char* b = name;
    while (*a != 0 && *a == *b) {
      ++a;
      ++b;
    }
    if (*a == 0 && *b == 0) return static_cast<Wire>(w);
  }
  return Wire::kNone;
}

// One block's record: int8/fp8 codes, then the float32 scale at kQuantBlock and a flags byte after it (16-byte
// aligned records); bf16: the values. kHasSpecials says the block holds a non-finite value: decoders without it
// may skip looking for special codes (a hint; decoding every code by its meaning gives the same values).
GPUCOLL_HD constexpr int64_t wire_record_bytes(Wire w) {
  return w == Wire::kBf16 ? 2 * kQuantBlock : w == Wire::kNone ? 4 * kQuantBlock : kQuantBlock + 16;
}
constexpr int kRecordFlags = 4;  // offset of the flags byte after the codes
constexpr uint8_t kHasSpecials = 1;
constexpr float kInt8Max = 126.f;  // largest finite code
constexpr float kFp8Max = 416.f;   // largest finite value (e4m3's 448 is +Inf here)
// Blocks whose largest finite magnitude is below kTiny are scaled by kTinyLift first (a power of two: exact), or
// kInt8Max / m would overflow float.
constexpr float kTiny = 0x1p-100f;
constexpr float kTinyLift = 0x1p100f;
// Adding then subtracting 1.5 * 2^23 rounds a float of magnitude below 2^22 to an integer, to nearest even, in
// two exact vectorisable operations (no cvt with a rounding mode of its own on either side).
constexpr float kRoundMagic = 12582912.f;
constexpr float kFloatMax = 3.402823466e38f;

GPUCOLL_HD GPUCOLL_INLINE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GPUCOLL_HD GPUCOLL_INLINE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GPUCOLL_HD GPUCOLL_INLINE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

GPUCOLL_HD GPUCOLL_INLINE float round_even(float t) { return add_rn(add_rn(t, kRoundMagic), -kRoundMagic); }

// |v| if finite, else 0: the block's scale ignores what has a code of its own. The sign bit is cleared, not tested:
// -0 must give +0, or a block of zeros would get the scale -0 and decode every code with the wrong sign.
GPUCOLL_HD GPUCOLL_INLINE float finite_abs(float v) {
  const float a = bits_float(float_bits(v) & 0x7fffffffu);
  return a <= kFloatMax ? a : 0.f;
}

// What one block's scaling needs, from m, the largest finite magnitude in it: the scale that travels (value =
// code * scale) and the factors that map a value onto the code range (code = (v * lift) * inv).
struct BlockScale {
  float scale;
  float lift;
  float inv;
};
GPUCOLL_HD GPUCOLL_INLINE BlockScale block_scale(float m, float code_max) {
  BlockScale b;
  b.scale = div_rn(m, code_max);
  b.lift = m < kTiny ? kTinyLift : 1.f;
  const float lifted = mul_rn(m, b.lift);
  b.inv = m > 0.f ? div_rn(code_max, lifted) : 0.f;
  return b;
}

GPUCOLL_HD GPUCOLL_INLINE int8_t int8_code(float v, const BlockScale& b) {
  float t = mul_rn(mul_rn(v, b.lift), b.inv);
  t = t < -kInt8Max ? -kInt8Max : t;  // NaN compares false both times and is replaced below
  t = t > kInt8Max ? kInt8Max : t;
  const int q = static_cast<int>(round_even(t == t ? t : 0.f));
  return static_cast<int8_t>(v != v ? -128 : v > kFloatMax ? 127 : v < -kFloatMax ? -127 : q);
}
GPUCOLL_HD GPUCOLL_INLINE float int8_value(int8_t c, float scale) {
  const float inf = bits_float(0x7f800000u);
  const float v = mul_rn(static_cast<float>(c), scale);
  return c == -128 ? bits_float(0x7fc00000u) : c == 127 ? inf : c == -127 ? -inf : v;
}

// e4m3 of t (|t| <= 416 or non-finite), to nearest even: subnormals (below 2^-6) are multiples of 2^-9, normals
// keep three mantissa bits of float's 23 with the exponent re-biased from 127 to 7.
GPUCOLL_HD GPUCOLL_INLINE uint8_t fp8_code(float v, const BlockScale& b) {
  const float t = mul_rn(mul_rn(v, b.lift), b.inv);
  float a = t < 0.f ? -t : t;
  a = a > kFp8Max ? kFp8Max : a;
  a = a == a ? a : 0.f;
  const uint32_t sub = static_cast<uint32_t>(round_even(mul_rn(a, 512.f)));
  const uint32_t bits = float_bits(a);
  const uint32_t normal = ((bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  uint32_t c = a < 0x1p-6f ? sub : normal;
  c |= (float_bits(t) >> 24) & 0x80u;
  return static_cast<uint8_t>(v != v ? 0x7fu : v > kFloatMax ? 0x7eu : v < -kFloatMax ? 0xfeu : c);
}
// The unscaled value of an e4m3 code under the conventions above.
GPUCOLL_HD GPUCOLL_INLINE float fp8_unscaled(uint8_t c) {
  const uint32_t e = (c >> 3) & 15u;
  const uint32_t m = c & 7u;
  float v;
  if ((c & 0x7fu) == 0x7fu) {
    v = bits_float(0x7fc00000u);
  } else if ((c & 0x7fu) == 0x7eu) {
    v = bits_float(0x7f800000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * 0x1p-9f;
  } else {
    v = bits_float(((e + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) != 0 ? -v : v;
}
GPUCOLL_HD GPUCOLL_INLINE float fp8_value(float unscaled, float scale) {
  // Inf * 0 would be NaN for a block whose finite values are all 0: the code's meaning wins.
  return unscaled - unscaled == 0.f ? mul_rn(unscaled, scale) : unscaled;
}

}  // namespace gpucoll
