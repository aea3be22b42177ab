"""Buffer resolution: the one place that turns user arrays into (pointer, count, dtype, device).

Accepted, contiguous and used zero-copy: NumPy arrays and torch tensors (CPU or CUDA); CuPy arrays, objects
exposing ``__cuda_array_interface__`` (Numba, PyCUDA, ...) and objects exposing ``__dlpack__`` on a CUDA device
(JAX, ...). torch and CuPy are never imported here: an object is recognised by its type's module, and a framework
is only touched through ``sys.modules`` once the caller's own object proves it is loaded, so NumPy-only users never
pay for either. Which memory a backend accepts is its Backend's check (gpucoll/backends/); the streams CUDA
buffers are ordered on are ``_cuda_buffers``' business.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from gpucoll._native import _C
from gpucoll.errors import InvalidArgument, Unsupported

# dtype names (NumPy's and torch's spelling after "torch.") -> gpucoll._C.DType member name
_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    # torch aliases
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "long": "int64",
    "int": "int32",
}
SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
# fp8 (torch.float8_e4m3fn / float8_e5m2, DLPack): only the nccl backend takes them (NCCL >= 2.24).
FP8 = ("float8_e4m3fn", "float8_e5m2")

# DLPack device types (dlpack.h): CUDA memory and CUDA managed memory are usable by NCCL.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
# (type code, bits) -> dtype name, from dlpack.h's DLDataTypeCode.
_DL_DTYPES = {
    (0, 8): "int8", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16",
    (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2",
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    # The first member of DLManagedTensor, so a capsule's pointer can be read as this struct directly.
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Buffer:
    """A resolved array: what the backends need to know about it. Built on every call, so kept light."""

    __slots__ = (
        "count",
        "device",
        "dtype",
        "dtype_name",
        "itemsize",
        "keep",
        "kind",
        "obj",
        "ptr",
        "shape",
        "stream",
    )

    def __init__(self, obj, kind, ptr, count, dtype, dtype_name, itemsize, shape, device, keep=None, stream=None):
        self.obj = obj
        self.kind = kind  # "numpy" | "torch"
        self.ptr = ptr
        self.count = count  # elements
        self.dtype = dtype  # gpucoll._C.DType
        self.dtype_name = dtype_name
        self.itemsize = itemsize
        self.shape = shape
        self.device = device  # "cpu", "cuda:N", or "cuda" (a __cuda_array_interface__ pointer: device unknown)
        self.keep = keep  # what must stay alive while the buffer is in use (a DLPack capsule)
        self.stream = stream  # the producer's stream of a __cuda_array_interface__ (v3), else None

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def overlaps(self, other: Buffer) -> bool:
        if self.nbytes == 0 or other.nbytes == 0:
            return False
        return self.ptr < other.ptr + other.nbytes and other.ptr < self.ptr + self.nbytes


def _is_torch_tensor(x) -> bool:
    mod = type(x).__module__
    return (mod == "torch" or mod.startswith("torch.")) and hasattr(x, "data_ptr")


def _dtype_enum(name: str, arg: str):
    canonical = _DTYPES.get(name)
    if canonical is None and name in FP8:
        canonical = name
    if canonical is None:
        raise Unsupported(f"{arg} has dtype {name}, which gpucoll does not support; expected one of "
                          f"{', '.join(SUPPORTED)}")
    return getattr(_C.DType, canonical), canonical


def resolve(x, arg: str = "x", *, writable: bool = False) -> Buffer:
    """Describe `x` (argument name `arg` is used in error messages)."""
    if _is_torch_tensor(x):
        return _resolve_torch(x, arg)
    if isinstance(x, np.ndarray):
        return _resolve_numpy(x, arg, writable)
    buf = _resolve_cuda(x, arg, writable)
    if buf is not None:
        return buf
    raise InvalidArgument(f"{arg} must be a NumPy array, a torch tensor, a CuPy array or a CUDA array with "
                          f"__cuda_array_interface__ or __dlpack__; got {type(x).__module__}.{type(x).__qualname__}")


_NUMPY_DTYPES: dict = {}  # numpy dtype -> (DType, canonical name); filled on first use of each dtype


def _resolve_numpy(x, arg: str, writable: bool) -> Buffer:
    flags = x.flags
    known = _NUMPY_DTYPES.get(x.dtype)
    if known is not None and flags.c_contiguous and (flags.writeable or not writable):
        return Buffer(x, "numpy", x.ctypes.data, x.size, known[0], known[1], x.itemsize, x.shape, "cpu")
    name = x.dtype.name
    if x.dtype.kind in "cOUSVMm" and name not in _DTYPES:
        raise Unsupported(f"{arg} has dtype {name}, which gpucoll does not support; expected one of "
                          f"{', '.join(SUPPORTED)}")
    dtype, canonical = _dtype_enum(name, arg)
    if not x.dtype.isnative:  # a float32 in the other byte order reduced as ours would be silently wrong
        raise InvalidArgument(f"{arg} must be in this machine's byte order; got dtype {x.dtype.str} (use "
                              f"{arg}.astype({arg}.dtype.newbyteorder('=')))")
    _NUMPY_DTYPES[x.dtype] = (dtype, canonical)
    if not x.flags.c_contiguous:
        raise InvalidArgument(f"{arg} must be C-contiguous; got an array with shape {x.shape} and strides "
                              f"{x.strides} (use numpy.ascontiguousarray)")
    if writable and not x.flags.writeable:
        raise InvalidArgument(f"{arg} must be writable; got a read-only array")
    ptr = x.__array_interface__["data"][0]
    return Buffer(x, "numpy", ptr, int(x.size), dtype, canonical, x.itemsize, tuple(x.shape), "cpu")


_TORCH_DTYPES: dict = {}  # torch dtype -> (DType, canonical name); filled on first use of each supported dtype


def _resolve_torch(x, arg: str) -> Buffer:
    known = _TORCH_DTYPES.get(x.dtype)
    if known is None:
        known = _TORCH_DTYPES[x.dtype] = _dtype_enum(str(x.dtype).replace("torch.", ""), arg)
    dtype, canonical = known
    if not x.is_contiguous():
        raise InvalidArgument(f"{arg} must be contiguous; got a tensor with shape {tuple(x.shape)} and strides "
                              f"{tuple(x.stride())} (call .contiguous())")
    if x.is_neg():  # its memory holds -x: reducing it would give plausible, wrong numbers
        raise InvalidArgument(f"{arg} is a lazily negated view (its memory holds the values negated); call "
                              f".resolve_neg() first")
    device = str(x.device)
    return Buffer(x, "torch", int(x.data_ptr()), int(x.numel()), dtype, canonical, x.element_size(),
                  tuple(x.shape), device)


def empty_like(buf: Buffer, count: int, shape: tuple | None = None):
    """A new array of `count` elements of buf's kind, dtype and device (for out=None results)."""
    shape = shape if shape is not None else (count,)
    if buf.kind == "torch":
        import torch

        return torch.empty(shape, dtype=buf.obj.dtype, device=buf.obj.device)
    if buf.kind != "numpy":
        return _empty_cuda(buf, count, shape)
    return np.empty(shape, dtype=buf.obj.dtype)


