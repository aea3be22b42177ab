// The launch plumbing shared by the custom kernels: the dtype x op subset they are instantiated for (through
// core/dispatch.h, the one dispatch), argument checks, the launch itself and the occupancy query.
//
// A kernel file defines a struct with `template <class T, class Op, class Fin> static auto kernel()` returning a
// pointer to its __global__ function, whose parameters must be (AllReduceArgs, Op, Fin). The pointer stays typed
// down to cudaLaunchKernel and the occupancy query (their C++ overloads): nvcc does not need the type, but the
// emulated device (csrc/emulation/) learns from it how to pass the parameters, which nvcc's registration of
// __global__ functions tells NVIDIA's runtime.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "backends/custom/eligibility.h"
#include "core/dispatch.h"
#include "backends/custom/kernels/custom_allreduce.h"
#include "backends/custom/kernels/primitives.cuh"

namespace gpucoll::cuda::custom {

template <class T>
constexpr bool kHasKernel = std::is_same<T, float>::value || std::is_same<T, f16_t>::value ||
                            std::is_same<T, bf16_t>::value || std::is_same<T, double>::value ||
                            std::is_same<T, int32_t>::value;

// f(TypeTag<T>, Op, Fin) for the kernels' (dtype, op); cudaErrorInvalidValue for the others. avg runs as sum
// with AvgFinish: its pre-op on every floating input, its finish on every integer sum (as the host backend and
// NCCL do).
template <class F>
cudaError_t dispatch_custom(DType dtype, RedOp op, int nranks, F&& f) {
  if (!gpucoll::custom::dtype_supported(dtype) || !gpucoll::custom::op_supported(op)) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (!kHasKernel<T>) {
      return cudaErrorInvalidValue;
    } else {
      if (op == RedOp::kAvg) return f(tag, OpSum{}, AvgFinish{nranks});
      return dispatch_op(op, [&](auto fn) -> cudaError_t {
        if constexpr (std::is_same<decltype(fn), OpProd>::value) {
          return cudaErrorInvalidValue;
        } else {
          return f(tag, fn, NoFinish{});
        }
      });
    }
  });
}

inline bool args_valid(const AllReduceArgs& a, bool needs_staging) {
  if (a.nranks < 1 || a.nranks > kMaxRanks || a.rank < 0 || a.rank >= a.nranks) return false;
  if (a.blocks < 1 || a.blocks > kMaxBlocks || a.threads < a.nranks || a.threads > kThreads) return false;
  if (a.count > 0 && (a.in == nullptr || a.out == nullptr)) return false;
  for (int q = 0; q < a.nranks; ++q) {
    if (a.bufs.ptr[q] == nullptr || a.sigs.ptr[q] == nullptr) return false;
  }
  const size_t bytes = a.count * dtype_size(a.dtype);
  return !needs_staging || bytes <= a.half_bytes;
}

template <class K>
cudaError_t launch_kernel(const AllReduceArgs& a, bool needs_staging, cudaStream_t stream) {
  if (!args_valid(a, needs_staging)) return cudaErrorInvalidValue;
  return dispatch_custom(a.dtype, a.op, a.nranks, [&](auto tag, auto op, auto fin) -> cudaError_t {
    using T = typename decltype(tag)::type;
    const auto kernel = K::template kernel<T, decltype(op), decltype(fin)>();
    AllReduceArgs args = a;
    void* params[] = {&args, &op, &fin};
    return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(a.blocks)), dim3(static_cast<unsigned>(a.threads)),
                            params, 0, stream);
  });
}

template <class K>
cudaError_t kernel_blocks_per_sm(DType dtype, RedOp op, int* out) {
  if (out == nullptr) return cudaErrorInvalidValue;
  return dispatch_custom(dtype, op, 1, [&](auto tag, auto fn, auto fin) -> cudaError_t {
    using T = typename decltype(tag)::type;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, K::template kernel<T, decltype(fn), decltype(fin)>(),
                                                         kThreads, 0);
  });
}

}  // namespace gpucoll::cuda::custom
