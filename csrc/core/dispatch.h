// The one dtype x op dispatch of gpucoll: reduction functors (host and device) and the switch that turns
// run-time (DType, RedOp) values into template arguments. Every backend and kernel reduces through this
// header, so adding a dtype or an op is a change here and nowhere else.
//
//   dispatch_dtype(dt, [&](auto tag) { using T = typename decltype(tag)::type; ... });
//   dispatch_op(op, [&](auto fn) { ... fn(a, b) ... });
//
// Elements are combined in their accumulation type (float for f16/bf16, the type itself otherwise) and
// rounded back once per combine, which is what NCCL's kernels do for a pairwise reduction.
//
// avg is what NCCL's ncclAvg is (src/enqueue.cc hostToDevRedOp, src/device/reduce_kernel.h):
//   floating types  a pre-multiplied sum: every rank's input is multiplied by 1/n (avg_scalar) and rounded to its
//                   type (premul: FuncPreMulSum's pre-op), then the products are summed. Nothing overflows that the
//                   result does not: three float16 60000s average to 60000, where a sum first would be inf.
//   integer types   sum (wrapping), then divide the finished sum by n truncating toward zero (avg_finish: NCCL's
//                   FuncSumPostDiv).
// premul_sum(s) is the same pre-multiplied sum with the caller's scalar s (integers: a wrapping product).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "core/types.h"

namespace gpucoll {

template <class T>
struct TypeTag {
  using type = T;
};

// Storage type -> accumulation type, and the conversions between them.
template <class T>
struct Acc {
  using type = T;
  GPUCOLL_HD static GPUCOLL_INLINE T load(T v) { return v; }
  GPUCOLL_HD static GPUCOLL_INLINE T store(T v) { return v; }
};
template <>
struct Acc<f16_t> {
  using type = float;
  GPUCOLL_HD static GPUCOLL_INLINE float load(f16_t v) { return to_float(v); }
  GPUCOLL_HD static GPUCOLL_INLINE f16_t store(float v) { return f16_from_float(v); }
};
template <>
struct Acc<bf16_t> {
  using type = float;
  GPUCOLL_HD static GPUCOLL_INLINE float load(bf16_t v) { return to_float(v); }
  GPUCOLL_HD static GPUCOLL_INLINE bf16_t store(float v) { return bf16_from_float(v); }
};

// Integer sums and products wrap modulo 2^bits as in NCCL and NumPy. Signed overflow is undefined in C++, so
// integers are combined as their unsigned counterparts (well-defined wrap-around) and converted back.
template <class A, bool kIntegral = std::is_integral<A>::value>
struct Wrap {
  using type = A;
};
template <class A>
struct Wrap<A, true> {
  using type = typename std::make_unsigned<A>::type;
};

struct OpSum {
  static constexpr RedOp kOp = RedOp::kSum;
  template <class A>
  GPUCOLL_HD GPUCOLL_INLINE A operator()(A a, A b) const {
    using U = typename Wrap<A>::type;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  }
};
struct OpProd {
  static constexpr RedOp kOp = RedOp::kProd;
  template <class A>
  GPUCOLL_HD GPUCOLL_INLINE A operator()(A a, A b) const {
    // uint8/uint16 promote to int before '*'; multiplying as unsigned int keeps every width overflow-free.
    using U = typename Wrap<A>::type;
    using M = typename std::conditional<(sizeof(U) < sizeof(unsigned)), unsigned, U>::type;
    return static_cast<A>(static_cast<U>(static_cast<M>(static_cast<U>(a)) * static_cast<M>(static_cast<U>(b))));
  }
};
struct OpMin {
  static constexpr RedOp kOp = RedOp::kMin;
  template <class A>
  GPUCOLL_HD GPUCOLL_INLINE A operator()(A a, A b) const {
    return b < a ? b : a;
  }
};
struct OpMax {
  static constexpr RedOp kOp = RedOp::kMax;
  template <class A>
  GPUCOLL_HD GPUCOLL_INLINE A operator()(A a, A b) const {
    return a < b ? b : a;
  }
};

// Combine one storage element into another: dst = op(dst, src).
template <class T, class Op>
GPUCOLL_HD GPUCOLL_INLINE T combine(T a, T b, Op op) {
  return Acc<T>::store(op(Acc<T>::load(a), Acc<T>::load(b)));
}

// Whether avg is a pre-multiplied sum for T (floating types) or a sum then a division (integer types).
template <class T>
constexpr bool kAvgPreMul = !std::is_integral<T>::value;

// NCCL's 1/n for avg on T: computed in double, rounded to float, then to f16/bf16 (NCCL converts with
// __float2half(float(1.0/n)) and __float2bfloat16(float(1.0/n)); float is float(1.0/n), double 1.0/n). The double
// rounding of f16/bf16 is NCCL's, kept on purpose so that the scalar has the same bits.
template <class T>
GPUCOLL_HD GPUCOLL_INLINE T avg_scalar(int n) {
  if constexpr (std::is_same<T, double>::value) {
    return 1.0 / static_cast<double>(n);
  } else {
    return Acc<T>::store(static_cast<float>(1.0 / static_cast<double>(n)));
  }
}

// a * b rounded to A before anything adds to it. nvcc fuses `acc + x * s` into one fma by default (--fmad=true),
// which rounds once: avg's pre-multiplied sum then differs in the last bit from the host backend and NCCL, which
// round every product (seen on an H100: the one-shot and two-shot kernels' float32 avg, 1 ulp off). __fmul_rn and
// __dmul_rn are never fused. The emulated device compiles kernels with fusion on too (CMakeLists.txt), so there an
// empty asm that claims to change the product stops the host compiler in the same way; a host build's backends
// store every product before summing it and need neither.
template <class A>
GPUCOLL_HD GPUCOLL_INLINE A mul_unfused(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same<A, double>::value) {
    return __dmul_rn(a, b);
  } else if constexpr (std::is_same<A, float>::value) {
    return __fmul_rn(a, b);
  } else {
    return a * b;
  }
#elif defined(GPUCOLL_CUDA_EMULATION) && (defined(__x86_64__) || defined(__aarch64__))
  A p = a * b;
  if constexpr (std::is_floating_point<A>::value) {
#if defined(__x86_64__)
    __asm__("" : "+x"(p));
#else
    __asm__("" : "+w"(p));
#endif
  }
  return p;
#else
  return a * b;
#endif
}

