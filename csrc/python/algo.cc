#include <pybind11/stl.h>

#include "algo/registry.h"
#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {
const algo::Algorithm& get_algorithm(const std::string& name) {
  const algo::Algorithm* a = algo::find_algorithm(name);
  if (a == nullptr) GPUCOLL_INVALID_ARG("unknown algorithm '", name, "'");
  return *a;
}
}  // namespace

void bind_algo(py::module_& m) {
  m.def("algorithm_names", []() {
    std::vector<std::string> names;
    for (const algo::Algorithm* a : algo::algorithms()) names.emplace_back(a->name);
    return names;
  });
  m.def(
      "algorithm_supports",
      [](const std::string& name, int coll) { return get_algorithm(name).supports(static_cast<algo::Coll>(coll)); },
      py::arg("name"), py::arg("coll"));
  m.def("coll_names", []() {
    std::vector<std::string> names;
    for (int i = 0; i < algo::kNumColls; ++i) names.emplace_back(algo::coll_name(static_cast<algo::Coll>(i)));
    return names;
  });
}

}  // namespace gpucoll::python
