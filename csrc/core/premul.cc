#include "core/premul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/half.h"

namespace gpucoll {

namespace {

template <class T>
size_t store_integer(double scalar, DType t, unsigned char out[8]) {
  // An integer reduction multiplies by an integer: 0.5 would silently become 0, so say so instead.
  if (scalar != std::floor(scalar)) {
    GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " is not an integer, but the reduction is over ", dtype_name(t),
                        " elements; use an integer scalar or a floating dtype");
  }
  // Compare in double against the exact bounds; int64's max is not representable, so its bound is 2^63.
  const double lo = static_cast<double>(std::numeric_limits<T>::min());
  const double hi_exclusive = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
  if (scalar < lo || scalar >= hi_exclusive) {
    GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " does not fit in ", dtype_name(t));
  }
  const T v = static_cast<T>(scalar);
  std::memcpy(out, &v, sizeof(T));
  return sizeof(T);
}

// `scalar` rounded to the nearest OCP fp8 value (ties to even, subnormals kept) with `mbits` mantissa bits, exponent
// bias `bias` and largest finite magnitude `max_finite`. Out of range is an error, as for float16, not NCCL's
// saturation. Matches torch's float -> float8 conversion wherever the value fits.
uint8_t fp8_from_double(double scalar, int mbits, int bias, double max_finite, DType t) {
  const uint8_t sign = std::signbit(scalar) ? 0x80 : 0x00;
  const double a = std::fabs(scalar);
  if (a == 0.0) return sign;
  const int emin = 1 - bias;  // exponent of the smallest normal
  const int e = std::max(std::ilogb(a), emin);
  const double quantum = std::ldexp(1.0, e - mbits);  // spacing of fp8 values in a's binade (or the subnormals)
  const double q = std::nearbyint(a / quantum);        // exact division by a power of two; ties to even
  const double v = q * quantum;
  if (v > max_finite) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows ", dtype_name(t));
  if (v < std::ldexp(1.0, emin)) return static_cast<uint8_t>(sign | static_cast<int>(q));  // subnormal
  const int ev = std::ilogb(v);
  const int mant = static_cast<int>(std::ldexp(v, mbits - ev)) - (1 << mbits);
  return static_cast<uint8_t>(sign | ((ev + bias) << mbits) | mant);
}

}  // namespace

size_t premul_scalar_bytes(DType t, double scalar, unsigned char out[8]) {
  std::memset(out, 0, 8);
  if (!std::isfinite(scalar)) GPUCOLL_INVALID_ARG("premul_sum scalar must be finite; got ", scalar);
  switch (t) {
    case DType::kF16: {
      // double -> float -> half rounds twice; for a scale factor the last-bit difference this can make in
      // rare halfway cases is immaterial, and it is what torch's own f16 scalar conversion does.
      const f16_t h = f16_from_float(static_cast<float>(scalar));
      if (!std::isfinite(to_float(h))) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows float16");
      std::memcpy(out, &h.bits, 2);
      return 2;
    }
    case DType::kBF16: {
      const bf16_t b = bf16_from_float(static_cast<float>(scalar));
      if (!std::isfinite(to_float(b))) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows bfloat16");
      std::memcpy(out, &b.bits, 2);
      return 2;
    }
    case DType::kF32: {
      const float f = static_cast<float>(scalar);
      if (!std::isfinite(f)) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows float32");
      std::memcpy(out, &f, 4);
      return 4;
    }
    case DType::kF64:
      std::memcpy(out, &scalar, 8);
      return 8;
    case DType::kI8:
      return store_integer<int8_t>(scalar, t, out);
    case DType::kU8:
      return store_integer<uint8_t>(scalar, t, out);
    case DType::kI32:
      return store_integer<int32_t>(scalar, t, out);
    case DType::kI64:
      return store_integer<int64_t>(scalar, t, out);
    case DType::kF8E4M3:  // e4m3fn: bias 7, no infinities, 448 the largest finite value
      out[0] = fp8_from_double(scalar, 3, 7, 448.0, t);
      return 1;
    case DType::kF8E5M2:  // bias 15, 57344 the largest finite value
      out[0] = fp8_from_double(scalar, 2, 15, 57344.0, t);
      return 1;
  }
  GPUCOLL_INVALID_ARG("unknown dtype id ", static_cast<int>(t));
}

}  // namespace gpucoll
