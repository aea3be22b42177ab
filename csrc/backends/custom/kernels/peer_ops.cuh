// Block-level data movement of the custom kernels: which elements a block owns, and copy/reduce of that
// slice with 16-byte packs.
//
// Slices, not grid-stride loops. The flags of peer_sync.cuh pair block b of every rank with block b of its
// peers, so a barrier only orders what block b does. Every phase of a kernel (staging the input, each step,
// writing the output) therefore gives block b the SAME elements of every chunk: slice b. Then whatever block
// b of any rank reads was written by block b of its owner before their last common barrier, and `out` may
// alias `in`: block b reads its slice of `in` before it writes the same slice of `out`.
//
// A slice is a balanced share of the chunk in whole 16-byte packs (so consecutive slices keep one alignment),
// the last slice taking the remainder.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backends/custom/slices.h"
#include "backends/custom/kernels/custom_allreduce.h"
#include "backends/custom/kernels/primitives.cuh"

namespace gpucoll::cuda::custom {

using gpucoll::custom::chunk_range;
using gpucoll::custom::Range;

// This block's slice of a chunk (absolute offsets, like the chunk's): backends/custom/slices.h.
template <class T>
__device__ __forceinline__ Range block_slice(Range chunk) {
  return gpucoll::custom::block_slice_of(chunk, Pack<T>::kElems, static_cast<int>(gridDim.x),
                                         static_cast<int>(blockIdx.x));
}

// Loads that bypass L1 (ld.global.cg): for memory another rank writes. L1 is not coherent across SMs or GPUs;
// data is read once per call, so skipping it costs nothing.
__device__ __forceinline__ uint4 ld_cg_pack(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// The unsigned integer of an element's size: what the cache-hinted intrinsics take (they have no half types).
template <size_t kBytes>
struct Bits;
template <>
struct Bits<2> {
  using type = unsigned short;
};
template <>
struct Bits<4> {
  using type = unsigned int;
};
template <>
struct Bits<8> {
  using type = unsigned long long;
};

template <class T>
__device__ __forceinline__ T ld_cg(const T* p) {
  using U = typename Bits<sizeof(T)>::type;
  const U u = __ldcg(reinterpret_cast<const U*>(p));
  T v;
  memcpy(&v, &u, sizeof(v));
  return v;
}

// A plain store of one element (st.global.wb through its intrinsic, which the emulated device checks like a pack's).
template <class T>
__device__ __forceinline__ void st_elem(T* p, T v) {
  using U = typename Bits<sizeof(T)>::type;
  U u;
  memcpy(&u, &v, sizeof(u));
  __stwb(reinterpret_cast<U*>(p), u);
}

// Up to kMaxRanks + 1 sources of one reduction, combined in list order.
template <class T>
struct Srcs {
  const T* p[kMaxRanks + 1];
  int n;
};

// Whether every pointer shares its offset within 16 bytes (then the body of a range moves in packs).
template <class T>
__device__ __forceinline__ PackSplit split_for(const T* dst, const Srcs<T>& s, size_t count) {
  const void* ptrs[kMaxRanks + 2];
  ptrs[0] = dst;
  for (int i = 0; i < s.n; ++i) ptrs[i + 1] = s.p[i];
  return pack_split<T>(count, ptrs, s.n + 1);
}

// dst[i] = fin(pre(src0[i]) op pre(src1[i]) op ... ) for i < count (pre: fin.pre), by the threads of one block.
// Half types accumulate in float and round once (Acc of core/dispatch.h), in the fixed order of `s`, so every
// rank that reduces the same sources gets the same bits. dst may be one of the sources (same element, same
// thread).
template <class T, class Op, class Fin>
__device__ __forceinline__ void block_reduce(T* dst, const Srcs<T>& s, size_t count, Op op, Fin fin) {
  using A = typename Acc<T>::type;
  constexpr int kElems = Pack<T>::kElems;
  const PackSplit split = split_for(dst, s, count);
  auto scalar = [&](size_t i) {
    A acc = Acc<T>::load(fin.pre(ld_cg(s.p[0] + i)));
#pragma unroll
    for (int k = 1; k < kMaxRanks + 1; ++k) {
      if (k < s.n) acc = op(acc, Acc<T>::load(fin.pre(ld_cg(s.p[k] + i))));
    }
    st_elem(dst + i, fin(Acc<T>::store(acc)));
  };
  for (size_t i = threadIdx.x; i < split.head; i += blockDim.x) scalar(i);
  const size_t body_end = split.head + split.packs * kElems;
  for (size_t p = threadIdx.x; p < split.packs; p += blockDim.x) {
    const size_t off = split.head + p * kElems;
    A acc[kElems];
    Pack<T> v;
    v.raw = ld_cg_pack(s.p[0] + off);
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = Acc<T>::load(fin.pre(v.elem[e]));
#pragma unroll
    for (int k = 1; k < kMaxRanks + 1; ++k) {
      if (k < s.n) {
        v.raw = ld_cg_pack(s.p[k] + off);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[e] = op(acc[e], Acc<T>::load(fin.pre(v.elem[e])));
      }
    }
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < kElems; ++e) o.elem[e] = fin(Acc<T>::store(acc[e]));
    store_pack(dst + off, o.raw);
  }
  for (size_t i = body_end + threadIdx.x; i < count; i += blockDim.x) scalar(i);
}

// dst[i] = fin(fin.pre(src[i])) for i < count, by the threads of one block; src may be a peer's memory. With an
// identity Fin the bits move untouched (no round trip through float that could rewrite a NaN payload).
template <class T, class Fin>
__device__ __forceinline__ void block_copy(T* dst, const T* src, size_t count, Fin fin) {
  Srcs<T> s;
  s.p[0] = src;
  s.n = 1;
  if constexpr (!Fin::kIdentity) {
    block_reduce(dst, s, count, OpSum{}, fin);
  } else {
    constexpr int kElems = Pack<T>::kElems;
    const PackSplit split = split_for(dst, s, count);
    for (size_t i = threadIdx.x; i < split.head; i += blockDim.x) st_elem(dst + i, ld_cg(src + i));
    for (size_t p = threadIdx.x; p < split.packs; p += blockDim.x) {
      const size_t off = split.head + p * kElems;
      store_pack(dst + off, ld_cg_pack(src + off));
    }
    for (size_t i = split.head + split.packs * kElems + threadIdx.x; i < count; i += blockDim.x) {
      st_elem(dst + i, ld_cg(src + i));
    }
  }
}

template <class T>
__device__ __forceinline__ T* at(void* base, size_t elems) {
  return static_cast<T*>(base) + elems;
}
template <class T>
__device__ __forceinline__ const T* at(const void* base, size_t elems) {
  return static_cast<const T*>(base) + elems;
}

// Rank q's half of the staging buffer for this call: calls alternate halves, so a call never overwrites the
// half that a slower peer may still be reading from the previous call (it finished that call before it
// could arrive at this call's first barrier, which is what the call after this one waits for).
__device__ __forceinline__ void* staging(const AllReduceArgs& a, int q, uint64_t calls) {
  return static_cast<char*>(a.bufs.ptr[q]) + (calls & 1u) * a.half_bytes;
}

// Copies this block's slice of every chunk of `in` into this rank's staging half (nchunks slicing), applying the
// pre-op of `fin` to each element (avg on floating types: times 1/n) when the schedule reduces staged data.
template <class T, class Fin = NoFinish>
__device__ __forceinline__ void stage_input(const AllReduceArgs& a, uint64_t calls, int nchunks, Fin fin = {}) {
  T* mine = static_cast<T*>(staging(a, a.rank, calls));
  for (int c = 0; c < nchunks; ++c) {
    const Range r = block_slice<T>(chunk_range(a.count, nchunks, c));
    block_copy(mine + r.begin, at<T>(a.in, r.begin), r.count, PreOnly<Fin>{fin});
  }
}

}  // namespace gpucoll::cuda::custom
