"""CUDA streams and device placement for the GPU backends: which stream an operation on a buffer is ordered on,
what a ``stream=`` argument names, and whether a buffer is on the communicator's GPU. Buffers themselves are
resolved in ``_buffers``; like it, this module never imports torch or CuPy (a framework is touched through
``sys.modules`` once the caller's own object proves it is loaded).

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

import sys

from gpucoll._native import _C
from gpucoll.errors import InvalidArgument


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


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


_FRAMEWORK_KINDS = ("torch", "cupy")  # buffers ordered by the caller's current stream, with no producer stream


def op_stream(device: int, stream, buf, other=None) -> int:
    """The stream of an operation on `buf` (and `other`, its output) on `device`: ``stream=`` or the caller's
    current one, ordered after the streams on which their producers made them ready (``ready_stream``) where those
    differ. Every GPU backend takes its stream here, so none can forget the producer's: a kernel launched on another
    stream than the fill of its input reads the input half-written."""
    s = current_stream(buf.kind, device, buf.stream) if stream is None else stream_handle(stream, device)
    for b in (buf, other):
        if b is None or b.kind in _FRAMEWORK_KINDS:  # the hot path: nothing to join
            continue
        ready = ready_stream(b)
        if ready is not None and ready != s:
            _C.cuda_stream_wait(s, ready, device)
    return s


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
