// Host data movement used by the host executor: copies and element-wise reductions through the one dtype x op
// dispatch (core/dispatch.h). Plain loops over restrict pointers: GCC vectorises the f32/f64/integer cases;
// f16/bf16 go through float per element.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace gpucoll::host {

// memcpy for buffers that do not overlap, without glibc's slow case on AMD (kernels.cc).
void copy_bytes(void* dst, const void* src, size_t n) noexcept;
void copy_elems(void* dst, const void* src, int64_t count, DType dtype) noexcept;
// dst[i] = op(dst[i], src[i]); kAvg reduces as a sum (see premul_copy and avg_divide).
void reduce_into(void* dst, const void* src, int64_t count, DType dtype, RedOp op) noexcept;
// dst[i] = op(first, srcs[0][i], ..., srcs[n-1][i]) in one pass, accumulating in the accumulation type and
// rounding once; first is dst[i] itself when include_dst, else srcs[0][i] (then srcs[0] is not re-applied).
// Used when a schedule step reduces several sources into one chunk: one pass reads every source once and
// writes the destination once, instead of reading and writing it per source.
void reduce_multi(void* dst, const void* const* srcs, int nsrcs, bool include_dst, int64_t count, DType dtype,
                  RedOp op) noexcept;
// dst[i] = premul(src[i], *scalar) (core/dispatch.h): the pre-op of avg on floating types and of premul_sum, applied
// while a rank's input is copied into its work buffer. `scalar` points at one element of `dtype`.
void premul_copy(void* dst, const void* src, int64_t count, DType dtype, const void* scalar) noexcept;
// Writes avg's scalar for `n` ranks (avg_scalar, NCCL's 1/n) in `dtype` to `out` (8 bytes) and returns true; false
// for integer types, whose avg divides the finished sum instead (avg_divide).
bool avg_scalar_bytes(DType dtype, int n, unsigned char out[8]) noexcept;
// avg's last step on a finished integer sum: divide by n, truncating toward zero. Floating types: nothing to do.
void avg_divide(void* data, int64_t count, DType dtype, int n) noexcept;

}  // namespace gpucoll::host
