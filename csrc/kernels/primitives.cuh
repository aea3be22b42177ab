// Device-side copy and reduce primitives that gpucoll's CUDA kernels are built from.
//
// Each primitive works on a range of elements with a grid-stride loop, so one kernel shape serves every
// message size (the launcher picks the grid; see reduce.cu). The bulk of a range moves in 16-byte packs
// (one uint4, i.e. one 128-bit LDG/STG per thread per pack): that is the widest access a thread can issue
// and what reaches DRAM/HBM bandwidth with the fewest instructions. 16-byte access needs every pointer
// 16-byte aligned, so a range is split into a scalar head (up to the first aligned element), the packed
// body, and a scalar tail (the last count % pack elements). When the pointers of one call disagree on
// their offset within 16 bytes no common split exists and the whole range goes scalar.
//
// Reductions combine in the accumulation type of core/dispatch.h (float for f16/bf16) and round back once
// per element, exactly as the host backend does, so host and device results agree bit for bit; avg pre-multiplies
// floating inputs (AvgFinish::pre) and divides integer sums (AvgFinish), as the host backend and NCCL do.
//
// Memory ordering: these primitives use plain loads and stores. They are for buffers that no other agent
// writes while the kernel runs (local buffers, or peer buffers behind a completed synchronisation);
// protocols that read peers' buffers while those are written need their own flags and fences. Plain rather
// than read-only (ld.global.nc) loads also keep in-place calls (dst == a) correct.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dispatch.h"

