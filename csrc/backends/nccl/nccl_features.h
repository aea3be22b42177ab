// Which features the loaded NCCL has, as pure functions of its version code (premul_sum scalars: core/premul.h).
// Kept apart from the communicator (nccl/cuda/) so that this logic builds and is tested
// without CUDA: the checks run before anything touches a GPU, and tests feed them fake versions.
#pragma once

#include <cstdint>
#include <string>

#include "core/premul.h"  // premul_scalar_bytes, for the NCCL backend
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

}  // namespace gpucoll
