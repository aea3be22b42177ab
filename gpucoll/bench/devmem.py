"""Where gpucoll-bench's buffers live, and how a run on them is timed: host memory (NumPy) or CUDA memory.

The collective plugins (colls/) fill inputs and check outputs on NumPy views of host buffers, with the exact
integer patterns of colls/__init__.py. On the host backend those buffers are the ones the collective runs on.
On a CUDA run each host buffer has a device twin of the same size: the harness uploads the byte spans a row
uses after init_data, runs the collective on views of the twin, and downloads the spans back before counting
wrong elements, so every backend is checked by the same code on the same inputs, bit for bit.

CUDA memory comes from torch when it can use the GPU (its caching allocator owns the memory budget of a torch
program), else from CuPy, else from gpucoll itself (gpucoll.testing.DeviceArray; on gpucoll's emulated CUDA device
this is the only one). Times are CUDA events recorded on the stream the collective runs on: the caller's
current stream (where gpucoll's nccl backend orders its work), or the stream a virtual rank was given.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from gpucoll._native import _C, LOAD_ERROR
from gpucoll.testing import DeviceArray

_TORCH_NAMES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64", "half": "float16",
                "float": "float32", "double": "float64", "bfloat16": "bfloat16"}


class HostMem:
    """NumPy buffers; the device buffer is the host buffer, so upload and download do nothing."""

    kind = "host"
    label = "cpu"

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def twin(self, host: np.ndarray):
        return host

    def view(self, raw, first: int, nbytes: int, dt):
        return dt.wrap(raw[first:first + nbytes].view(dt.storage))

    def upload(self, host: np.ndarray, dev, first: int, stop: int) -> None:
        pass

    def download(self, dev, host: np.ndarray, first: int, stop: int) -> None:
        pass

    def copy(self, dst, src) -> None:
        if hasattr(dst, "copy_"):  # a torch view (bfloat16)
            dst.copy_(src)
        else:
            np.copyto(dst, src)

    def synchronize(self) -> None:
        pass

    def bind(self, comm):
        """The communicator the run's calls go through (GpucollMem's give every call its stream)."""
        return comm

    def reduce_small(self, comm, arr: np.ndarray, op: str = "sum") -> None:
        """Cross-rank bookkeeping (times, wrong counts, rank info) on a small host array, in place. A
        communicator that reduces host arrays itself (virtual ranks) has host_all_reduce."""
        own = getattr(comm, "host_all_reduce", None)
        if own is not None:
            own(arr, op)
        else:
            comm.all_reduce(arr, op=op)

    def timer(self):
        return _WallTimer(self.synchronize)

    def capture(self, fn):
        raise NotImplementedError("CUDA graphs need CUDA buffers")


class StagedHostMem(HostMem):
    """Host memory with a separate "device" twin: the CUDA path's upload/download staging, runnable on a CPU
    (tests use it to prove every row uploads its inputs and downloads its outputs)."""

    kind = "staged"

    def twin(self, host: np.ndarray):
        return np.zeros_like(host)

    def upload(self, host, dev, first: int, stop: int) -> None:
        dev[first:stop] = host[first:stop]

    def download(self, dev, host, first: int, stop: int) -> None:
        host[first:stop] = dev[first:stop]


class _WallTimer:
    def __init__(self, sync):
        self._sync = sync
        self._t0 = 0.0

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._t0


class _DeviceMem(HostMem):
    """What the CUDA memories share: the harness's bookkeeping reduced through a device copy."""

    def _typed(self, dev, name: str):
        raise NotImplementedError

    def reduce_small(self, comm, arr: np.ndarray, op: str = "sum") -> None:
        """As HostMem's, through a CUDA copy of `arr`: gpucoll's GPU backends refuse host arrays."""
        if hasattr(comm, "host_all_reduce"):
            super().reduce_small(comm, arr, op)
            return
        raw = arr.view(np.uint8).reshape(-1)
        dev = self.twin(raw)
        self.upload(raw, dev, 0, raw.size)
        comm.all_reduce(self._typed(dev, arr.dtype.name), op=op)
        self.download(dev, raw, 0, raw.size)


