"""CUDA buffers and streams for the NCCL backend.

``_buffers.resolve`` handles NumPy arrays and torch tensors (CPU and CUDA) itself and hands everything else
here: CuPy arrays, objects exposing ``__cuda_array_interface__`` (Numba, PyCUDA, ...) and objects exposing
``__dlpack__`` on a CUDA device (JAX, ...). All are used zero-copy. Like ``_buffers``, this module never imports
torch or CuPy: an object is recognised by its type's module, and a framework is only touched through
``sys.modules`` once the caller's own object proves it is loaded.

Streams. An operation is ordered on the caller's current stream unless ``stream=`` names one:

* torch tensors: ``torch.cuda.current_stream(device)``;
* CuPy arrays: ``cupy.cuda.get_current_stream()`` of the array's device;
* ``__cuda_array_interface__`` objects: the interface's ``stream`` (v3; the producer's stream), else the legacy
  default stream;
* DLPack objects: the legacy default stream (they are exported with ``__dlpack__(stream=1)``, which asks the
  producer to make the data ready for that stream; torch, for one, does nothing for ``stream=None``).

Where ``stream=`` names another stream than the one a producer made its data ready on (the interface's
``stream``, DLPack's legacy stream), the operation's stream first waits for that one (``ready_stream``), as both
protocols ask of a consumer.

``stream=`` takes a torch stream, a CuPy stream, any object with ``__cuda_stream__``, or a raw ``cudaStream_t``
as an int (0 and 1: the legacy default stream, 2: the per-thread default stream).
"""

from __future__ import annotations

import ctypes
import sys

from gpucoll.errors import InvalidArgument, Unsupported

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


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _is_c_contiguous(shape, strides, itemsize: int) -> bool:
    """strides in bytes; size-1 dimensions may have any stride (NumPy's and CuPy's rule)."""
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def resolve(x, arg: str, writable: bool):
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


def _dtype(name: str, arg: str):
    from gpucoll import _buffers

    return _buffers._dtype_enum(name, arg)


def _resolve_cupy(x, arg: str):
    from gpucoll._buffers import Buffer

    dtype, canonical = _dtype(x.dtype.name, arg)
    if not x.flags.c_contiguous:
        raise InvalidArgument(f"{arg} must be C-contiguous; got a CuPy array with shape {x.shape} and strides "
                              f"{x.strides} (use cupy.ascontiguousarray)")
    return Buffer(x, "cupy", int(x.data.ptr), int(x.size), dtype, canonical, x.itemsize, tuple(x.shape),
                  f"cuda:{int(x.device.id)}")


def _resolve_cai(x, cai, arg: str, writable: bool):
    import numpy as np

    from gpucoll._buffers import Buffer

    try:
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(f"{arg} has a malformed __cuda_array_interface__ (needs shape, typestr and data): "
                              f"{cai!r}") from None
    if cai.get("mask") is not None:
        raise Unsupported(f"{arg} is a masked __cuda_array_interface__ array; masks are not supported")
    try:
        npdt = np.dtype(typestr)
    except TypeError:
        raise InvalidArgument(f"{arg} has __cuda_array_interface__ typestr {typestr!r}, which is not a dtype") from None
    if npdt.kind == "V":
        raise Unsupported(f"{arg} has __cuda_array_interface__ typestr {typestr!r} (raw bytes): gpucoll cannot tell "
                          f"its element type; bfloat16 and fp8 arrays must come as torch tensors or through DLPack")
    dtype, canonical = _dtype(npdt.name, arg)
    strides = cai.get("strides")
    if strides is not None and not _is_c_contiguous(shape, tuple(strides), npdt.itemsize):
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
    return Buffer(x, "cai", int(ptr or 0), count, dtype, canonical, npdt.itemsize, shape, "cuda", stream=stream)


def _resolve_dlpack(x, arg: str):
    from gpucoll._buffers import Buffer

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
    dtype, canonical = _dtype(name, arg)
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


def empty_like(buf, count: int, shape):
    """A new CUDA array like `buf` (out=None results). Only CuPy arrays here; torch is _buffers' business."""
    if buf.kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(int(buf.device.split(":")[1])):
            return cupy.empty(shape, dtype=buf.obj.dtype)
    if type(buf.obj).__module__ == "gpucoll._device_array":  # gpucoll.testing.DeviceArray
        return buf.obj.empty_like(shape)
    what = "a __cuda_array_interface__" if buf.kind == "cai" else "a DLPack"
    raise InvalidArgument(f"x is {what} object, for which gpucoll cannot allocate a result array: pass out= "
                          f"(an array of the result's shape {tuple(shape)} on the same device)")


