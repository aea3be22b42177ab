#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "gpucoll native core (private; use the gpucoll package)";
  gpucoll::python::bind_errors(m);
  gpucoll::python::bind_core(m);
  gpucoll::python::bind_work(m);
  gpucoll::python::bind_host(m);
  gpucoll::python::bind_host_coalesced(m);
  gpucoll::python::bind_trace(m);
  gpucoll::python::bind_algo(m);
  gpucoll::python::bind_runtime(m);
  gpucoll::python::bind_nccl(m);
  gpucoll::python::bind_topo(m);
  gpucoll::python::bind_custom(m);
  gpucoll::python::bind_device_memory(m);
}
