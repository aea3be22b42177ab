// Host launchers of the element-wise CUDA kernels (reduce.cu). Plain C++ can include this header; it needs
// the CUDA include directory, which linking gpucoll_cuda provides.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/types.h"

namespace gpucoll::cuda {

// dst[i] = op(a[i], b[i]) for i < count, enqueued on `stream`. RedOp::kAvg is avg over `avg_divisor` ranks as
// core/dispatch.h defines it (floating: a[i]/n + b[i]/n, each pre-multiplied; integer: (a[i] + b[i]) / n); other
// ops ignore avg_divisor. dst may equal a
// or b (in place) but must not partially overlap them. Pointers must be aligned to the element size.
// Returns cudaErrorInvalidValue for a bad dtype/op, null pointer, misaligned pointer or avg_divisor < 1,
// otherwise the launch's status; count == 0 launches nothing.
cudaError_t launch_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op,
                          cudaStream_t stream, int avg_divisor = 1);

// dst[i] = src[i] for i < count elements of `dtype`; the ranges must not overlap. Same error rules.
cudaError_t launch_copy(void* dst, const void* src, size_t count, DType dtype, cudaStream_t stream);

}  // namespace gpucoll::cuda
