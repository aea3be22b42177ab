"""Buffer resolution: the one place that turns user arrays into (pointer, count, dtype, device).

Accepted: NumPy arrays and torch tensors (CPU or CUDA), contiguous, used zero-copy; CuPy arrays and other CUDA
arrays (``__cuda_array_interface__``, ``__dlpack__``) through ``_cuda_buffers``. torch is never imported here: a
tensor is recognised by its type's module, so NumPy-only users never pay for torch. Which memory a backend accepts
is the Communicator's check (host: "cpu"; nccl: its CUDA device).
"""

from __future__ import annotations

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
    from gpucoll import _C

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
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None and isinstance(x, np.ndarray):
        return _resolve_numpy(x, arg, writable)
    from gpucoll import _cuda_buffers

    buf = _cuda_buffers.resolve(x, arg, writable)
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
    _NUMPY_DTYPES[x.dtype] = (dtype, canonical)
    if not x.flags.c_contiguous:
        raise InvalidArgument(f"{arg} must be C-contiguous; got an array with shape {x.shape} and strides "
                              f"{x.strides} (use numpy.ascontiguousarray)")
    if writable and not x.flags.writeable:
        raise InvalidArgument(f"{arg} must be writable; got a read-only array")
    ptr = x.__array_interface__["data"][0]
    return Buffer(x, "numpy", ptr, int(x.size), dtype, canonical, x.itemsize, tuple(x.shape), "cpu")


def _resolve_torch(x, arg: str) -> Buffer:
    name = str(x.dtype).replace("torch.", "")
    dtype, canonical = _dtype_enum(name, arg)
    if not x.is_contiguous():
        raise InvalidArgument(f"{arg} must be contiguous; got a tensor with shape {tuple(x.shape)} and strides "
                              f"{tuple(x.stride())} (call .contiguous())")
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
        from gpucoll import _cuda_buffers

        return _cuda_buffers.empty_like(buf, count, shape)
    import numpy as np

    return np.empty(shape, dtype=buf.obj.dtype)
