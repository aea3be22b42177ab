// The one dtype x op dispatch of gpucoll: reduction functors (host and device) and the switch that turns
// run-time (DType, RedOp) values into template arguments. Every backend and kernel reduces through this
// header, so adding a dtype or an op is a change here and nowhere else.
//
//   dispatch_dtype(dt, [&](auto tag) { using T = typename decltype(tag)::type; ... });
//   dispatch_op(op, [&](auto fn) { ... fn(a, b) ... });
//
// Elements are combined in their accumulation type (float for f16/bf16, the type itself otherwise) and
// rounded back once per combine, which is what NCCL's kernels do for a pairwise reduction.
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

// avg's final step: floating types divide by n (rounded once), integer types divide with truncation.
template <class T>
GPUCOLL_HD GPUCOLL_INLINE T avg_finish(T sum, int n) {
  using A = typename Acc<T>::type;
  return Acc<T>::store(static_cast<A>(Acc<T>::load(sum) / static_cast<A>(n)));
}

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

// kAvg dispatches to OpSum: backends finish avg with avg_finish after the reduction.
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
