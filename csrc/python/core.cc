#include <pybind11/stl.h>

#include "core/config.h"
#include "core/log.h"
#include "core/types.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

void bind_core(py::module_& m) {
  py::enum_<DType>(m, "DType")
      .value("float16", DType::kF16)
      .value("bfloat16", DType::kBF16)
      .value("float32", DType::kF32)
      .value("float64", DType::kF64)
      .value("int8", DType::kI8)
      .value("uint8", DType::kU8)
      .value("int32", DType::kI32)
      .value("int64", DType::kI64)
      .value("float8_e4m3fn", DType::kF8E4M3)
      .value("float8_e5m2", DType::kF8E5M2);
  py::enum_<RedOp>(m, "RedOp")
      .value("sum", RedOp::kSum)
      .value("prod", RedOp::kProd)
      .value("min", RedOp::kMin)
      .value("max", RedOp::kMax)
      .value("avg", RedOp::kAvg);
  m.def("dtype_size", [](DType t) { return dtype_size(t); });
  m.def("dtype_nccl_name", [](DType t) { return std::string(dtype_nccl_name(t)); });
  m.def("dtype_is_floating", [](DType t) { return dtype_is_floating(t); });

  m.def("config_vars", []() {
    py::list out;
    for (const ConfigVar& v : config_vars()) {
      py::dict d;
      d["name"] = v.name;
      d["type"] = var_type_name(v.type);
      d["default"] = v.default_value;
      d["description"] = v.description;
      d["value"] = v.type == VarType::kSecret ? std::string(config_is_set(v.name) ? "(hidden)" : "")
                                              : config_raw(v.name);
      d["is_set"] = config_is_set(v.name);
      out.append(d);
    }
    return out;
  });
  m.def("config_raw", &config_raw, py::arg("name"));
  m.def("config_is_set", &config_is_set, py::arg("name"));
  m.def("config_bool", &config_bool, py::arg("name"));
  m.def("config_int", &config_int, py::arg("name"));
  m.def("config_bytes", &config_bytes, py::arg("name"));
  m.def("config_float", &config_float, py::arg("name"));
  m.def(
      "parse_bytes",
      [](const std::string& text) {
        int64_t v = 0;
        if (!parse_bytes(text, &v)) {
          GPUCOLL_INVALID_ARG("'", text, "' is not a size (expected e.g. 8, 64K, 1M, 2G)");
        }
        return v;
      },
      py::arg("text"));

  m.def("log_level", []() { return static_cast<int>(log_level()); });
  m.def("set_log_rank", &set_log_rank, py::arg("rank"));
  // force: written whatever GPUCOLL_LOG_LEVEL says (what a variable asked for by name, as GPUCOLL_STRAGGLER_REPORT).
  m.def(
      "log",
      [](int level, const std::string& message, bool force) {
        if (force || level <= static_cast<int>(log_level())) log_write(static_cast<LogLevel>(level), message);
      },
      py::arg("level"), py::arg("message"), py::arg("force") = false);
}

}  // namespace gpucoll::python
