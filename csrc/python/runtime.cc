// Build information, the CUDA driver/runtime probe and the NCCL loader, as plain dicts for gpucoll.cli.info and
// gpucoll._nccl. Nothing here raises for a missing GPU, driver or NCCL: those are states with reasons.
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "device/cuda_probe.h"
#include "backends/nccl/nccl_loader.h"
#include "core/error.h"
#include "python/bindings.h"

#ifdef GPUCOLL_WITH_CUDA
#include "device/cuda/cuda_runtime_info.h"
#endif
#ifdef GPUCOLL_CUDA_EMULATION
#include <gpucoll_emu/api.h>

#include "emulation/configure.h"
#endif

namespace py = pybind11;

namespace gpucoll::python {
namespace {

std::string compiler_string() {
#if defined(__clang__)
  return std::string("Clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("GCC ") + __VERSION__;
#else
  return "unknown";
#endif
}

py::dict build_info() {
  py::dict d;
#ifdef GPUCOLL_VERSION_INFO
  d["version"] = GPUCOLL_VERSION_INFO;
#else
  d["version"] = py::none();
#endif
#ifdef GPUCOLL_WITH_CUDA
  d["cuda_built"] = true;
  d["cuda_runtime_version"] = gpucoll::cuda::runtime_version();
#else
  d["cuda_built"] = false;
  d["cuda_runtime_version"] = py::none();
#endif
#ifdef GPUCOLL_CUDA_EMULATION
  d["cuda_emulated"] = true;
#else
  d["cuda_emulated"] = false;
#endif
#ifdef GPUCOLL_CUDA_ARCHS
  d["cuda_archs"] = GPUCOLL_CUDA_ARCHS;
#else
  d["cuda_archs"] = "";
#endif
  d["compiler"] = compiler_string();
  return d;
}

py::dict cuda_probe_dict() {
  CudaProbe probe;
  int runtime_version = 0;
  int runtime_count = 0;
  std::string runtime_why;
  {
    // cuInit and the runtime's first call can take a second on a large machine; other threads may run.
    py::gil_scoped_release release;
    probe = cuda_probe();
#ifdef GPUCOLL_WITH_CUDA
    runtime_version = gpucoll::cuda::runtime_version();
    // The runtime's own view, asked even without a driver (it then answers cudaErrorInsufficientDriver):
    // it is what kernels launched by this build will see, e.g. a driver too old for the runtime.
    runtime_count = gpucoll::cuda::device_count(&runtime_why);
#endif
  }
  py::dict d;
  d["driver_available"] = probe.driver_available;
  d["emulated"] = probe.emulated;
  d["driver_path"] = probe.driver_path;
  d["driver_version"] = probe.driver_version;
  d["driver_version_string"] = cuda_version_string(probe.driver_version);
#ifdef GPUCOLL_WITH_CUDA
  d["runtime_version"] = runtime_version;
  d["runtime_version_string"] = cuda_version_string(runtime_version);
  d["runtime_device_count"] = runtime_count;
  d["runtime_reason"] = runtime_why;
#else
  (void)runtime_version;
  (void)runtime_count;
  d["runtime_version"] = py::none();
  d["runtime_version_string"] = py::none();
  d["runtime_device_count"] = py::none();
  d["runtime_reason"] = "gpucoll was built without CUDA";
#endif
  d["device_count"] = probe.device_count;
  d["reason"] = probe.reason;
  py::list devices;
  for (const CudaDeviceInfo& dev : probe.devices) {
    py::dict e;
    e["index"] = dev.index;
    e["name"] = dev.name;
    e["compute_capability"] = std::to_string(dev.major) + "." + std::to_string(dev.minor);
    e["major"] = dev.major;
    e["minor"] = dev.minor;
    e["total_memory"] = dev.total_memory;
    e["pci_bus_id"] = dev.pci_bus_id;
    devices.append(e);
  }
  d["devices"] = devices;
  return d;
}

py::dict nccl_dict(const NcclLibrary& lib) {
  py::dict d;
  d["attempted"] = lib.attempted;
  d["loaded"] = lib.loaded;
  d["path"] = lib.path;
  d["source"] = lib.source;
  d["version"] = lib.version;
  d["version_string"] = lib.version_string;
  d["min_version_string"] = nccl_version_string(kNcclMinVersion);
  d["reason"] = lib.reason;
  py::list tried;
  for (const auto& t : lib.tried) tried.append(py::make_tuple(t.first, t.second));
  d["tried"] = tried;
  d["missing_optional"] = lib.missing_optional;
  return d;
}

}  // namespace

void bind_runtime(py::module_& m) {
#ifdef GPUCOLL_CUDA_EMULATION
  // Before any CUDA call of this process (the first one fixes the emulated device's shape).
  emulation::configure_from_registry();
  m.def("emulator_config", []() {
    gpucoll_emu_config c;
    gpucoll_emu_get_config(&c);
    py::dict d;
    d["devices"] = c.devices;
    d["sms"] = c.sms;
    d["blocks_per_sm"] = c.blocks_per_sm;
    d["compute_capability"] = std::to_string(c.cc_major) + "." + std::to_string(c.cc_minor);
    d["p2p"] = c.p2p != 0;
    d["memory"] = c.memory;
    d["jitter_us"] = c.jitter_ns / 1000;
    d["seed"] = c.seed;
    d["shuffle_threads"] = c.shuffle_threads != 0;
    d["host_fence"] = c.host_fence != 0;
    d["name"] = gpucoll_emu_device_name();
    return d;
  }, "The emulated CUDA device's shape (GPUCOLL_CUDA=emulate builds).");
  m.def("emulator_counts", []() {
    gpucoll_emu_counts c;
    gpucoll_emu_get_counts(&c);
    py::dict d;
    d["streams"] = c.streams;
    d["events"] = c.events;
    d["allocations"] = c.allocations;
    d["ipc_mappings"] = c.ipc_mappings;
    d["graphs"] = c.graphs;
    d["graph_execs"] = c.graph_execs;
    return d;
  }, "What the emulated CUDA runtime holds right now (tests of teardown).");
#endif
  m.def("build_info", &build_info, "How this gpucoll._C was built: version, cuda_built, cuda_emulated, cuda_archs, compiler.");
  m.def("cuda_probe", &cuda_probe_dict,
        "CUDA driver and runtime state: versions, device_count, reason (why 0), devices. Never raises.");
  m.def(
      "nccl_load",
      [](const std::vector<std::string>& candidates) {
        NcclLibrary lib;
        {
          py::gil_scoped_release release;  // dlopen of NCCL maps a few hundred MB
          lib = nccl_load(candidates);
        }
        return nccl_dict(lib);
      },
      py::arg("candidates") = std::vector<std::string>{},
      "Load NCCL once (GPUCOLL_NCCL_LIBRARY, the process, the given wheel paths, the system) and return the "
      "state. Never raises for a missing NCCL.");
  m.def("nccl_state", []() { return nccl_dict(nccl_state()); }, "The NCCL loader's state, without loading.");

  // Test hooks: exercise the loaded function table and nccl_check's messages without a GPU.
  m.def(
      "_nccl_check",
      [](int result, const std::string& call) {
        return static_cast<int>(
            nccl_check(static_cast<ncclResult_t>(result), call.c_str(), nullptr, __FILE__, __LINE__));
      },
      py::arg("result"), py::arg("call"));
  m.def("_nccl_unique_id", []() {
    const NcclLibrary& lib = nccl_require();
    ncclUniqueId id;
    GPUCOLL_NCCL_CALL(lib, ncclGetUniqueId, &id);
    return py::bytes(id.internal, sizeof(id.internal));
  });
  m.def("_nccl_smoke_init", []() {
    // A one-rank communicator on the current device, destroyed at once: with a GPU this proves the table
    // drives a real NCCL; without one it fails with ncclUnhandledCudaError through nccl_check.
    const NcclLibrary& lib = nccl_require();
    ncclUniqueId id;
    GPUCOLL_NCCL_CALL(lib, ncclGetUniqueId, &id);
    ncclComm_t comm = nullptr;
    {
      py::gil_scoped_release release;
      nccl_check(lib.fn.ncclCommInitRank(&comm, 1, id, 0), "ncclCommInitRank", nullptr, __FILE__, __LINE__);
    }
    int count = 0;
    GPUCOLL_NCCL_CALL(lib, ncclCommCount, comm, &count);
    GPUCOLL_NCCL_CALL(lib, ncclCommDestroy, comm);
    return count;
  });
}

}  // namespace gpucoll::python
