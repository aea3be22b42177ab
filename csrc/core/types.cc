#include "core/types.h"

#include <cstring>

namespace gpucoll {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF32:
      return "float32";
    case DType::kF64:
      return "float64";
    case DType::kI8:
      return "int8";
    case DType::kU8:
      return "uint8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
    case DType::kF8E5M2:
      return "float8_e5m2";
  }
  return "?";
}

const char* dtype_nccl_name(DType t) {
  switch (t) {
    case DType::kF16:
      return "half";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF32:
      return "float";
    case DType::kF64:
      return "double";
    case DType::kI8:
      return "int8";
    case DType::kU8:
      return "uint8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kF8E4M3:
      return "f8e4m3";
    case DType::kF8E5M2:
      return "f8e5m2";
  }
  return "?";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "sum";
    case RedOp::kProd:
      return "prod";
    case RedOp::kMin:
      return "min";
    case RedOp::kMax:
      return "max";
    case RedOp::kAvg:
      return "avg";
  }
  return "?";
}

namespace {
struct Alias {
  const char* name;
  DType type;
};
const Alias kDTypeAliases[] = {
    {"float16", DType::kF16}, {"f16", DType::kF16},      {"half", DType::kF16},     {"bfloat16", DType::kBF16},
    {"bf16", DType::kBF16},   {"float32", DType::kF32},  {"f32", DType::kF32},      {"float", DType::kF32},
    {"float64", DType::kF64}, {"f64", DType::kF64},      {"double", DType::kF64},   {"int8", DType::kI8},
    {"i8", DType::kI8},       {"uint8", DType::kU8},     {"u8", DType::kU8},        {"int32", DType::kI32},
    {"i32", DType::kI32},     {"int", DType::kI32},      {"int64", DType::kI64},    {"i64", DType::kI64},
    {"float8_e4m3fn", DType::kF8E4M3}, {"f8e4m3", DType::kF8E4M3}, {"fp8_e4m3", DType::kF8E4M3},
    {"float8_e5m2", DType::kF8E5M2},   {"f8e5m2", DType::kF8E5M2}, {"fp8_e5m2", DType::kF8E5M2},
};
}  // namespace

bool parse_dtype(const char* name, DType* out) {
  for (const Alias& a : kDTypeAliases) {
    if (std::strcmp(a.name, name) == 0) {
      *out = a.type;
      return true;
    }
  }
  return false;
}

bool parse_redop(const char* name, RedOp* out) {
  for (int i = 0; i < kNumRedOps; ++i) {
    if (std::strcmp(redop_name(static_cast<RedOp>(i)), name) == 0) {
      *out = static_cast<RedOp>(i);
      return true;
    }
  }
  return false;
}

}  // namespace gpucoll