namespace gpucoll::cuda {

constexpr int kPackBytes = 16;

// A 16-byte pack viewed as elements of T.
template <class T>
struct Pack {
  static constexpr int kElems = kPackBytes / static_cast<int>(sizeof(T));
  union {
    uint4 raw;
    T elem[kElems];
  };
};

// How a range of `count` elements splits around 16-byte alignment: elements [0, head) and
// [head + packs * kElems, count) are scalar, the middle goes in packs.
struct PackSplit {
  size_t head = 0;
  size_t packs = 0;
};

// The same split works for all pointers only when they share their offset within 16 bytes.
template <class T>
GPUCOLL_HD inline PackSplit pack_split(size_t count, const void* const* ptrs, int nptrs) {
  constexpr size_t kElems = kPackBytes / sizeof(T);
  PackSplit s;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(ptrs[0]) % kPackBytes;
  bool same = mis % sizeof(T) == 0;
  for (int i = 1; i < nptrs; ++i) same = same && reinterpret_cast<uintptr_t>(ptrs[i]) % kPackBytes == mis;
  if (!same) {
    s.head = count;
    return s;
  }
  const size_t head = ((kPackBytes - mis) % kPackBytes) / sizeof(T);
  s.head = head < count ? head : count;
  s.packs = (count - s.head) / kElems;
  return s;
}

__device__ GPUCOLL_INLINE size_t global_thread() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ GPUCOLL_INLINE size_t grid_threads() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

__device__ GPUCOLL_INLINE uint4 load_pack(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ GPUCOLL_INLINE void store_pack(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// What a reduction does besides combining (avg as core/dispatch.h defines it, NCCL's ncclAvg): `pre` on every input
// element before it is combined (floating types: times 1/n), `operator()` on every finished result before it is
// stored (integer types: divided by n). NoFinish does neither. kIdentity: both are the identity for every T.
struct NoFinish {
  static constexpr bool kIdentity = true;
  template <class T>
  __device__ GPUCOLL_INLINE T pre(T v) const {
    return v;
  }
  template <class T>
  __device__ GPUCOLL_INLINE T operator()(T v) const {
    return v;
  }
};
struct AvgFinish {
  static constexpr bool kIdentity = false;
  AvgScalars s;
  explicit AvgFinish(int nranks) : s(AvgScalars::of(nranks)) {}  // on the host, once per launch
  template <class T>
  __device__ GPUCOLL_INLINE T pre(T v) const {
    return s.pre(v);
  }
  template <class T>
  __device__ GPUCOLL_INLINE T operator()(T v) const {
    return s.finish(v);
  }
};
// Halves of a Fin, for kernels whose reduction is spread over steps: the pre-op where inputs enter (staging,
// kPre), the finish where results leave.
template <class Fin, bool kPre>
struct FinPart {
  static constexpr bool kIdentity = Fin::kIdentity;
  Fin f;
  template <class T>
  __device__ GPUCOLL_INLINE T pre(T v) const {
    if constexpr (kPre) {
      return f.pre(v);
    } else {
      return v;
    }
  }
  template <class T>
  __device__ GPUCOLL_INLINE T operator()(T v) const {
    if constexpr (kPre) {
      return v;
    } else {
      return f(v);
    }
  }
};
template <class Fin>
using PreOnly = FinPart<Fin, true>;
template <class Fin>
using FinishOnly = FinPart<Fin, false>;

template <class T, class Op, class Fin>
__device__ GPUCOLL_INLINE uint4 reduce_pack(uint4 a, uint4 b, Op op, Fin fin) {
  Pack<T> pa, pb, out;
  pa.raw = a;
  pb.raw = b;
#pragma unroll
  for (int i = 0; i < Pack<T>::kElems; ++i) out.elem[i] = fin(combine(fin.pre(pa.elem[i]), fin.pre(pb.elem[i]), op));
  return out.raw;
}

// Packs per thread per iteration of the main loop. Issuing several independent 16-byte loads before the
// first use keeps more bytes in flight per thread, which is what hides DRAM latency once the grid is
// capped at the resident-block limit and every thread loops.
constexpr int kUnroll = 4;

template <class T, class Op, class Fin>
__device__ GPUCOLL_INLINE void reduce_scalar(T* dst, const T* a, const T* b, size_t begin, size_t end, Op op, Fin fin) {
  for (size_t i = begin + global_thread(); i < end; i += grid_threads()) {
    dst[i] = fin(combine(fin.pre(a[i]), fin.pre(b[i]), op));
  }
}

// dst, a and b point at the first packed element and are 16-byte aligned.
template <class T, class Op, class Fin>
__device__ GPUCOLL_INLINE void reduce_packs(T* dst, const T* a, const T* b, size_t packs, Op op, Fin fin) {
  const uint4* pa = reinterpret_cast<const uint4*>(a);
  const uint4* pb = reinterpret_cast<const uint4*>(b);
  uint4* pd = reinterpret_cast<uint4*>(dst);
  const size_t stride = grid_threads();
  size_t p = global_thread();
  // Thread t handles packs t, t+stride, t+2*stride, ... in order; the unrolled loop takes them kUnroll at a
  // time while all kUnroll exist, the second loop takes the rest.
  for (; p + (kUnroll - 1) * stride < packs; p += kUnroll * stride) {
    uint4 va[kUnroll], vb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      va[u] = load_pack(pa + p + u * stride);
      vb[u] = load_pack(pb + p + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_pack(pd + p + u * stride, reduce_pack<T>(va[u], vb[u], op, fin));
  }
  for (; p < packs; p += stride) store_pack(pd + p, reduce_pack<T>(load_pack(pa + p), load_pack(pb + p), op, fin));
}

// dst[i] = fin(op(fin.pre(a[i]), fin.pre(b[i]))) for i < count. dst may be a or b (in place) but must not partially
// overlap.
template <class T, class Op, class Fin>
__device__ GPUCOLL_INLINE void reduce_range(T* dst, const T* a, const T* b, size_t count, PackSplit split, Op op,
                                            Fin fin) {
  constexpr size_t kElems = Pack<T>::kElems;
  reduce_scalar(dst, a, b, 0, split.head, op, fin);
  if (split.packs > 0) reduce_packs(dst + split.head, a + split.head, b + split.head, split.packs, op, fin);
  reduce_scalar(dst, a, b, split.head + split.packs * kElems, count, op, fin);
}

// Copies in units of T (any trivially copyable type of 1, 2, 4, 8 or 16 bytes).
template <class T>
__device__ GPUCOLL_INLINE void copy_scalar(T* dst, const T* src, size_t begin, size_t end) {
  for (size_t i = begin + global_thread(); i < end; i += grid_threads()) dst[i] = src[i];
}

template <class T>
__device__ GPUCOLL_INLINE void copy_packs(T* dst, const T* src, size_t packs) {
  const uint4* ps = reinterpret_cast<const uint4*>(src);
  uint4* pd = reinterpret_cast<uint4*>(dst);
  const size_t stride = grid_threads();
  size_t p = global_thread();
  for (; p + (kUnroll - 1) * stride < packs; p += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_pack(ps + p + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_pack(pd + p + u * stride, v[u]);
  }
  for (; p < packs; p += stride) store_pack(pd + p, load_pack(ps + p));
}

// dst[i] = src[i] for i < count; the ranges must not overlap.
template <class T>
__device__ GPUCOLL_INLINE void copy_range(T* dst, const T* src, size_t count, PackSplit split) {
  constexpr size_t kElems = Pack<T>::kElems;
  copy_scalar(dst, src, 0, split.head);
  if (split.packs > 0) copy_packs(dst + split.head, src + split.head, split.packs);
  copy_scalar(dst, src, split.head + split.packs * kElems, count);
}

}  // namespace gpucoll::cuda
