// Element-wise reduce and copy kernels, instantiated for every dtype x op through core/dispatch.h.
#include <map>
#include <mutex>
#include <utility>

#include "kernels/primitives.cuh"
#include "kernels/reduce.h"

namespace gpucoll::cuda {
namespace {

// Launch shape. These kernels are memory-bound streams, so the only goal is enough bytes in flight on
// every SM:
// - 256 threads per block: small messages split into twice as many blocks as with 512, so they spread over
//   more SMs (each SM has its own load/store path); large messages reach the same occupancy either way.
// - blocks = one thread per 16-byte pack, capped at what can be resident at once (occupancy calculator x
//   SM count). Blocks beyond that would only run in later waves; capping turns them into grid-stride
//   iterations, which the kUnroll loads per iteration keep latency-tolerant.
// - A message of a few packs gets a single block: launch latency (microseconds) dominates there.
// The choice follows from the hardware limits rather than from a sweep; it has not been tuned on a GPU yet.
constexpr int kThreads = 256;

template <class T, class Op, class Fin>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(T* dst, const T* a, const T* b, size_t count, PackSplit split, Op op, Fin fin) {
  reduce_range(dst, a, b, count, split, op, fin);
}

template <class T>
__global__ void __launch_bounds__(kThreads) copy_kernel(T* dst, const T* src, size_t count, PackSplit split) {
  copy_range(dst, src, count, split);
}

// Resident-block capacity of one kernel on the current device, cached per (kernel, device): the occupancy
// query is far slower than a launch.
int grid_cap(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({kernel, dev});
  if (it != cache.end()) return it->second;
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess) {
    // Not cached: the error is reported by the launch itself (cudaGetLastError) or by a later call.
    cudaGetLastError();
    return 1;
  }
  const int cap = sms * (per_sm > 0 ? per_sm : 1);
  cache.emplace(std::make_pair(kernel, dev), cap);
  return cap;
}

unsigned int blocks_for(size_t work_items, const void* kernel) {
  const size_t wanted = (work_items + kThreads - 1) / kThreads;
  const size_t cap = static_cast<size_t>(grid_cap(kernel));
  const size_t blocks = wanted < cap ? wanted : cap;
  return static_cast<unsigned int>(blocks > 0 ? blocks : 1);
}

// Work items of a split: one per pack, plus the scalar elements (all of them when nothing packs).
size_t work_items(size_t count, PackSplit s, size_t elems_per_pack) {
  return s.packs + (count - s.packs * elems_per_pack);
}

template <class T, class Op, class Fin>
cudaError_t launch_reduce_typed(void* dst, const void* a, const void* b, size_t count, Op op, Fin fin,
                                cudaStream_t stream) {
  const void* ptrs[3] = {dst, a, b};
  const PackSplit split = pack_split<T>(count, ptrs, 3);
  auto kernel = reduce_kernel<T, Op, Fin>;
  const unsigned int blocks =
      blocks_for(work_items(count, split, Pack<T>::kElems), reinterpret_cast<const void*>(kernel));
  kernel<<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b),
                                          count, split, op, fin);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_copy_typed(void* dst, const void* src, size_t count, cudaStream_t stream) {
  const void* ptrs[2] = {dst, src};
  const PackSplit split = pack_split<T>(count, ptrs, 2);
  auto kernel = copy_kernel<T>;
  const unsigned int blocks =
      blocks_for(work_items(count, split, Pack<T>::kElems), reinterpret_cast<const void*>(kernel));
  kernel<<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(src), count, split);
  return cudaGetLastError();
}

bool valid_dtype(DType t) { return static_cast<int>(t) >= 0 && static_cast<int>(t) < kNumDTypes; }
bool valid_op(RedOp op) { return static_cast<int>(op) >= 0 && static_cast<int>(op) < kNumRedOps; }
bool aligned_to(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

cudaError_t launch_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op,
                          cudaStream_t stream, int avg_divisor) {
  if (!valid_dtype(dtype) || !valid_op(op) || avg_divisor < 1) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const size_t esize = dtype_size(dtype);
  if (dst == nullptr || a == nullptr || b == nullptr) return cudaErrorInvalidValue;
  if (!aligned_to(dst, esize) || !aligned_to(a, esize) || !aligned_to(b, esize)) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // avg as NCCL's ncclAvg and the host backend compute it (core/dispatch.h): pre-multiplied floating inputs,
    // a divided integer sum.
    if (op == RedOp::kAvg) return launch_reduce_typed<T>(dst, a, b, count, OpSum{}, AvgFinish{avg_divisor}, stream);
    return dispatch_op(op, [&](auto fn) { return launch_reduce_typed<T>(dst, a, b, count, fn, NoFinish{}, stream); });
  });
}

cudaError_t launch_copy(void* dst, const void* src, size_t count, DType dtype, cudaStream_t stream) {
  if (!valid_dtype(dtype)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  const size_t esize = dtype_size(dtype);
  if (!aligned_to(dst, esize) || !aligned_to(src, esize)) return cudaErrorInvalidValue;
  // A copy does not care about the element type, only about the widest unit both pointers and the length
  // allow: with equal offsets within 16 bytes the body moves in packs whatever the unit; otherwise the
  // unit is the whole copy, and 8-byte units beat 1-byte ones by 8x in instructions.
  const size_t bytes = count * esize;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if (bits % 8 == 0) return launch_copy_typed<uint64_t>(dst, src, bytes / 8, stream);
  if (bits % 4 == 0) return launch_copy_typed<uint32_t>(dst, src, bytes / 4, stream);
  if (bits % 2 == 0) return launch_copy_typed<uint16_t>(dst, src, bytes / 2, stream);
  return launch_copy_typed<uint8_t>(dst, src, bytes, stream);
}

}  // namespace gpucoll::cuda
