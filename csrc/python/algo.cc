#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

void bind_algo(py::module_&) {}

}  // namespace gpucoll::python
