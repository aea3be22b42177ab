// Element-level building blocks of gpucoll's CUDA kernels: 16-byte packs, how a range splits around 16-byte
// alignment, and what happens to a reduced element before it is stored (avg's division). The block-level copy
// and reduce loops that use them are in peer_ops.cuh.
//
// The bulk of a range moves in 16-byte packs (one uint4, i.e. one 128-bit LDG/STG per thread per pack): that is
// the widest access a thread can issue and what reaches DRAM/HBM bandwidth with the fewest instructions. 16-byte
// access needs every pointer 16-byte aligned, so a range is split into a scalar head (up to the first aligned
// element), the packed body, and a scalar tail (the last count % pack elements). When the pointers of one call
// disagree on their offset within 16 bytes no common split exists and the whole range goes scalar.
//
// Reductions combine in the accumulation type of core/dispatch.h (float for f16/bf16) and round back once per
// element, exactly as the host backend does, so host and device results agree bit for bit; avg pre-multiplies
// floating inputs (AvgFinish::pre) and divides integer sums (AvgFinish), as the host backend and NCCL do.
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

// st.global.wb, the plain store; spelled as the intrinsic so that the emulated device checks it (alignment,
// bounds) like every other global access of the kernels.
__device__ GPUCOLL_INLINE void store_pack(void* p, uint4 v) { __stwb(reinterpret_cast<uint4*>(p), v); }

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

}  // namespace gpucoll::cuda
