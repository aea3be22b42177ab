"""``gpucoll.testing.DeviceArray``: CUDA device memory that gpucoll allocates itself, without torch or CuPy.

It is what the GPU tests and the benchmark run on where no CUDA framework can allocate: on gpucoll's emulated CUDA
device (a ``GPUCOLL_CUDA=emulate`` build), and on a GPU machine with neither torch nor CuPy. It goes through the
public API like any CUDA array: it exports ``__cuda_array_interface__`` (version 3) and DLPack
(``__dlpack__``/``__dlpack_device__`` with the CUDA device type); bfloat16 arrays export DLPack only, since the
array interface has no bfloat16 type string.

    x = DeviceArray.from_host(np.arange(10, dtype=np.float32))   # upload (complete on return)
    comm.all_reduce(x)                                           # any backend that takes CUDA memory
    x.to_host()                                                  # download, after the work on x's stream

Copies are synchronous and fill the whole array; a view (``x[a:b]``, ``x.view(dtype)``) shares the memory and
keeps the allocation alive. The array interface names no stream (the data is ready when an operation starts), so
gpucoll orders operations on it on the legacy default stream, and ``to_host`` (on that stream too) sees their
results; work on other streams must be synchronised first, as with any CUDA memory.

bfloat16 values go in and come out as float32 NumPy arrays holding bfloat16-representable values (NumPy has no
bfloat16); ``to_host(raw=True)`` gives the raw bits of any dtype. The fp8 types (``float8_e4m3fn``, ``float8_e5m2``,
DLPack only, as bfloat16) hold raw bits both ways: uint8 arrays in, uint8 arrays out (NumPy has no fp8 either).
"""

from __future__ import annotations

import numpy as np

from gpucoll._native import _C
from gpucoll.errors import InvalidArgument

# dtype name -> (NumPy storage dtype, DLPack type code, bits).
_DTYPES = {
    "float16": (np.float16, 2, 16),
    "bfloat16": (np.uint16, 4, 16),
    "float32": (np.float32, 2, 32),
    "float64": (np.float64, 2, 64),
    "int8": (np.int8, 0, 8),
    "uint8": (np.uint8, 1, 8),
    "int32": (np.int32, 0, 32),
    "int64": (np.int64, 0, 64),
    "float8_e4m3fn": (np.uint8, 10, 8),  # DLPack's kDLFloat8_e4m3fn, kDLFloat8_e5m2
    "float8_e5m2": (np.uint8, 12, 8),
}
_RAW_ONLY = ("float8_e4m3fn", "float8_e5m2")  # no NumPy type: raw bits in and out
# __cuda_array_interface__ type strings, worked out once: the interface is read on every collective call.
_TYPESTR = {name: np.dtype(t[0]).str for name, t in _DTYPES.items() if name != "bfloat16" and name not in _RAW_ONLY}