class CudaMem(_DeviceMem):
    """CUDA buffers on `device` from torch (preferred) or CuPy, timed with CUDA events on `stream` (None: the
    current stream of the framework, the one gpucoll's nccl backend runs on; "device": unknown streams, so a
    device-wide synchronize around a host timer)."""

    kind = "cuda"

    def __init__(self, device: int, stream=None, lib: str | None = None):
        self.device = int(device)
        self.lib = lib or cuda_lib()
        if self.lib is None:
            raise RuntimeError("CUDA buffers need torch with CUDA or CuPy with a usable GPU")
        if self.lib == "torch":
            import torch

            self._torch = torch
            self.label = f"cuda:{self.device} {torch.cuda.get_device_name(self.device)}"
            if isinstance(stream, int):  # a raw cudaStream_t (virtual ranks' vr.streams)
                stream = torch.cuda.ExternalStream(stream, device=f"cuda:{self.device}")
        else:
            import cupy

            self._cupy = cupy
            if isinstance(stream, int):
                with cupy.cuda.Device(self.device):
                    stream = cupy.cuda.ExternalStream(stream)
            props = cupy.cuda.runtime.getDeviceProperties(self.device)
            name = props.get("name", b"")
            self.label = f"cuda:{self.device} {name.decode() if isinstance(name, bytes) else name}"
        self._stream = stream

    # -- memory ---------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)  # the host mirror the plugins fill and check

    def twin(self, host: np.ndarray):
        # Allocated and zero-filled on the run's stream: a virtual rank's stream is non-blocking, so a zero fill
        # left on the legacy default stream would not be ordered before that stream's first upload and could
        # land after it (and the caching allocators tie the block to the stream it was allocated on).
        with self._on_stream():
            if self.lib == "torch":
                dev = self._torch.zeros(host.size, dtype=self._torch.uint8, device=f"cuda:{self.device}")
            else:
                dev = self._cupy.zeros(host.size, dtype=self._cupy.uint8)
        return dev

    def view(self, raw, first: int, nbytes: int, dt):
        part = raw[first:first + nbytes]
        if self.lib == "torch":
            return part.view(getattr(self._torch, _TORCH_NAMES[dt.name]))
        if dt.name == "bfloat16":
            raise RuntimeError("bfloat16 CUDA buffers need torch (CuPy has no bfloat16)")
        return part.view(dt.storage)

    def upload(self, host, dev, first: int, stop: int) -> None:
        if stop <= first:
            return
        with self._on_stream():
            if self.lib == "torch":
                dev[first:stop].copy_(self._torch.from_numpy(host[first:stop]), non_blocking=False)
            else:
                dev[first:stop].set(host[first:stop], stream=self.stream())
        self.synchronize()

    def download(self, dev, host, first: int, stop: int) -> None:
        if stop <= first:
            return
        self.synchronize()
        with self._on_stream():
            if self.lib == "torch":
                host[first:stop] = dev[first:stop].cpu().numpy()
            else:
                host[first:stop] = dev[first:stop].get(stream=self.stream())

    def copy(self, dst, src) -> None:
        with self._on_stream():
            if self.lib == "torch":
                dst.copy_(src)
            else:
                self._cupy.copyto(dst, src)

    @contextlib.contextmanager
    def _on_stream(self):
        """This device, and the run's stream as the framework's current one when the run has its own (a virtual
        rank's): copies then order with the collectives on that stream instead of racing them."""
        own = self._stream is not None and self._stream != "device"
        if self.lib == "torch":
            with self._torch.cuda.device(self.device), (self._torch.cuda.stream(self._stream) if own
                                                         else contextlib.nullcontext()):
                yield
        else:
            with self._cupy.cuda.Device(self.device), (self._stream if own else contextlib.nullcontext()):
                yield

    # -- streams, time, graphs ------------------------------------------------------------------------------
    def stream(self):
        if self._stream is not None and self._stream != "device":
            return self._stream
        if self.lib == "torch":
            return self._torch.cuda.current_stream(self.device)
        with self._cupy.cuda.Device(self.device):
            return self._cupy.cuda.get_current_stream()

    def synchronize(self) -> None:
        if self._stream != "device":
            self.stream().synchronize()
        elif self.lib == "torch":
            self._torch.cuda.synchronize(self.device)
        else:
            self._cupy.cuda.Device(self.device).synchronize()

    def _typed(self, dev, name: str):
        if self.lib == "torch":
            return dev.view(getattr(self._torch, name))  # int64, float64, uint8: same names
        return dev.view(name)

    def timer(self):
        # "device": the collective runs on streams this process does not know (virtual ranks without
        # vr.streams): time the host around a device-wide synchronize instead.
        return _WallTimer(self.synchronize) if self._stream == "device" else _EventTimer(self)

    def capture(self, fn):
        """Capture fn() (collectives issued on this run's buffers) into a CUDA graph; returns a callable that
        launches the graph on the current stream."""
        if self.lib == "torch":
            torch = self._torch
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.device), torch.cuda.graph(graph):
                fn()
            return graph.replay
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            side = cupy.cuda.Stream(non_blocking=True)
            with side:
                side.begin_capture()
                try:
                    fn()
                finally:
                    graph = side.end_capture()
        return lambda: graph.launch(self.stream())


class _EventTimer:
    """Elapsed time between two CUDA events on the run's stream (nccl-tests times the host around a stream
    synchronize; events leave the launch of the first call out, which is what -G's graph launches amortise)."""

    def __init__(self, mem: CudaMem):
        self._mem = mem
        if mem.lib == "torch":
            ev = mem._torch.cuda.Event
        else:
            ev = mem._cupy.cuda.Event
        self._start, self._end = (ev(enable_timing=True) if mem.lib == "torch" else ev(disable_timing=False)
                                  for _ in range(2))

    def start(self) -> None:
        self._start.record(self._mem.stream())

    def stop(self) -> float:
        self._end.record(self._mem.stream())
        self._end.synchronize()
        if self._mem.lib == "torch":
            return self._start.elapsed_time(self._end) / 1e3
        return self._mem._cupy.cuda.get_elapsed_time(self._start, self._end) / 1e3


