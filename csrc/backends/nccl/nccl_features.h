// Which features the loaded NCCL has, as pure functions of its version code, and the encoding of
// premul_sum scalars. Kept apart from the communicator (nccl_cuda/) so that this logic builds and is tested
// without CUDA: the checks run before anything touches a GPU, and tests feed them fake versions.
#pragma once

#include <cstdint>
#include <string>

#include "core/types.h"

namespace gpucoll {

// NCCL_VERSION(2,24,0): ncclFloat8e4m3 / ncclFloat8e5m2.
constexpr int kNcclFp8Version = 22400;
// NCCL_VERSION(2,28,0): ncclAlltoAll, ncclGather, ncclScatter. gpucoll decides by the symbols' presence
// (nccl_api.h marks them optional); this constant is for messages.
constexpr int kNcclNativeAllToAllVersion = 22800;
// NCCL_VERSION(2,30,0): several ranks on one GPU when NCCL_MULTI_RANK_GPU_ENABLE=1.
constexpr int kNcclMultiRankGpuVersion = 23000;

// The oldest NCCL that handles `t` (0: every NCCL gpucoll loads).
int nccl_dtype_min_version(DType t);

// Throws Unsupported naming the dtype, the loaded NCCL version and the version it needs when `version`
// (an ncclGetVersion code) is too old for `t`.
void nccl_check_dtype(DType t, int version);

bool nccl_multi_rank_gpu_supported(int version);

// The bytes NCCL's ncclRedOpCreatePreMulSum reads for `scalar` in element type `t` (host-immediate
// residence: a scalar of the reduction's own type), written to `out` (8 bytes; returns how many are used).
// Throws InvalidArgument for a non-finite scalar, a fractional or out-of-range scalar for an integer type, and
// one that overflows a floating type (fp8 included: rounded to nearest even, never saturated).
size_t premul_scalar_bytes(DType t, double scalar, unsigned char out[8]);

}  // namespace gpucoll
