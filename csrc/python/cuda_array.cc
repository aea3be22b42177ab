// __cuda_array_interface__ read in C++, for the one-call paths of the GPU backends (gpucoll/backends/nccl.py,
// fast_all_reduce): the Python resolution of such an array (gpucoll/_buffers.py) costs more than the call it
// resolves for. Only the plain case is read here, with the general path's meaning exactly: a C-contiguous,
// writable, unmasked, non-empty array of a type string in this machine's byte order, ordered on its "stream" (or
// the legacy default stream when it names none). Anything else returns false before anything is touched, and the
// general path decides, raising its typed errors.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "type strings are read as little-endian ('<')");

bool typestr_dtype(PyObject* s, DType* out) {
  Py_ssize_t n = 0;
  const char* t = PyUnicode_AsUTF8AndSize(s, &n);
  if (t == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (n != 3 || !(t[0] == '<' || (t[0] == '|' && t[2] == '1'))) return false;
  switch (t[1]) {
    case 'f':
      if (t[2] == '2') *out = DType::kF16;
      else if (t[2] == '4') *out = DType::kF32;
      else if (t[2] == '8') *out = DType::kF64;
      else return false;
      return true;
    case 'i':
      if (t[2] == '1') *out = DType::kI8;
      else if (t[2] == '4') *out = DType::kI32;
      else if (t[2] == '8') *out = DType::kI64;
      else return false;
      return true;
    case 'u':
      *out = DType::kU8;
      return t[2] == '1';
    default:
      return false;
  }
}

// A non-negative Python int (not a bool) as `out`.
bool index_of(PyObject* o, unsigned long long* out) {
  if (o == nullptr || !PyLong_Check(o) || PyBool_Check(o)) return false;
  const unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // negative or too large
    return false;
  }
  *out = v;
  return true;
}

}  // namespace

bool cuda_array_view(py::handle x, CudaArrayView* out) {
  PyObject* raw = PyObject_GetAttrString(x.ptr(), "__cuda_array_interface__");
  if (raw == nullptr) {
    PyErr_Clear();
    return false;
  }
  const py::object cai = py::reinterpret_steal<py::object>(raw);
  if (!PyDict_Check(raw)) return false;
  // Borrowed references, alive as long as `cai`.
  PyObject* shape = PyDict_GetItemString(raw, "shape");
  PyObject* typestr = PyDict_GetItemString(raw, "typestr");
  PyObject* data = PyDict_GetItemString(raw, "data");
  PyObject* strides = PyDict_GetItemString(raw, "strides");
  PyObject* mask = PyDict_GetItemString(raw, "mask");
  PyObject* stream = PyDict_GetItemString(raw, "stream");
  if (shape == nullptr || !PyTuple_Check(shape) || typestr == nullptr || !PyUnicode_Check(typestr) ||
      data == nullptr || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2) {
    return false;
  }
  if (mask != nullptr && mask != Py_None) return false;
  DType dtype;
  if (!typestr_dtype(typestr, &dtype)) return false;
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
  const bool strided = strides != nullptr && strides != Py_None;
  if (strided && (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != ndim)) return false;
  // C-contiguous: each dimension's stride is the bytes of the dimensions after it (any stride where the extent
  // is 1), the general path's rule (_buffers._is_c_contiguous).
  unsigned long long count = 1;
  unsigned long long expected = dtype_size(dtype);
  for (Py_ssize_t i = ndim - 1; i >= 0; --i) {
    unsigned long long dim = 0;
    if (!index_of(PyTuple_GET_ITEM(shape, i), &dim)) return false;
    if (strided && dim != 1) {
      unsigned long long stride = 0;
      if (!index_of(PyTuple_GET_ITEM(strides, i), &stride) || stride != expected) return false;
    }
    expected *= dim;
    count *= dim;
  }
  if (count == 0) return false;
  unsigned long long ptr = 0;
  if (!index_of(PyTuple_GET_ITEM(data, 0), &ptr) || ptr == 0) return false;
  const int readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
  if (readonly != 0) {
    if (readonly < 0) PyErr_Clear();
    return false;
  }
  unsigned long long s = 0;
  if (stream != nullptr && stream != Py_None && !index_of(stream, &s)) return false;
  out->ptr = static_cast<uintptr_t>(ptr);
  out->count = static_cast<size_t>(count);
  out->dtype = dtype;
  out->stream = static_cast<uintptr_t>(s);
  return true;
}

}  // namespace gpucoll::python
