// premul_sum scalars: the bytes of `scalar` in a reduction's element type, as NCCL's ncclRedOpCreatePreMulSum reads
// them (host-immediate residence) and as the host backend multiplies each input by (core/dispatch.h premul). One
// conversion for both, so that the two backends scale by the same value.
#pragma once

#include <cstddef>

#include "core/types.h"

namespace gpucoll {

// Writes the scalar to `out` (8 bytes; returns how many are used). Throws InvalidArgument for a non-finite scalar,
// a fractional or out-of-range scalar for an integer type, and one that overflows a floating type (fp8 included:
// rounded to nearest even, never saturated). f16/bf16 go through float first, as NCCL's own avg scalar does.
size_t premul_scalar_bytes(DType t, double scalar, unsigned char out[8]);

}  // namespace gpucoll