# -- CUDA arrays other than torch tensors ---------------------------------------------------------------------

def _is_c_contiguous(shape, strides, itemsize: int) -> bool:
    """strides in bytes; size-1 dimensions may have any stride (NumPy's and CuPy's rule)."""
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _resolve_cuda(x, arg: str, writable: bool):
    """A Buffer for a CUDA array that is neither NumPy nor torch, or None when `x` is none of the kinds here."""
    mod = type(x).__module__
    if (mod == "cupy" or mod.startswith("cupy.")) and hasattr(x, "data") and hasattr(x, "device"):
        return _resolve_cupy(x, arg)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return _resolve_cai(x, cai, arg, writable)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _resolve_dlpack(x, arg)
    return None


def _resolve_cupy(x, arg: str):
    dtype, canonical = _dtype_enum(x.dtype.name, arg)
    if not x.flags.c_contiguous:
        raise InvalidArgument(f"{arg} must be C-contiguous; got a CuPy array with shape {x.shape} and strides "
                              f"{x.strides} (use cupy.ascontiguousarray)")
    return Buffer(x, "cupy", int(x.data.ptr), int(x.size), dtype, canonical, x.itemsize, tuple(x.shape),
                  f"cuda:{int(x.device.id)}")


_CAI_TYPES: dict = {}  # typestr -> (DType, canonical name, itemsize): filled on first use of each supported typestr


def _cai_type(typestr, arg: str) -> tuple:
    """(DType, canonical name, itemsize) of a __cuda_array_interface__ typestr, or the typed error naming `arg`.
    Every call pays for this lookup, so a supported typestr is worked out once (np.dtype alone costs microseconds)."""
    known = _CAI_TYPES.get(typestr) if isinstance(typestr, str) else None
    if known is not None:
        return known
    try:
        npdt = np.dtype(typestr)
    except TypeError:
        raise InvalidArgument(f"{arg} has __cuda_array_interface__ typestr {typestr!r}, which is not a dtype") from None
    if npdt.kind == "V":
        raise Unsupported(f"{arg} has __cuda_array_interface__ typestr {typestr!r} (raw bytes): gpucoll cannot tell "
                          f"its element type; bfloat16 and fp8 arrays must come as torch tensors or through DLPack")
    dtype, canonical = _dtype_enum(npdt.name, arg)
    if not npdt.isnative:
        raise InvalidArgument(f"{arg} has __cuda_array_interface__ typestr {typestr!r}, which is not this machine's "
                              f"byte order")
    known = (dtype, canonical, npdt.itemsize)
    if isinstance(typestr, str):
        _CAI_TYPES[typestr] = known
    return known


