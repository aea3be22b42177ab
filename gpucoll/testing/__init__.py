"""Testing and benchmarking helpers. ``virtual_ranks(P)``: P ranks of the custom allreduce in ONE process on ONE GPU;
``DeviceArray``: CUDA device memory gpucoll allocates itself (no torch or CuPy needed; on gpucoll's emulated CUDA
device it is the only kind there is).

    with gpucoll.testing.virtual_ranks(4, device=0) as vr:
        xs = [torch.full((n,), r, device="cuda:0") for r in range(4)]   # one input per rank
        torch.cuda.synchronize()                                         # inputs ready before vr's streams run
        vr.all_reduce(xs, algo="twoshot", op="sum")                       # enqueues P kernels, one per rank stream
        vr.synchronize()                                                  # xs[r] now hold the sum on every r

    xs = [DeviceArray.from_host(np.full(n, r, np.float32)) for r in range(4)]   # the same without torch

What it is: P ``_C.CustomComm`` objects sharing one device, each with its own CUDA stream (``vr.streams``), wired
to each other with plain pointers (no IPC). One host thread must enqueue all P kernels of a collective before any
can finish (they wait on each other's flags), which is why every call takes the list of the P ranks' buffers.

The limit it lives under: the P kernels of one call spin on each other, so ALL their blocks must be resident on the
GPU at once; a block waiting for a peer's block that cannot be scheduled would wait forever. Each rank's grid is
therefore capped at floor(SMs x resident blocks per SM / P) (``_C.custom_max_blocks_per_rank``), and creating more
virtual ranks than can each get one resident block raises InvalidArgument. Other work on the GPU at the same time
(another stream, another process) can take the SMs the ranks need; run virtual ranks on an otherwise idle GPU.
Under tools that serialise kernel launches (compute-sanitizer, CUDA_LAUNCH_BLOCKING=1) virtual ranks cannot
progress: use ``gpucoll.spawn(fn, P, backend="custom")`` (one process per rank) there.

For the benchmark (``gpucoll-bench all_reduce --backend custom``):
    vr.all_reduce(xs, outs=None, op="sum", algo="auto")  one collective on all ranks (algo: auto, oneshot, twoshot,
                                                          ring, tree); in place when outs is None
    vr.register(xs)                                       zero-copy inputs for later calls on exactly xs
    with vr.graph_capture() as g: vr.all_reduce(...)      one CUDA graph for all ranks' streams; g.replay(n)
    vr.synchronize(); vr.streams (raw cudaStream_t ints); vr.launch_shape(algo, nbytes, dtype); vr.close()
Buffers: anything ``gpucoll`` resolves (torch, CuPy, DLPack, ``__cuda_array_interface__``) on `device`.

``gpucoll.testing.cluster``: several "nodes" on one Linux machine (network and hostname namespaces), for the code
paths that only run across machines (``python -m gpucoll.testing.cluster --help``).
"""

from __future__ import annotations

import contextlib

from gpucoll import _buffers, _cuda_buffers
from gpucoll._device_array import DeviceArray
from gpucoll._native import _C
from gpucoll.backends import custom
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage

__all__ = ["DeviceArray", "VirtualRanks", "virtual_ranks"]


