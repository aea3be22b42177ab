#include "backends/host/kernels.h"

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/dispatch.h"

namespace gpucoll::host {

void copy_bytes(void* dst, const void* src, size_t n) noexcept {
  // glibc's memcpy moves a block of this size and more with `rep movsb`, which on AMD Zen (seen on this project's
  // EPYC machines, glibc 2.36) runs about 12x slower when the destination lies 1 to 63 bytes past the source
  // modulo 4 KiB: 125 us instead of 10 for 256 KiB. That is the everyday case here. A work buffer starts on a
  // page; a large NumPy array 16 bytes past one (malloc's header), so every copy out of the buffer into the user's
  // array hit it: a 1 MiB all_reduce on one rank took 570 us where the same array 64 bytes further took 80.
  // Those copies go through 16-byte vector moves instead, which have no such case.
  constexpr size_t kRepMovsbFrom = 2048;
  const auto gap = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095u;
#if defined(__SSE2__)
  if (n >= kRepMovsbFrom && gap != 0 && gap < 64) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);  // under 64 bytes: no rep movsb
    return;
  }
#else
  (void)gap;
  (void)kRepMovsbFrom;
#endif
  std::memcpy(dst, src, n);
}

void copy_elems(void* dst, const void* src, int64_t count, DType dtype) noexcept {
  if (count <= 0 || dst == src) return;
  copy_bytes(dst, src, static_cast<size_t>(count) * dtype_size(dtype));
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