def _resolve_cai(x, cai, arg: str, writable: bool):
    try:
        shape = cai["shape"]
        shape = shape if type(shape) is tuple and all(type(d) is int for d in shape) else tuple(int(d) for d in shape)
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(f"{arg} has a malformed __cuda_array_interface__ (needs shape, typestr and data): "
                              f"{cai!r}") from None
    if cai.get("mask") is not None:
        raise Unsupported(f"{arg} is a masked __cuda_array_interface__ array; masks are not supported")
    dtype, canonical, itemsize = _cai_type(typestr, arg)
    strides = cai.get("strides")
    if strides is not None and not _is_c_contiguous(shape, tuple(strides), itemsize):
        raise InvalidArgument(f"{arg} must be C-contiguous; got a __cuda_array_interface__ array with shape {shape} "
                              f"and strides {tuple(strides)}")
    if writable and readonly:
        raise InvalidArgument(f"{arg} must be writable; its __cuda_array_interface__ says read-only")
    count = 1
    for d in shape:
        count *= d
    stream = cai.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream < 0):
        raise InvalidArgument(f"{arg} has __cuda_array_interface__ stream {stream!r}; expected None or a handle")
    # The device is not part of the interface: "cuda" until the NCCL backend asks the driver.
    return Buffer(x, "cai", int(ptr or 0), count, dtype, canonical, itemsize, shape, "cuda", stream=stream)


def _resolve_dlpack(x, arg: str):
    device_type, device_id = (int(v) for v in x.__dlpack_device__())
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        where = {_DL_CPU: "CPU", _DL_CUDA_HOST: "CUDA pinned host"}.get(device_type, f"type {device_type}")
        raise InvalidArgument(f"{arg} is a DLPack array in {where} memory; gpucoll takes NumPy arrays and torch "
                              f"tensors on the CPU, and CUDA memory for the nccl backend")
    # stream=1 (the legacy default stream, which DLPack inputs are ordered on): the producer makes the data ready
    # for it. The array API says producers assume it for None too, but torch then skips its synchronisation.
    # Producers whose __dlpack__ predates the stream argument get the plain call.
    try:
        capsule = x.__dlpack__(stream=1)
    except TypeError:
        capsule = x.__dlpack__()
    try:
        addr = _capsule_pointer(capsule, b"dltensor")
    except ValueError:
        raise InvalidArgument(f"{arg}.__dlpack__() did not return a 'dltensor' capsule") from None
    t = _DLTensor.from_address(addr)
    if t.dtype.lanes != 1:
        raise Unsupported(f"{arg} is a vector-typed DLPack array (lanes={t.dtype.lanes}); not supported")
    name = _DL_DTYPES.get((t.dtype.code, t.dtype.bits))
    if name is None:
        raise Unsupported(f"{arg} has DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits), which gpucoll does "
                          f"not support")
    dtype, canonical = _dtype_enum(name, arg)
    itemsize = t.dtype.bits // 8
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    if t.strides:  # NULL strides mean C-contiguous
        strides = tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
        if not _is_c_contiguous(shape, strides, itemsize):
            raise InvalidArgument(f"{arg} must be C-contiguous; got a DLPack array with shape {shape} and strides "
                                  f"{tuple(s // itemsize for s in strides)} (in elements)")
    count = 1
    for d in shape:
        count *= d
    ptr = int(t.data or 0) + int(t.byte_offset)
    # The capsule keeps the producer's memory alive; its destructor releases it when the Buffer goes away.
    return Buffer(x, "dlpack", ptr, count, dtype, canonical, itemsize, shape, f"cuda:{device_id}", keep=capsule)


def _empty_cuda(buf, count: int, shape):
    """A new CUDA array like `buf` (out=None results) of a kind other than torch's."""
    if buf.kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(int(buf.device.split(":")[1])):
            return cupy.empty(shape, dtype=buf.obj.dtype)
    if type(buf.obj).__module__ == "gpucoll._device_array":  # gpucoll.testing.DeviceArray
        return buf.obj.empty_like(shape)
    what = "a __cuda_array_interface__" if buf.kind == "cai" else "a DLPack"
    raise InvalidArgument(f"x is {what} object, for which gpucoll cannot allocate a result array: pass out= "
                          f"(an array of the result's shape {tuple(shape)} on the same device)")
