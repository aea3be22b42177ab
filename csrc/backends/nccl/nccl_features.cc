#include "backends/nccl/nccl_features.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "backends/nccl/nccl_loader.h"
#include "core/error.h"
#include "core/half.h"

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

namespace {

template <class T>
size_t store_integer(double scalar, DType t, unsigned char out[8]) {
  // An integer reduction multiplies by an integer: 0.5 would silently become 0, so say so instead.
  if (scalar != std::floor(scalar)) {
    GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " is not an integer, but the reduction is over ", dtype_name(t),
                        " elements; use an integer scalar or a floating dtype");
  }
  // Compare in double against the exact bounds; int64's max is not representable, so its bound is 2^63.
  const double lo = static_cast<double>(std::numeric_limits<T>::min());
  const double hi_exclusive = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
  if (scalar < lo || scalar >= hi_exclusive) {
    GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " does not fit in ", dtype_name(t));
  }
  const T v = static_cast<T>(scalar);
  std::memcpy(out, &v, sizeof(T));
  return sizeof(T);
}

}  // namespace

size_t premul_scalar_bytes(DType t, double scalar, unsigned char out[8]) {
  std::memset(out, 0, 8);
  if (!std::isfinite(scalar)) GPUCOLL_INVALID_ARG("premul_sum scalar must be finite; got ", scalar);
  switch (t) {
    case DType::kF16: {
      // double -> float -> half rounds twice; for a scale factor the last-bit difference this can make in
      // rare halfway cases is immaterial, and it is what torch's own f16 scalar conversion does.
      const f16_t h = f16_from_float(static_cast<float>(scalar));
      if (!std::isfinite(to_float(h))) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows float16");
      std::memcpy(out, &h.bits, 2);
      return 2;
    }
    case DType::kBF16: {
      const bf16_t b = bf16_from_float(static_cast<float>(scalar));
      if (!std::isfinite(to_float(b))) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows bfloat16");
      std::memcpy(out, &b.bits, 2);
      return 2;
    }
    case DType::kF32: {
      const float f = static_cast<float>(scalar);
      if (!std::isfinite(f)) GPUCOLL_INVALID_ARG("premul_sum scalar ", scalar, " overflows float32");
      std::memcpy(out, &f, 4);
      return 4;
    }
    case DType::kF64:
      std::memcpy(out, &scalar, 8);
      return 8;
    case DType::kI8:
      return store_integer<int8_t>(scalar, t, out);
    case DType::kU8:
      return store_integer<uint8_t>(scalar, t, out);
    case DType::kI32:
      return store_integer<int32_t>(scalar, t, out);
    case DType::kI64:
      return store_integer<int64_t>(scalar, t, out);
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      break;
  }
  GPUCOLL_THROW(ErrorCode::kUnsupported, "", "premul_sum on ", dtype_name(t),
                " is not supported (gpucoll has no fp8 scalar rounding); scale in a wider dtype");
}

}  // namespace gpucoll
