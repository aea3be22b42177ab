#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

void bind_runtime(py::module_&) {}

}  // namespace gpucoll::python
