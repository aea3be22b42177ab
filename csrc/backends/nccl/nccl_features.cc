#include "backends/nccl/nccl_features.h"

#include "backends/nccl/nccl_loader.h"
#include "core/error.h"

namespace gpucoll {

int nccl_dtype_min_version(DType t) { return dtype_is_fp8(t) ? kNcclFp8Version : 0; }

void nccl_check_dtype(DType t, int version) {
  const int needed = nccl_dtype_min_version(t);
  if (version >= needed) return;
  GPUCOLL_THROW(ErrorCode::kUnsupported, "", dtype_name(t), " needs NCCL >= ", nccl_version_string(needed),
                " (and a GPU of compute capability 9.0 or newer); the loaded NCCL is ", nccl_version_string(version),
                ". Install a newer one (pip install -U nvidia-nccl-cu13) or point GPUCOLL_NCCL_LIBRARY at it.");
}

bool nccl_multi_rank_gpu_supported(int version) { return version >= kNcclMultiRankGpuVersion; }


}  // namespace gpucoll
