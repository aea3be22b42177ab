// The single translation point from gpucoll::Error to gpucoll.errors: every bound function raises through
// here, so the Python class, message, failing call, location and ranks are consistent everywhere.
#include <pybind11/stl.h>

#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

void bind_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      py::gil_scoped_acquire gil;
      py::module_ errors = py::module_::import("gpucoll.errors");
      py::object cls = errors.attr("error_class_for_code")(static_cast<int>(e.code()));
      py::object exc = cls(e.message(), py::arg("call") = e.call(), py::arg("location") = e.location(),
                           py::arg("ranks") = py::cast(e.ranks()));
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
  // Lets tests check the translation of every code without provoking each failure for real.
  m.def(
      "_raise_error",
      [](int code, const std::string& message, const std::string& call, std::vector<int> ranks) {
        throw Error(static_cast<ErrorCode>(code), message, call, __FILE__, __LINE__, std::move(ranks));
      },
      py::arg("code"), py::arg("message"), py::arg("call") = "", py::arg("ranks") = std::vector<int>{});
  m.def("error_code_names", []() {
    py::dict d;
    for (int c = 1; c <= 9; ++c) d[py::int_(c)] = error_code_name(static_cast<ErrorCode>(c));
    return d;
  });
}

}  // namespace gpucoll::python
