// NCCL's arithmetic, element by element, as its device code defines it (src/device/reduce_kernel.h, hostToDevRedOp in
// src/enqueue.cc), so that results are what a GPU running NCCL gives for the same order of ranks:
//
// * every step rounds to the element type: a sum or product of two fp16/bf16 values is rounded once (__hadd, __hmul);
//   fp8 goes through half: x and y widened to half exactly, the operation rounded to half, then to fp8 saturating to
//   the largest finite value (__nv_fp8_e4m3(__half) converts with __NV_SATFINITE);
// * ncclAvg on floating types is a pre-multiplied sum: each input times 1/nranks converted to the type (fp8: from
//   float, saturating), then summed; on integer types it is the wrapped sum divided afterwards, truncating toward zero;
// * integer sums and products wrap modulo 2^bits; min and max compare signed or unsigned per type.
//
// Floating values are computed in double and rounded once to the type: a double holds every fp16/bf16/fp8 sum and
// product exactly or, for float32 and bf16 far-apart exponents, rounds it so that the second rounding is innocuous
// (53 >= 2p + 2 for every p here). float64 is computed natively.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "nccl_emu.h"

namespace ncclemu {
namespace {

using namespace gpucoll;  // the enum values of nccl_api.h

// x rounded to `p` significand bits (ties to even) with `emin` the exponent of the smallest normal; no range limit.
double round_bits(double x, int p, int emin) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  const int e = std::max(std::ilogb(x), emin);
  const double quantum = std::ldexp(1.0, e - (p - 1));
  return std::nearbyint(x / quantum) * quantum;  // exact scaling by a power of two; nearbyint ties to even
}

// A binary floating format: significand bits with the implicit one, exponent bits, largest finite value, and what
// an overflowing result becomes (infinity, or the largest finite value for fp8's __NV_SATFINITE).
struct Format {
  int p, ebits;
  double max_finite;
  bool saturate;
  bool fn;  // e4m3fn: no infinities, only S.1111.111 is NaN
  int emin() const { return 2 - (1 << (ebits - 1)); }
  int bias() const { return (1 << (ebits - 1)) - 1; }
  double round(double x) const {
    if (std::isnan(x)) return x;
    const double r = round_bits(x, p, emin());
    if (std::fabs(r) <= max_finite) return r;
    if (saturate) return std::copysign(max_finite, r);
    return std::copysign(std::numeric_limits<double>::infinity(), r);
  }
  uint32_t encode(double v) const {
    const int mbits = p - 1;
    const uint32_t sign = std::signbit(v) ? 1u << (mbits + ebits) : 0u;
    const uint32_t exp_all = (1u << ebits) - 1;
    if (std::isnan(v)) return sign | (exp_all << mbits) | ((1u << mbits) - 1);
    const double a = std::fabs(v);
    if (a == 0.0) return sign;
    if (std::isinf(a)) return sign | (exp_all << mbits);
    if (a < std::ldexp(1.0, emin())) {
      return sign | static_cast<uint32_t>(std::ldexp(a, mbits - emin()));  // subnormal
    }
    const int e = std::ilogb(a);
    const uint32_t mant = static_cast<uint32_t>(std::ldexp(a, mbits - e)) - (1u << mbits);
    return sign | (static_cast<uint32_t>(e + bias()) << mbits) | mant;
  }
  double decode(uint32_t bits) const {
    const int mbits = p - 1;
    const bool neg = (bits >> (mbits + ebits)) & 1u;
    const uint32_t exp = (bits >> mbits) & ((1u << ebits) - 1);
    const uint32_t mant = bits & ((1u << mbits) - 1);
    double v;
    if (exp == (1u << ebits) - 1 && !fn) {
      v = mant == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
    } else if (fn && exp == (1u << ebits) - 1 && mant == (1u << mbits) - 1) {
      v = std::numeric_limits<double>::quiet_NaN();
    } else if (exp == 0) {
      v = std::ldexp(static_cast<double>(mant), emin() - mbits);
    } else {
      v = std::ldexp(static_cast<double>(mant + (1u << mbits)), static_cast<int>(exp) - bias() - mbits);
    }
    return neg ? -v : v;
  }
};

constexpr Format kHalf{11, 5, 65504.0, false, false};
constexpr Format kBf16{8, 8, 3.3895313892515355e38, false, false};
constexpr Format kE4M3{4, 4, 448.0, true, true};
constexpr Format kE5M2{3, 5, 57344.0, true, false};

// Element types whose arithmetic goes through double: load, the per-step rounding, store.
struct Half {
  using S = uint16_t;
  static double load(S b) { return kHalf.decode(b); }
  static S store(double v) { return static_cast<S>(kHalf.encode(v)); }
  static double rnd(double x) { return kHalf.round(x); }
};
struct Bf16 {
  using S = uint16_t;
  static double load(S b) { return kBf16.decode(b); }
  static S store(double v) { return static_cast<S>(kBf16.encode(v)); }
  static double rnd(double x) { return kBf16.round(x); }
};
struct F32 {
  using S = float;
  static double load(S b) { return b; }
  static S store(double v) { return static_cast<float>(v); }
  static double rnd(double x) { return static_cast<double>(static_cast<float>(x)); }
};
struct F64 {
  using S = double;
  static double load(S b) { return b; }
  static S store(double v) { return v; }
  static double rnd(double x) { return x; }
};
template <const Format& F>
struct Fp8 {
  using S = uint8_t;
  static double load(S b) { return F.decode(b); }
  static S store(double v) { return static_cast<S>(F.encode(v)); }
  static double rnd(double x) { return F.round(kHalf.round(x)); }  // the half operation, then the fp8 conversion
};

double scalar_value(const Format& f, uint64_t bits) { return f.decode(static_cast<uint32_t>(bits)); }

template <class T>
double float_scalar(uint64_t bits) {
  if constexpr (std::is_same_v<T, Half>) return scalar_value(kHalf, bits);
  if constexpr (std::is_same_v<T, Bf16>) return scalar_value(kBf16, bits);
  if constexpr (std::is_same_v<T, Fp8<kE4M3>>) return scalar_value(kE4M3, bits);
  if constexpr (std::is_same_v<T, Fp8<kE5M2>>) return scalar_value(kE5M2, bits);
  if constexpr (std::is_same_v<T, F32>) {
    float f;
    const uint32_t b = static_cast<uint32_t>(bits);
    std::memcpy(&f, &b, 4);
    return f;
  }
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

template <class T>
void reduce_float(const DevOp& op, uint64_t scalar, const void* const* srcs, int n, void* dst, size_t count) {
  using S = typename T::S;
  const double s = float_scalar<T>(scalar);
  const bool premul = op.kind == DevOp::kPreMulSum;
  auto pre = [&](double x) { return premul ? T::rnd(x * s) : x; };
  S* out = static_cast<S*>(dst);
  for (size_t i = 0; i < count; ++i) {
    double acc = pre(T::load(static_cast<const S*>(srcs[0])[i]));
    for (int r = 1; r < n; ++r) {
      const double x = pre(T::load(static_cast<const S*>(srcs[r])[i]));
      switch (op.kind) {
        case DevOp::kProd:
          acc = T::rnd(acc * x);
          break;
        case DevOp::kMin:
          acc = std::fmin(acc, x);
          break;
        case DevOp::kMax:
          acc = std::fmax(acc, x);
          break;
        default:
          acc = T::rnd(acc + x);
          break;
      }
    }
    out[i] = T::store(acc);
  }
}

template <class T>
void reduce_int(const DevOp& op, uint64_t scalar, const void* const* srcs, int n, void* dst, size_t count) {
  using U = std::make_unsigned_t<T>;
  // Unsigned arithmetic wraps where signed would be undefined; the cast back to U keeps 8-bit promotions in range.
  const U s = static_cast<U>(scalar);
  const bool premul = op.kind == DevOp::kPreMulSum;
  T* out = static_cast<T*>(dst);
  for (size_t i = 0; i < count; ++i) {
    U acc = static_cast<U>(static_cast<const T*>(srcs[0])[i]);
    if (premul) acc = static_cast<U>(acc * s);
    for (int r = 1; r < n; ++r) {
      U x = static_cast<U>(static_cast<const T*>(srcs[r])[i]);
      switch (op.kind) {
        case DevOp::kProd:
          acc = static_cast<U>(acc * x);
          break;
        case DevOp::kMin:
          if (static_cast<T>(x) < static_cast<T>(acc)) acc = x;
          break;
        case DevOp::kMax:
          if (static_cast<T>(x) > static_cast<T>(acc)) acc = x;
          break;
        case DevOp::kPreMulSum:
          acc = static_cast<U>(acc + static_cast<U>(x * s));
          break;
        default:
          acc = static_cast<U>(acc + x);
          break;
      }
    }
    if (op.kind == DevOp::kSumPostDiv) {
      // The magnitude divided, the sign put back: truncation toward zero (FuncSumPostDiv).
      const U divisor = static_cast<U>(scalar);
      const bool neg = std::is_signed_v<T> && static_cast<T>(acc) < 0;
      const U mag = neg ? static_cast<U>(U(0) - acc) : acc;
      const U q = static_cast<U>(mag / divisor);
      acc = neg ? static_cast<U>(U(0) - q) : q;
    }
    out[i] = static_cast<T>(acc);
  }
}

// float(1.0 / nranks) in the element type, as hostToDevRedOp converts it for ncclAvg.
uint64_t avg_scalar(ncclDataType_t t, int nranks) {
  const double inv = 1.0 / nranks;
  const double f = static_cast<double>(static_cast<float>(inv));
  switch (t) {
    case ncclFloat16:
      return kHalf.encode(kHalf.round(f));
    case ncclBfloat16:
      return kBf16.encode(kBf16.round(f));
    case ncclFloat8e4m3:  // __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...): float straight to fp8
      return kE4M3.encode(kE4M3.round(f));
    case ncclFloat8e5m2:
      return kE5M2.encode(kE5M2.round(f));
    case ncclFloat32: {
      const float v = static_cast<float>(inv);
      uint32_t b;
      std::memcpy(&b, &v, 4);
      return b;
    }
    default: {
      uint64_t b;
      std::memcpy(&b, &inv, 8);
      return b;
    }
  }
}

}  // namespace

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

bool is_fp8(ncclDataType_t t) { return t == ncclFloat8e4m3 || t == ncclFloat8e5m2; }

bool builtin_op(ncclRedOp_t op, ncclDataType_t t, int nranks, DevOp* out) {
  *out = DevOp{};
  switch (op) {
    case ncclSum:
      out->kind = DevOp::kSum;
      return true;
    case ncclProd:
      out->kind = DevOp::kProd;
      return true;
    case ncclMin:
      out->kind = DevOp::kMin;
      return true;
    case ncclMax:
      out->kind = DevOp::kMax;
      return true;
    case ncclAvg:
      switch (t) {
        case ncclInt8:
        case ncclUint8:
        case ncclInt32:
        case ncclUint32:
        case ncclInt64:
        case ncclUint64:
          out->kind = DevOp::kSumPostDiv;
          out->scalar = static_cast<uint64_t>(nranks);
          return true;
        default:
          out->kind = DevOp::kPreMulSum;
          out->scalar = avg_scalar(t, nranks);
          return true;
      }
    default:
      return false;
  }
}

uint64_t scalar_bits(const void* scalar, ncclDataType_t t) {
  uint64_t bits = 0;
  std::memcpy(&bits, scalar, type_size(t));
  return bits;
}

void reduce(ncclDataType_t t, const DevOp& op, const void* const* srcs, int n, void* dst, size_t count) {
  // ncclScalarDevice: the scalar is read on the device when the operation runs.
  const uint64_t scalar = op.scalar_ptr != nullptr ? scalar_bits(op.scalar_ptr, t) : op.scalar;
  switch (t) {
    case ncclInt8:
      return reduce_int<int8_t>(op, scalar, srcs, n, dst, count);
    case ncclUint8:
      return reduce_int<uint8_t>(op, scalar, srcs, n, dst, count);
    case ncclInt32:
      return reduce_int<int32_t>(op, scalar, srcs, n, dst, count);
    case ncclUint32:
      return reduce_int<uint32_t>(op, scalar, srcs, n, dst, count);
    case ncclInt64:
      return reduce_int<int64_t>(op, scalar, srcs, n, dst, count);
    case ncclUint64:
      return reduce_int<uint64_t>(op, scalar, srcs, n, dst, count);
    case ncclFloat16:
      return reduce_float<Half>(op, scalar, srcs, n, dst, count);
    case ncclBfloat16:
      return reduce_float<Bf16>(op, scalar, srcs, n, dst, count);
    case ncclFloat32:
      return reduce_float<F32>(op, scalar, srcs, n, dst, count);
    case ncclFloat64:
      return reduce_float<F64>(op, scalar, srcs, n, dst, count);
    case ncclFloat8e4m3:
      return reduce_float<Fp8<kE4M3>>(op, scalar, srcs, n, dst, count);
    case ncclFloat8e5m2:
      return reduce_float<Fp8<kE5M2>>(op, scalar, srcs, n, dst, count);
    default:
      return;
  }
}

}  // namespace ncclemu
