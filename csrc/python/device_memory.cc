// Bindings of device memory that gpucoll owns itself (gpucoll.testing.DeviceArray): allocation, copies to and from
// host buffers, and DLPack export. CUDA builds only (real or emulated); elsewhere they raise Unsupported.
#include <Python.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "python/bindings.h"

#ifdef GPUCOLL_WITH_CUDA
#include "device/cuda/device_buffer.h"
#include "device/cuda/cuda_util.h"
#endif

namespace py = pybind11;

namespace gpucoll::python {
namespace {

#ifdef GPUCOLL_WITH_CUDA
// dlpack.h's ABI (v0.8 "dltensor" capsules, which every consumer accepts).
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr int32_t kDLCUDA = 2;

// The tensor, its shape, and a reference to the Python object that owns the memory.
struct Exported {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  PyObject* owner = nullptr;
};

void delete_exported(DLManagedTensor* t) {
  auto* e = static_cast<Exported*>(t->manager_ctx);
  // Consumers may call the deleter from a thread without the GIL.
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_XDECREF(e->owner);
  PyGILState_Release(gil);
  delete e;
}

void capsule_destructor(PyObject* capsule) {
  // Renamed to "used_dltensor" by a consumer that took ownership; still "dltensor" if nobody did.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    t->deleter(t);
  }
}

py::object dlpack_capsule(py::object owner, uintptr_t ptr, const std::vector<int64_t>& shape, int code, int bits,
                          int device) {
  GPUCOLL_CHECK_ARG(code >= 0 && code < 256 && bits > 0 && bits < 256, "bad DLPack dtype (", code, ", ", bits, ")");
  auto e = std::make_unique<Exported>();
  e->shape = shape;
  e->owner = owner.ptr();
  DLTensor& t = e->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = DLDevice{kDLCUDA, device};
  t.ndim = static_cast<int32_t>(e->shape.size());
  t.dtype = DLDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  t.shape = e->shape.data();
  t.strides = nullptr;  // C-contiguous
  t.byte_offset = 0;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = &delete_exported;
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", &capsule_destructor);
  if (capsule == nullptr) throw py::error_already_set();
  Py_INCREF(e->owner);
  e.release();
  return py::reinterpret_steal<py::object>(capsule);
}

// A Python buffer's address and size (NumPy arrays; read-only when `writable` is false).
std::pair<void*, size_t> host_span(const py::buffer& b, bool writable) {
  const py::buffer_info info = b.request(writable);
  return {info.ptr, static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize)};
}
#endif

}  // namespace

void bind_device_memory(py::module_& m) {
#ifdef GPUCOLL_WITH_CUDA
  using cuda::DeviceBuffer;
  py::class_<DeviceBuffer, NoGilHolder<DeviceBuffer>>(m, "DeviceBuffer")
      .def(py::init<size_t, int>(), py::arg("nbytes"), py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("ptr", &DeviceBuffer::ptr)
      .def_property_readonly("nbytes", &DeviceBuffer::bytes)
      .def_property_readonly("device", &DeviceBuffer::device)
      .def("release", &DeviceBuffer::release, py::call_guard<py::gil_scoped_release>());
  m.def(
      "cuda_copy_from_host",
      [](uintptr_t dst, const py::buffer& src, int device) {
        auto [p, n] = host_span(src, false);
        py::gil_scoped_release release;
        cuda::copy_sync(reinterpret_cast<void*>(dst), p, n, device);
      },
      py::arg("dst"), py::arg("src"), py::arg("device"), "Copy a host buffer to device memory (complete on return).");
  m.def(
      "cuda_copy_to_host",
      [](const py::buffer& dst, uintptr_t src, int device) {
        auto [p, n] = host_span(dst, true);
        py::gil_scoped_release release;
        cuda::copy_sync(p, reinterpret_cast<const void*>(src), n, device);
      },
      py::arg("dst"), py::arg("src"), py::arg("device"), "Copy device memory into a host buffer (complete on return).");
  m.def(
      "cuda_copy",
      [](uintptr_t dst, uintptr_t src, size_t n, int device, py::object stream) {
        py::gil_scoped_release release;
        if (stream.is_none()) {
          cuda::copy_sync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, device);
        } else {
          py::gil_scoped_acquire gil;
          const auto s = reinterpret_cast<cudaStream_t>(stream.cast<uintptr_t>());
          py::gil_scoped_release again;
          cuda::copy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, s, device);
        }
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("stream") = py::none(),
      "Copy n bytes between device (or host) addresses: complete on return, or queued on `stream` when given.");
  m.def(
      "cuda_fill",
      [](uintptr_t dst, int byte, size_t n, int device) {
        py::gil_scoped_release release;
        cuda::fill_sync(reinterpret_cast<void*>(dst), byte, n, device);
      },
      py::arg("dst"), py::arg("byte"), py::arg("nbytes"), py::arg("device"), "cudaMemset, complete on return.");
  m.def(
      "cuda_stream_synchronize",
      [](uintptr_t stream, int device) {
        py::gil_scoped_release release;
        cuda::DeviceGuard guard(device);
        GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
      },
      py::arg("stream"), py::arg("device"), "cudaStreamSynchronize of a raw stream handle (0: the legacy stream).");
  m.def(
      "cuda_device_synchronize",
      [](int device) {
        py::gil_scoped_release release;
        cuda::DeviceGuard guard(device);
        GPUCOLL_CUDA_CHECK(cudaDeviceSynchronize());
      },
      py::arg("device"), "cudaDeviceSynchronize on `device`.");
  m.def("dlpack_capsule", &dlpack_capsule, py::arg("owner"), py::arg("ptr"), py::arg("shape"), py::arg("code"),
        py::arg("bits"), py::arg("device"),
        "A 'dltensor' capsule of C-contiguous CUDA memory at `ptr`; keeps `owner` alive until the consumer is done.");
#else
  auto unsupported = [](const py::args&, const py::kwargs&) -> py::object {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "", "gpucoll was built without CUDA: it has no device memory");
  };
  for (const char* name : {"DeviceBuffer", "cuda_copy_from_host", "cuda_copy_to_host", "cuda_copy", "cuda_fill",
                           "cuda_stream_synchronize", "cuda_device_synchronize", "dlpack_capsule"}) {
    m.def(name, unsupported);
  }
#endif
}

}  // namespace gpucoll::python