class GpucollMem(_DeviceMem):
    """CUDA buffers gpucoll allocates itself (gpucoll.testing.DeviceArray), where neither torch nor CuPy can: on
    gpucoll's emulated CUDA device (a GPUCOLL_CUDA=emulate build), or on a GPU machine with neither installed.
    Uploads, downloads, copies and every collective run on the run's stream: a virtual rank's, else one of its own
    (these buffers have no framework whose current stream the backends would follow, and the legacy stream cannot be
    captured into a graph), which bind() passes as every call's stream=; times are CUDA events on that stream."""

    kind = "cuda"

    def __init__(self, device: int, stream=None):
        self._C = _C
        self.device = int(device)
        devices = _C.cuda_probe().get("devices") or []
        name = devices[self.device]["name"] if self.device < len(devices) else ""
        self.label = f"cuda:{self.device} {name}".rstrip()
        self.emulated = bool(_C.build_info().get("cuda_emulated"))
        self._own = _C.CudaStream(self.device) if stream is None else None
        self._stream = self._own.handle if self._own is not None else stream

    def bind(self, comm):
        return _OnStream(comm, self._stream) if self._own is not None else comm

    def _handle(self) -> int:
        return int(self._stream) if isinstance(self._stream, int) else 0

    def twin(self, host: np.ndarray):
        dev = DeviceArray(host.size, "uint8", self.device)
        dev.fill_bytes(0)  # complete on return: ordered before any stream's later upload
        return dev

    def view(self, raw, first: int, nbytes: int, dt):
        return raw[first:first + nbytes].view(_TORCH_NAMES[dt.name])

    def upload(self, host, dev, first: int, stop: int) -> None:
        if stop <= first:
            return
        self._C.cuda_copy(dev.ptr + first, host.ctypes.data + first, stop - first, self.device, self._handle())
        self.synchronize()

    def download(self, dev, host, first: int, stop: int) -> None:
        if stop <= first:
            return
        self.synchronize()
        self._C.cuda_copy(host.ctypes.data + first, dev.ptr + first, stop - first, self.device, self._handle())
        self.synchronize()

    def copy(self, dst, src) -> None:
        self._C.cuda_copy(dst.ptr, src.ptr, dst.nbytes, self.device, self._handle())

    def synchronize(self) -> None:
        if self._stream == "device":
            self._C.cuda_device_synchronize(self.device)
        else:
            self._C.cuda_stream_synchronize(self._handle(), self.device)

    def _typed(self, dev, name: str):
        return dev.view(name)

    def timer(self):
        return _WallTimer(self.synchronize) if self._stream == "device" else _GpucollEventTimer(self)

    def capture(self, fn):
        if not self._handle():
            raise NotImplementedError("gpucoll's own buffers on the legacy stream cannot be captured into a graph")
        graph = self._C.MultiStreamGraph(self.device, [self._handle()])
        graph.begin()
        try:
            fn()
        finally:
            graph.end()
        return lambda: graph.replay(1)


class _OnStream:
    """A communicator whose collectives run on `stream` unless a call names another."""

    _CALLS = frozenset(("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather",
                        "scatter", "send", "recv"))

    def __init__(self, comm, stream: int):
        self._comm, self._stream = comm, stream

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self._CALLS:
            return attr

        def call(*args, **kwargs):
            kwargs.setdefault("stream", self._stream)
            return attr(*args, **kwargs)

        return call


class _GpucollEventTimer:
    def __init__(self, mem: GpucollMem):
        self._mem = mem
        self._start = mem._C.CudaEvent(mem.device, True)
        self._end = mem._C.CudaEvent(mem.device, True)

    def start(self) -> None:
        self._start.record(self._mem._handle())

    def stop(self) -> float:
        self._end.record(self._mem._handle())
        self._end.synchronize()
        return self._end.elapsed_ms(self._start) / 1e3


def cuda_lib() -> str | None:
    """Which library allocates CUDA buffers here: "torch" (with a usable GPU), "cupy", "gpucoll" (its own
    DeviceArray: a CUDA build of gpucoll with a usable device, the emulated one included), or None."""
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.is_available():
            return "cupy"
    except ImportError:
        pass
    if LOAD_ERROR:  # no native core, so no DeviceArray
        return None
    if _C.build_info().get("cuda_built") and _C.cuda_probe().get("device_count"):
        return "gpucoll"
    return None


def for_comm(comm, staged: bool = False):
    """The memory of a run on `comm`: CUDA on the GPU backends (the communicator's device, or a virtual rank's
    device and stream), else host (staged: with a separate twin, for tests)."""
    if comm.backend in ("nccl", "custom") and str(getattr(comm, "device", "cpu")).startswith("cuda"):
        device = int(str(comm.device).split(":", 1)[1])
        stream = getattr(comm, "bench_stream", None)
        lib = cuda_lib()
        return GpucollMem(device, stream) if lib == "gpucoll" else CudaMem(device, stream=stream, lib=lib)
    return StagedHostMem() if staged else HostMem()
