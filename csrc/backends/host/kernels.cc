#include "backends/host/kernels.h"

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
}  // namespace

void reduce_into(void* dst, const void* src, int64_t count, DType dtype, RedOp op) noexcept {
  if (count <= 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_op(op, [&](auto fn) {
      reduce_loop(static_cast<T*>(dst), static_cast<const T*>(src), count, fn);
    });
  });
}

void avg_divide(void* data, int64_t count, DType dtype, int n) noexcept {
  if (count <= 0 || n == 1) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(data);
    for (int64_t i = 0; i < count; ++i) p[i] = avg_finish(p[i], n);
  });
}

}  // namespace gpucoll::host
