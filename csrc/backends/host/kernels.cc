#include "backends/host/kernels.h"

#include <algorithm>
#include <cstring>

#include "core/dispatch.h"

namespace gpucoll::host {

void copy_elems(void* dst, const void* src, int64_t count, DType dtype) noexcept {
  if (count <= 0 || dst == src) return;
  std::memcpy(dst, src, static_cast<size_t>(count) * dtype_size(dtype));
}

namespace {
template <class T, class Op>
void reduce_loop(T* __restrict__ dst, const T* __restrict__ src, int64_t n, Op op) {
  for (int64_t i = 0; i < n; ++i) dst[i] = combine(dst[i], src[i], op);
}
// Blocks of kBlock elements keep the accumulators in L1 while every source streams through once.
constexpr int64_t kBlock = 1024;

template <class T, class Op>
void reduce_multi_loop(T* dst, const void* const* srcs, int nsrcs, bool include_dst, int64_t n, Op op) {
  using A = typename Acc<T>::type;
  A acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    int first_src = 0;
    if (include_dst) {
      const T* __restrict__ d = dst + i0;
      for (int64_t j = 0; j < m; ++j) acc[j] = Acc<T>::load(d[j]);
    } else {
      const T* __restrict__ s = static_cast<const T*>(srcs[0]) + i0;
      for (int64_t j = 0; j < m; ++j) acc[j] = Acc<T>::load(s[j]);
      first_src = 1;
    }
    for (int k = first_src; k < nsrcs; ++k) {
      const T* __restrict__ s = static_cast<const T*>(srcs[k]) + i0;
      for (int64_t j = 0; j < m; ++j) acc[j] = op(acc[j], Acc<T>::load(s[j]));
    }
    T* __restrict__ d = dst + i0;
    for (int64_t j = 0; j < m; ++j) d[j] = Acc<T>::store(acc[j]);
  }
}
}  // namespace

void reduce_multi(void* dst, const void* const* srcs, int nsrcs, bool include_dst, int64_t count, DType dtype,
                  RedOp op) noexcept {
  if (count <= 0 || nsrcs <= 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_op(op, [&](auto fn) { reduce_multi_loop(static_cast<T*>(dst), srcs, nsrcs, include_dst, count, fn); });
  });
}

void reduce_into(void* dst, const void* src, int64_t count, DType dtype, RedOp op) noexcept {
  if (count <= 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_op(op, [&](auto fn) {
      reduce_loop(static_cast<T*>(dst), static_cast<const T*>(src), count, fn);
    });
  });
}

void premul_copy(void* dst, const void* src, int64_t count, DType dtype, const void* scalar) noexcept {
  if (count <= 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T s;
    std::memcpy(&s, scalar, sizeof(T));
    T* __restrict__ d = static_cast<T*>(dst);
    const T* __restrict__ x = static_cast<const T*>(src);
    for (int64_t i = 0; i < count; ++i) d[i] = premul(x[i], s);
  });
}

bool avg_scalar_bytes(DType dtype, int n, unsigned char out[8]) noexcept {
  std::memset(out, 0, 8);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kAvgPreMul<T>) {
      const T s = avg_scalar<T>(n);
      std::memcpy(out, &s, sizeof(T));
      return true;
    } else {
      return false;
    }
  });
}

void avg_divide(void* data, int64_t count, DType dtype, int n) noexcept {
  if (count <= 0 || n == 1) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!kAvgPreMul<T>) {
      T* p = static_cast<T*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] = avg_finish(p[i], n);
    }
  });
}

}  // namespace gpucoll::host