# -- streams ------------------------------------------------------------------------------------------------------

def _torch_current_stream(device: int) -> int:
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch; skips a Stream object
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _cupy_current_stream(device: int) -> int:
    cupy = sys.modules["cupy"]
    try:
        return int(cupy.cuda.get_current_stream(device).ptr)
    except TypeError:  # CuPy without the device argument: the current stream is per device, so switch
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)


def current_stream(kind: str, device: int, producer_stream=None) -> int:
    """The stream an operation on a buffer of `kind` is ordered on by default (see the module docstring)."""
    if kind == "torch":
        return _torch_current_stream(device)
    if kind == "cupy":
        return _cupy_current_stream(device)
    if kind == "cai" and producer_stream is not None:
        return int(producer_stream)
    return 0


def ready_stream(buf):
    """The stream on which `buf`'s producer made it ready, when the protocol names one (None: torch and CuPy
    buffers, which follow the caller's current stream, and interfaces whose "stream" is None: ready already)."""
    if buf.kind == "cai":
        return buf.stream
    if buf.kind == "dlpack":
        return 0
    return None


def stream_handle(stream, device: int) -> int:
    """The raw cudaStream_t of a `stream=` argument, checked against the communicator's device."""
    if isinstance(stream, bool):
        raise InvalidArgument(f"stream must be a torch or CuPy stream or a cudaStream_t handle (int); got {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidArgument(f"stream must be a non-negative cudaStream_t handle; got {stream}")
        return stream
    # torch's and CuPy's streams are recognised first: they also implement __cuda_stream__, which carries no
    # device, and the device check below must still apply to them.
    mod = type(stream).__module__
    stream_device = None
    if (mod == "torch" or mod.startswith("torch.")) and hasattr(stream, "cuda_stream"):
        handle = int(stream.cuda_stream)
        stream_device = getattr(getattr(stream, "device", None), "index", None)
    elif (mod == "cupy" or mod.startswith("cupy.")) and hasattr(stream, "ptr"):
        handle = int(stream.ptr)
        stream_device = getattr(stream, "device_id", None)
    elif getattr(stream, "__cuda_stream__", None) is not None:  # the CUDA stream protocol: (version, handle)
        proto = stream.__cuda_stream__
        value = proto() if callable(proto) else proto
        try:
            return int(value[1])
        except (TypeError, IndexError, ValueError):
            raise InvalidArgument(f"stream.__cuda_stream__ returned {value!r}; expected (version, handle)") from None
    else:
        raise InvalidArgument(f"stream must be a torch stream, a CuPy stream, an object with __cuda_stream__ or a "
                              f"cudaStream_t handle (int); got {_type_name(stream)}")
    if stream_device is not None and int(stream_device) >= 0 and int(stream_device) != device:
        raise InvalidArgument(f"stream belongs to cuda:{stream_device}, but this communicator uses cuda:{device}")
    return handle


def check_device(buf, arg: str, device: int) -> None:
    """InvalidArgument unless `buf` is CUDA memory on `device` (the NCCL backend's placement rule)."""
    if buf.device == f"cuda:{device}":
        return
    if buf.device == "cpu":
        what = "CPU tensor" if buf.kind == "torch" else "NumPy array (host memory)"
        move = f"{arg}.to('cuda:{device}')" if buf.kind == "torch" else f"cupy.asarray({arg}) under cupy.cuda.Device({device})"
        raise InvalidArgument(f"{arg} is a {what}, but the nccl backend works on CUDA memory (this communicator: "
                              f"cuda:{device}); move it first, e.g. {move}")
    if buf.device == "cuda":  # __cuda_array_interface__: ask the driver
        if buf.nbytes == 0:
            return
        from gpucoll import _C

        info = _C.cuda_pointer_info(buf.ptr)
        if not info["device_memory"]:
            raise InvalidArgument(f"{arg} points to {info['kind']} memory (address {buf.ptr:#x}), not CUDA device "
                                  f"memory; the nccl backend needs device memory on cuda:{device}")
        if info["device"] == device:
            return
        where = f"cuda:{info['device']}"
    else:
        where = buf.device
    raise InvalidArgument(f"{arg} is on {where}, but this communicator uses cuda:{device}; move it there (e.g. "
                          f"{arg}.to('cuda:{device}')) or create the communicator with device={where.split(':')[-1]}")