def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _DTYPES:
        raise InvalidArgument(f"DeviceArray dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    return name


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values that bfloat16 represents exactly."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(u & np.uint32(0xFFFF)):
        raise InvalidArgument("bfloat16 values must be exactly representable in bfloat16 (low 16 bits of the "
                              "float32 zero)")
    return (u >> np.uint32(16)).astype(np.uint16)


class DeviceArray:
    """A C-contiguous CUDA array in memory gpucoll allocated (see the module docstring)."""

    def __init__(self, shape, dtype="float32", device: int = 0):
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"DeviceArray shape must not be negative; got {self.shape}")
        self.dtype = _dtype_name(dtype)
        self.device = int(device)
        self._buffer = _C.DeviceBuffer(self.nbytes, self.device)  # owns the memory; views share it
        self._offset = 0

    @classmethod
    def _view(cls, base: DeviceArray, offset: int, shape: tuple, dtype: str) -> DeviceArray:
        v = cls.__new__(cls)
        v.shape, v.dtype, v.device = shape, dtype, base.device
        v._buffer, v._offset = base._buffer, base._offset + offset
        return v

    @classmethod
    def from_host(cls, array, dtype=None, device: int = 0) -> DeviceArray:
        """A new device array holding `array` (NumPy; dtype='bfloat16' takes bfloat16-exact float32 values)."""
        a = np.asarray(array)
        out = cls(a.shape, dtype or a.dtype, device)
        out.copy_from_host(a)
        return out

    # -- properties ----------------------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][2] // 8

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ptr(self) -> int:
        return self._buffer.ptr + self._offset if self.nbytes else 0

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device=cuda:{self.device}, ptr={self.ptr:#x})"

    # -- views -----------------------------------------------------------------------------------------------------
    def __getitem__(self, key) -> DeviceArray:
        if len(self.shape) != 1 or not isinstance(key, slice):
            raise InvalidArgument("DeviceArray supports 1-D slices only (x[a:b])")
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise InvalidArgument("DeviceArray slices must be contiguous (step 1)")
        return DeviceArray._view(self, start * self.itemsize, (max(stop - start, 0),), self.dtype)

    def view(self, dtype) -> DeviceArray:
        """The same bytes as a 1-D array of `dtype`."""
        name = _dtype_name(dtype)
        size = _DTYPES[name][2] // 8
        if self.nbytes % size:
            raise InvalidArgument(f"{self.nbytes} bytes do not make whole {name} elements")
        return DeviceArray._view(self, 0, (self.nbytes // size,), name)

    def reshape(self, shape) -> DeviceArray:
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise InvalidArgument(f"cannot reshape {self.shape} into {shape}")
        return DeviceArray._view(self, 0, shape, self.dtype)

    # -- copies ----------------------------------------------------------------------------------------------------
    def _host_storage(self, array) -> np.ndarray:
        storage = _DTYPES[self.dtype][0]
        a = np.asarray(array)
        if self.dtype == "bfloat16" and a.dtype != np.uint16:
            a = _bf16_bits(a)
        if self.dtype in _RAW_ONLY and a.dtype != np.uint8:
            raise InvalidArgument(f"{self.dtype} DeviceArrays take raw bits: a uint8 array (NumPy has no fp8 type); "
                                  f"got {a.dtype}")
        a = np.ascontiguousarray(a, dtype=storage)
        if a.size != self.size:
            raise InvalidArgument(f"host array has {a.size} elements; this DeviceArray has {self.size}")
        return a

    def copy_from_host(self, array) -> None:
        """Overwrite the whole array with `array` (complete on return)."""
        _C.cuda_copy_from_host(self.ptr, self._host_storage(array).reshape(-1), self.device)

    def to_host(self, raw: bool = False) -> np.ndarray:
        """A NumPy copy (complete on return). bfloat16 comes back as float32 (exact); raw=True: the stored bits."""
        out = np.empty(self.shape, dtype=_DTYPES[self.dtype][0])
        _C.cuda_copy_to_host(out.reshape(-1), self.ptr, self.device)
        if self.dtype == "bfloat16" and not raw:
            return (out.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return out

    def fill_bytes(self, byte: int) -> None:
        """Every byte set to `byte` (a sentinel fill before a call whose output must be written)."""
        _C.cuda_fill(self.ptr, int(byte) & 0xFF, self.nbytes, self.device)

    def copy_(self, src: DeviceArray) -> None:
        """Device-to-device copy of `src` (same size in bytes) into this array."""
        if src.nbytes != self.nbytes:
            raise InvalidArgument(f"copy_ needs {self.nbytes} bytes; src has {src.nbytes}")
        _C.cuda_copy(self.ptr, src.ptr, self.nbytes, self.device)

    def empty_like(self, shape=None) -> DeviceArray:
        return DeviceArray(self.shape if shape is None else shape, self.dtype, self.device)

    # -- exports -----------------------------------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self.dtype == "bfloat16" or self.dtype in _RAW_ONLY:
            # No type string says bfloat16 or fp8 (it would be raw bytes, "|V2"): consumers must come through DLPack.
            raise AttributeError(f"{self.dtype} DeviceArrays export DLPack only")
        return {"shape": self.shape, "typestr": _TYPESTR[self.dtype], "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}

    def __dlpack_device__(self) -> tuple:
        return (2, self.device)  # kDLCUDA

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule. Every copy into this array completed before it returned, so the data is ready for any
        consumer stream; the capsule keeps the memory alive."""
        if copy:
            raise BufferError("DeviceArray exports without copying")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}; asked for {tuple(dl_device)}")
        _, code, bits = _DTYPES[self.dtype]
        return _C.dlpack_capsule(self, self.ptr, list(self.shape), code, bits, self.device)
