// Element types and reduction operators understood by every backend.
//
// The numeric values of DType and RedOp are part of the Python binding (gpucoll._C.DType) and of the
// schedule data the CUDA kernels read, so new entries go at the end.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/macros.h"

namespace gpucoll {

enum class DType : int32_t {
  kF16 = 0,
  kBF16 = 1,
  kF32 = 2,
  kF64 = 3,
  kI8 = 4,
  kU8 = 5,
  kI32 = 6,
  kI64 = 7,
  // 8-bit floats (OCP FP8: e4m3 without infinities, as torch.float8_e4m3fn, and e5m2). Only NCCL >= 2.24
  // reduces them (on sm_90 and newer); the host backend and gpucoll's own kernels have no arithmetic for
  // them, so they sit after the first kNumDTypes values and the arithmetic dispatch (dispatch.h) rejects them.
  kF8E4M3 = 8,
  kF8E5M2 = 9,
};
// DTypes [0, kNumDTypes) have host and kernel arithmetic; kNumAllDTypes counts the fp8 types too.
constexpr int kNumDTypes = 8;
constexpr int kNumAllDTypes = 10;

enum class RedOp : int32_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  // NCCL's ncclAvg: floating types divide the sum by the world size; integer types sum, then divide with
  // truncation toward zero. Backends reduce with kSum and divide once at the end (see finish_avg), so every
  // rank divides identical sums and gets identical bits.
  kAvg = 4,
};
constexpr int kNumRedOps = 5;

GPUCOLL_HD constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kI8:
    case DType::kU8:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return 1;
  }
  return 0;
}

GPUCOLL_HD constexpr bool dtype_is_fp8(DType t) { return t == DType::kF8E4M3 || t == DType::kF8E5M2; }

GPUCOLL_HD constexpr bool dtype_is_floating(DType t) {
  return t == DType::kF16 || t == DType::kBF16 || t == DType::kF32 || t == DType::kF64 || dtype_is_fp8(t);
}

// Short names used in the Python API, the benchmark table (nccl-tests spells them "half", "bfloat16",
// "float", "double", "int8", "uint8", "int32", "int64") and error messages.
const char* dtype_name(DType t);
const char* dtype_nccl_name(DType t);
const char* redop_name(RedOp op);
// Parse a name ("float32", "f32", "float", "bf16", ...). Returns false when unknown.
bool parse_dtype(const char* name, DType* out);
bool parse_redop(const char* name, RedOp* out);

}  // namespace gpucoll