// The pre-op of avg and premul_sum on one input element: x * s rounded once to T (the product of two f16 or bf16
// values is exact in float, so rounding it to T gives what the GPU's __hmul gives); integers wrap like OpProd.
template <class T>
GPUCOLL_HD GPUCOLL_INLINE T premul(T x, T s) {
  if constexpr (std::is_integral<T>::value) {
    return OpProd{}(x, s);
  } else {
    return Acc<T>::store(mul_unfused(Acc<T>::load(x), Acc<T>::load(s)));
  }
}

// avg's last step on a finished sum: integer types divide by n with truncation toward zero; floating types were
// pre-multiplied (premul with avg_scalar) and keep their sum.
template <class T>
GPUCOLL_HD GPUCOLL_INLINE T avg_finish(T sum, int n) {
  if constexpr (kAvgPreMul<T>) {
    (void)n;
    return sum;
  } else {
    return static_cast<T>(sum / n);  // int8/uint8 promote to int: n may exceed their range
  }
}

// The scalars avg needs on any T, computed once on the host and passed by value (a kernel parameter): 1/n in every
// floating type as avg_scalar rounds it, and n for the integer division.
struct AvgScalars {
  int n = 1;
  double f64 = 1.0;
  float f32 = 1.0f;
  f16_t f16{0x3c00};
  bf16_t bf16{0x3f80};

  GPUCOLL_HD static AvgScalars of(int nranks) {
    AvgScalars s;
    s.n = nranks;
    s.f64 = avg_scalar<double>(nranks);
    s.f32 = avg_scalar<float>(nranks);
    s.f16 = avg_scalar<f16_t>(nranks);
    s.bf16 = avg_scalar<bf16_t>(nranks);
    return s;
  }
  // avg's pre-op on one input element of type T (identity for integers).
  template <class T>
  GPUCOLL_HD GPUCOLL_INLINE T pre(T x) const {
    if constexpr (std::is_same<T, double>::value) {
      return premul(x, f64);
    } else if constexpr (std::is_same<T, float>::value) {
      return premul(x, f32);
    } else if constexpr (std::is_same<T, f16_t>::value) {
      return premul(x, f16);
    } else if constexpr (std::is_same<T, bf16_t>::value) {
      return premul(x, bf16);
    } else {
      return x;
    }
  }
  template <class T>
  GPUCOLL_HD GPUCOLL_INLINE T finish(T sum) const {
    return avg_finish(sum, n);
  }
};

#define GPUCOLL_DTYPE_CASES(X) \
  X(kF16, f16_t)               \
  X(kBF16, bf16_t)             \
  X(kF32, float)               \
  X(kF64, double)              \
  X(kI8, int8_t)               \
  X(kU8, uint8_t)              \
  X(kI32, int32_t)             \
  X(kI64, int64_t)

// Host-side dispatch. Callers validate dtype/op first (Python layer and backends do), so the fall-through
// case is unreachable; it returns the first instantiation rather than throwing so that this header stays
// usable from translation units compiled without exceptions.
template <class F>
decltype(auto) dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
#define GPUCOLL_CASE(E, T) \
  case DType::E:           \
    return f(TypeTag<T>{});
    GPUCOLL_DTYPE_CASES(GPUCOLL_CASE)
#undef GPUCOLL_CASE
    case DType::kF8E4M3:  // no arithmetic for fp8 here (NCCL-only types): callers reject them first
    case DType::kF8E5M2:
      break;
  }
  return f(TypeTag<float>{});
}

// kAvg dispatches to OpSum: backends apply AvgScalars::pre to the inputs and AvgScalars::finish to the sums.
template <class F>
decltype(auto) dispatch_op(RedOp op, F&& f) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      return f(OpSum{});
    case RedOp::kProd:
      return f(OpProd{});
    case RedOp::kMin:
      return f(OpMin{});
    case RedOp::kMax:
      return f(OpMax{});
  }
  return f(OpSum{});
}

}  // namespace gpucoll