class VirtualRanks:
    """P custom-allreduce ranks in this process on one GPU; see the module docstring."""

    _broken = False  # set once a call timed out (see synchronize)

    def __init__(self, nranks: int, device: int = 0, *, buffer_bytes: int | None = None, timeout: float = 60.0):
        if isinstance(nranks, bool) or not isinstance(nranks, int) or not 1 <= nranks <= _C.CUSTOM_MAX_RANKS:
            raise InvalidArgument(f"nranks must be an int in [1, {_C.CUSTOM_MAX_RANKS}]; got {nranks!r}")
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise InvalidArgument(f"device must be a CUDA device index; got {device!r}")
        custom.check_usable("gpucoll.testing.virtual_ranks")
        half = custom.half_bytes() if buffer_bytes is None else int(buffer_bytes) // 256 * 256
        if half < 4096:
            raise InvalidArgument(f"buffer_bytes must be at least 4096; got {buffer_bytes!r}")
        self.nranks, self.device, self._closed = nranks, device, False
        self.comms = []
        self._streams = []
        try:
            self.comms = [_C.CustomComm(r, nranks, device, half, float(timeout)) for r in range(nranks)]
            for c in self.comms:
                c.connect_local(self.comms)  # raises InvalidArgument past the residency limit
            self._streams = [_C.CudaStream(device) for _ in range(nranks)]
        except BaseException:
            self.close()
            raise
        self._graph = None
        self._registered = []

    @property
    def streams(self) -> list:
        """Each rank's raw cudaStream_t."""
        return [s.handle for s in self._streams]

    def launch_shape(self, algo: str, nbytes: int, dtype="float32", op="sum") -> tuple:
        """(blocks, threads) per rank of one call, the residency cap included."""
        return self.comms[0].shape_for(algo, int(nbytes), getattr(_C.DType, dtype), getattr(_C.RedOp, op))

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidUsage("these virtual ranks are closed")
        if self._broken:
            # Every later wait would give up at once (the kernels' timeout flag stays set): refuse instead of
            # returning garbage.
            raise InvalidUsage("a call of these virtual ranks timed out waiting for a peer; they are unusable: "
                               "close them and make new ones")

    def _resolve_all(self, xs, name: str, writable: bool) -> list:
        if not isinstance(xs, (list, tuple)) or len(xs) != self.nranks:
            raise InvalidArgument(f"{name} must be a list of {self.nranks} arrays, one per rank")
        bufs = [_buffers.resolve(x, f"{name}[{r}]", writable=writable) for r, x in enumerate(xs)]
        for r, b in enumerate(bufs):
            _cuda_buffers.check_device(b, f"{name}[{r}]", self.device)
            if b.count != bufs[0].count or b.dtype != bufs[0].dtype:
                raise InvalidArgument(f"every rank's array must match {name}[0] ({bufs[0].count} x "
                                      f"{bufs[0].dtype_name}); {name}[{r}] has {b.count} x {b.dtype_name}")
        return bufs

    def all_reduce(self, xs, outs=None, op="sum", algo="auto", streams=None):
        """One allreduce over the P ranks: rank r reduces xs[r] into outs[r] (xs[r] when outs is None), on its
        stream (``streams[r]`` if given: raw handles or torch/CuPy streams). Returns the outputs."""
        self._check_open()
        src = self._resolve_all(xs, "xs", writable=outs is None)
        dst = src if outs is None else self._resolve_all(outs, "outs", writable=True)
        if dst[0].count != src[0].count or dst[0].dtype != src[0].dtype:
            raise InvalidArgument("outs must have the size and dtype of xs")
        redop = getattr(_C.RedOp, op, None) if isinstance(op, str) else None
        if redop is None:
            raise InvalidArgument(f"op must be one of sum, min, max, avg; got {op!r}")
        name = custom.resolve_algo(algo, src[0].nbytes, self.nranks)
        handles = self.streams if streams is None else [_cuda_buffers.stream_handle(s, self.device) for s in streams]
        if len(handles) != self.nranks:
            raise InvalidArgument(f"streams must hold {self.nranks} streams")
        if len(set(handles)) != self.nranks:
            # Two ranks on one stream: the second rank's kernel queues behind the first, which spins waiting for it.
            raise InvalidArgument(f"streams must be {self.nranks} distinct streams (two ranks on one stream wait for "
                                  f"each other forever); got handles {handles}")
        # Piece i of every rank before piece i + 1 of any: a rank's later piece queued ahead of a peer's earlier one
        # deadlocks where two ranks' streams share a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS) or a launch
        # queue fills (see CustomComm::all_reduce).
        piece, npieces = 0, 1
        while piece < npieces:
            for r, c in enumerate(self.comms):
                npieces = c.all_reduce(src[r].ptr, dst[r].ptr, src[r].count, src[r].dtype, redop, name, handles[r],
                                       piece=piece)
            piece += 1
        return [b.obj for b in dst]

    def register(self, xs) -> None:
        """Zero-copy inputs: later calls whose xs[r] is exactly this array read it in place."""
        self._check_open()
        bufs = self._resolve_all(xs, "xs", writable=False)
        ptrs = [b.ptr for b in bufs]
        for r, c in enumerate(self.comms):
            c.register_local(ptrs[r], bufs[r].nbytes, ptrs)
        # Kept alive with the ranks: registration is by address, and a freed array's address can come back.
        self._registered.extend(b.obj for b in bufs)

    @contextlib.contextmanager
    def graph_capture(self):
        """Capture the calls made inside the block on all P streams into one CUDA graph (yielded; replay it with
        ``g.replay(times)`` on rank 0's stream, then ``synchronize()``). Inputs first seen inside are registered
        on exit, so replays read them in place."""
        self._check_open()
        graph = _C.MultiStreamGraph(self.device, self.streams)
        for c in self.comms:
            c.set_defer_registration(True)
        try:
            graph.begin()
            try:
                yield graph
            finally:
                graph.end()
        finally:
            for c in self.comms:
                c.set_defer_registration(False)
        pending = [c.pending() for c in self.comms]
        if len({len(p) for p in pending}) != 1:
            raise InvalidUsage(f"ranks captured different numbers of new buffers: {[len(p) for p in pending]}")
        rows = [[pending[q][i][0] for q in range(self.nranks)] for i in range(len(pending[0]))]
        for c in self.comms:
            c.register_pending_local(rows)

    def synchronize(self) -> None:
        """Wait for every rank's stream; CollectiveTimeout if a kernel gave up waiting for a peer, InvalidArgument if
        the ranks' calls differed (the kernels moved no data then, and the ranks stay usable)."""
        if self._closed:
            raise InvalidUsage("these virtual ranks are closed")
        for s in self._streams:
            s.synchronize()
        waiting = [r for r, c in enumerate(self.comms) if c.timed_out()]
        if waiting:
            self._broken = True
            missing = sorted({q for r in waiting for q in self.comms[r].late_ranks()})
            raise CollectiveTimeout(f"virtual ranks {waiting} timed out waiting for rank(s) {missing} (blocks not "
                                    f"resident at once, or a rank's kernel was never enqueued)", ranks=missing)
        # Every rank's kernel records the same mismatch: consume each rank's report, raise it once.
        found = []
        for c in self.comms:
            try:
                c.check_calls()
            except InvalidArgument as e:
                found.append(e)
        if found:
            raise found[0]

    def close(self) -> None:
        """Synchronise and free every rank (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for c in self.comms:
            c.synchronize()
        for c in self.comms:
            c.close()
        self._streams = []
        self.comms = []
        self._registered = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def virtual_ranks(nranks: int, device: int = 0, **kwargs) -> VirtualRanks:
    """P ranks of the custom allreduce in this process on one GPU (see the module docstring). Raises Unsupported
    without a CUDA build or GPU, InvalidArgument past the residency limit."""
    return VirtualRanks(nranks, device, **kwargs)
