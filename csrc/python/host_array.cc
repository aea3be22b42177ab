// The host memory of a NumPy array or a CPU torch.Tensor, read in C++ for the host backend's one-call path
// (HostComm.all_reduce_array; gpucoll/backends/host.py fast_all_reduce and the torch process group's
// dist.all_reduce). The Python resolution of either (gpucoll/_buffers.py, or Tensor.numpy() and its checks)
// costs more than an 8-byte all_reduce on two ranks.
//
// torch is read through its Python methods, never its headers: gpucoll builds and imports without torch, and the
// torch of the GPU machines (2.11) is not the one here (2.13). Only exact torch.Tensor and nn.Parameter objects
// are read: a subclass (DTensor, FakeTensor, a functional wrapper) may mean anything by its storage, so it takes
// the general path. Neither module is imported here; an object of a type from a module nobody imported cannot
// exist.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {
namespace {

// Borrowed for the process's life: torch's classes and singletons never die before the interpreter does.
struct Torch {
  PyTypeObject* tensor = nullptr;
  PyTypeObject* parameter = nullptr;
  PyObject* strided = nullptr;
  PyObject* dtypes[kNumDTypes] = {};
};

const char* const kTorchDTypeNames[kNumDTypes] = {"float16", "bfloat16", "float32", "float64",
                                                  "int8",    "uint8",    "int32",   "int64"};

// torch's pieces once torch is imported (nullptr before: the caller's object is then no tensor). A torch
// without one of them leaves the reader off for good: every tensor takes the general path.
const Torch* torch_types() {
  static Torch t;
  static bool looked = false;
  if (looked) return t.tensor != nullptr ? &t : nullptr;
  PyObject* mod = PyImport_GetModule(py::str("torch").ptr());
  if (mod == nullptr) {
    PyErr_Clear();
    return nullptr;  // not imported yet: ask again next time
  }
  const py::object torch = py::reinterpret_steal<py::object>(mod);
  looked = true;
  try {
    Torch found;
    const py::object tensor = torch.attr("Tensor");
    const py::object parameter = torch.attr("nn").attr("Parameter");
    if (!PyType_Check(tensor.ptr()) || !PyType_Check(parameter.ptr())) return nullptr;
    found.tensor = reinterpret_cast<PyTypeObject*>(tensor.ptr());
    found.parameter = reinterpret_cast<PyTypeObject*>(parameter.ptr());
    found.strided = torch.attr("strided").ptr();
    for (int i = 0; i < kNumDTypes; ++i) found.dtypes[i] = torch.attr(kTorchDTypeNames[i]).ptr();
    t = found;
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    return nullptr;
  }
  return &t;
}

PyTypeObject* numpy_ndarray() {
  static PyTypeObject* type = nullptr;
  if (type != nullptr) return type;
  PyObject* mod = PyImport_GetModule(py::str("numpy").ptr());
  if (mod == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const py::object numpy = py::reinterpret_steal<py::object>(mod);
  PyObject* nd = PyObject_GetAttrString(numpy.ptr(), "ndarray");
  if (nd == nullptr || !PyType_Check(nd)) {
    Py_XDECREF(nd);
    PyErr_Clear();
    return nullptr;
  }
  type = reinterpret_cast<PyTypeObject*>(nd);  // kept: the class outlives every call
  return type;
}

// The DType of a native-order buffer-protocol format, for the formats NumPy gives the dtypes the host backend
// reduces; false for anything else (the caller then takes the Python path, which names the problem).
bool format_dtype(const char* format, Py_ssize_t itemsize, DType* out) {
  if (format == nullptr || format[0] == '\0' || format[1] != '\0') return false;
  switch (format[0]) {
    case 'e': *out = DType::kF16; return itemsize == 2;
    case 'f': *out = DType::kF32; return itemsize == 4;
    case 'd': *out = DType::kF64; return itemsize == 8;
    case 'b': *out = DType::kI8; return itemsize == 1;
    case 'B': *out = DType::kU8; return itemsize == 1;
    case 'i': case 'l': case 'q':
      if (itemsize == 4) *out = DType::kI32;
      else if (itemsize == 8) *out = DType::kI64;
      else return false;
      return true;
    default: return false;
  }
}

// The names read below, made once (PyObject_GetAttrString would make a string per call: most of the read's cost).
enum Name { kLayout, kIsCpu, kIsContiguous, kIsNeg, kDtype, kNumel, kDataPtr, kNumNames };
PyObject* name(Name n) {
  static PyObject* names[kNumNames] = {};
  if (names[n] == nullptr) {
    static const char* const text[kNumNames] = {"layout", "is_cpu", "is_contiguous", "is_neg",
                                                "dtype",  "numel",  "data_ptr"};
    names[n] = PyUnicode_InternFromString(text[n]);  // kept for the process's life
  }
  return names[n];
}

// `n` of `x` (an attribute when `call` is false, else the method called without arguments); nullptr, with no
// Python error left set, where that fails.
py::object get(PyObject* x, Name n, bool call) {
  PyObject* r = call ? PyObject_CallMethodNoArgs(x, name(n)) : PyObject_GetAttr(x, name(n));
  if (r == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(r);
}

bool is_true(PyObject* x, Name n, bool call) {
  const py::object v = get(x, n, call);
  return v.ptr() == Py_True;
}

bool tensor_view(PyObject* x, const Torch& torch, HostArrayView* out) {
  // What a plain tensor is: of a dtype the host backend reduces (not complex, and so never a lazy conjugate),
  // strided, on the CPU, contiguous, without lazy negation (its memory would hold -x).
  const py::object dtype = get(x, kDtype, false);
  int found = -1;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (dtype.ptr() == torch.dtypes[i]) found = i;
  }
  if (found < 0) return false;
  const py::object layout = get(x, kLayout, false);
  if (layout.ptr() != torch.strided || !is_true(x, kIsCpu, false) || !is_true(x, kIsContiguous, true) ||
      is_true(x, kIsNeg, true)) {
    return false;
  }
  const py::object numel = get(x, kNumel, true);
  const py::object ptr = get(x, kDataPtr, true);
  if (!numel || !ptr || !PyLong_Check(numel.ptr()) || !PyLong_Check(ptr.ptr())) return false;
  const long long count = PyLong_AsLongLong(numel.ptr());
  const unsigned long long addr = PyLong_AsUnsignedLongLong(ptr.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (count <= 0 || addr == 0) return false;
  out->data = reinterpret_cast<void*>(static_cast<uintptr_t>(addr));
  out->count = count;
  out->dtype = static_cast<DType>(found);
  return true;
}

// The leading fields of NumPy's array and dtype objects, as NumPy's C API lays them out (PyArrayObject_fields,
// PyArray_Descr). Extension modules built against any NumPy since 1.7 read these fields through inline functions,
// so NumPy cannot move them without breaking every such module (NumPy 2 kept them; what it changed in the dtype
// lies after type_num). Read directly, an array costs a few loads; the buffer protocol, which fills a Py_buffer
// and its format string, costs about 40 ns, which all_reduce_coalesced pays once per array: 40 us for the
// thousand arrays of a fused DDP bucket, a fifth of the fused 1 MiB all-reduce itself (bench/fusion.py).
// Checked once against the buffer protocol (numpy_layout_ok); a NumPy that disagrees is read the slow way.
struct NpyDescrHead {
  PyObject_HEAD
  PyTypeObject* typeobj;
  char kind;
  char type;
  char byteorder;
  char former_flags;
  int type_num;
};
struct NpyArrayHead {
  PyObject_HEAD
  char* data;
  int nd;
  Py_ssize_t* dimensions;
  Py_ssize_t* strides;
  PyObject* base;
  NpyDescrHead* descr;
  int flags;
};
constexpr int kNpyCContiguous = 0x0001;
constexpr int kNpyWriteable = 0x0400;
constexpr unsigned kNpyWarnOnWrite = 0x80000000u;  // a view that warns on write: let NumPy's own export decide

bool numpy_struct_view(PyObject* o, void** data, int64_t* count, DType* dtype) {
  const auto* a = reinterpret_cast<const NpyArrayHead*>(o);
  const auto flags = static_cast<unsigned>(a->flags);
  if ((flags & kNpyCContiguous) == 0 || (flags & kNpyWriteable) == 0 || (flags & kNpyWarnOnWrite) != 0) return false;
  const NpyDescrHead* d = a->descr;
  if (d == nullptr || (d->byteorder != '=' && d->byteorder != '|' && d->byteorder != '<')) return false;
  switch (d->type_num) {  // NumPy's type numbers (NPY_BYTE ... NPY_HALF), fixed since NumPy 1.0
    case 1: *dtype = DType::kI8; break;
    case 2: *dtype = DType::kU8; break;
    case 5: *dtype = DType::kI32; break;  // NPY_INT: C int
    case 7: *dtype = sizeof(long) == 8 ? DType::kI64 : DType::kI32; break;  // NPY_LONG
    case 9: *dtype = DType::kI64; break;  // NPY_LONGLONG
    case 11: *dtype = DType::kF32; break;
    case 12: *dtype = DType::kF64; break;
    case 23: *dtype = DType::kF16; break;
    default: return false;
  }
  int64_t n = 1;
  for (int i = 0; i < a->nd; ++i) n *= a->dimensions[i];
  if (n <= 0) return false;
  *data = a->data;
  *count = n;
  return true;
}

// Whether the struct reading above agrees with NumPy's own buffer export on arrays of this NumPy, asked once.
bool numpy_layout_ok(PyObject* ndarray_type) {
  static int ok = -1;
  if (ok >= 0) return ok == 1;
  ok = 0;
  try {
    const py::module_ np = py::module_::import("numpy");
    const py::object base = np.attr("arange")(24, py::arg("dtype") = "float32");
    const py::object probes[] = {base, base.attr("reshape")(2, 3, 4)[py::make_tuple(1)],
                                 np.attr("zeros")(5, py::arg("dtype") = "int64"),
                                 np.attr("zeros")(3, py::arg("dtype") = "float16"),
                                 base.attr("reshape")(4, 6).attr("T")};  // not C-contiguous: both decline
    bool agree = true;
    for (const py::object& p : probes) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(p.ptr())) != ndarray_type) return false;
      void* data = nullptr;
      int64_t count = 0;
      DType dtype = DType::kF32;
      const bool mine = numpy_struct_view(p.ptr(), &data, &count, &dtype);
      Py_buffer v{};
      const bool theirs = PyObject_GetBuffer(p.ptr(), &v, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0;
      if (!theirs) PyErr_Clear();
      DType their_dtype = DType::kF32;
      agree = agree && mine == theirs &&
              (!mine || (data == v.buf && count == v.len / v.itemsize &&
                         format_dtype(v.format, v.itemsize, &their_dtype) && their_dtype == dtype));
      if (theirs) PyBuffer_Release(&v);
    }
    ok = agree ? 1 : 0;
  } catch (const py::error_already_set&) {
    PyErr_Clear();
  }
  return ok == 1;
}

}  // namespace

bool HostArrayView::read(py::handle x) {
  release();
  PyObject* o = x.ptr();
  PyTypeObject* type = Py_TYPE(o);
  if (type == numpy_ndarray()) {
    if (numpy_layout_ok(reinterpret_cast<PyObject*>(type))) return numpy_struct_view(o, &data, &count, &dtype);
    if (PyObject_GetBuffer(o, &view_, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      return false;
    }
    held_ = true;
    if (!format_dtype(view_.format, view_.itemsize, &dtype) || view_.len <= 0) {
      release();
      return false;
    }
    data = view_.buf;
    count = static_cast<int64_t>(view_.len / view_.itemsize);
    return true;
  }
  const Torch* torch = torch_types();
  if (torch == nullptr || (type != torch->tensor && type != torch->parameter)) return false;
  return tensor_view(o, *torch, this);
}

void HostArrayView::release() {
  if (held_) PyBuffer_Release(&view_);
  held_ = false;
}

}  // namespace gpucoll::python
