"""--backend custom: P virtual ranks on one GPU, in this process (gpucoll.testing.virtual_ranks, issue 5).

gpucoll's own kernels can run P ranks on one GPU from one process: ``vr = gpucoll.testing.virtual_ranks(P,
device=0)`` holds P communicators (``vr.comms``) and issues one collective on all of them at once, each rank on
its own stream (``vr.all_reduce([x0, ..., xP-1], outs=[...], op=..., algo=...)``). The harness, though, is written
for one rank per caller. This module is the one adapter between the two: each virtual rank runs the unchanged
harness in its own thread with a VirtualComm; every collective call is a rendezvous of the P threads, and the last
to arrive issues the call on all P ranks through `vr`. The harness's bookkeeping (times, wrong counts) goes through
the same rendezvous on host arrays. Nothing else in gpucoll-bench knows about virtual ranks.

The rendezvous costs a few microseconds of Python per call; GPU time is measured with events on each rank's stream
(``vr.streams[r]`` when `vr` has them, else a device synchronize around the loop), so small-message latencies
include that host overhead when it exceeds the kernel time.
"""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np

from gpucoll import testing
from gpucoll._native import _C
from gpucoll.backends import custom
from gpucoll.bench import devmem
from gpucoll.errors import InvalidArgument, RemoteError, Unsupported

SUPPORTED = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
_HOST_OPS = {"sum": np.add.reduce, "min": np.minimum.reduce, "max": np.maximum.reduce}


def _factory():
    """gpucoll.testing.virtual_ranks, or None when this gpucoll has no virtual ranks."""
    return getattr(testing, "virtual_ranks", None)


def runs(coll: str) -> bool:
    """Whether virtual ranks run `coll` (gpucoll.testing.VirtualRanks has a method of that name)."""
    return coll in SUPPORTED and hasattr(getattr(testing, "VirtualRanks", object), coll)


def problem(coll: str | None = None) -> str | None:
    """Why --backend custom cannot run here (one sentence that says what to use instead), or None."""
    probe = _C.cuda_probe()
    if not probe.get("device_count"):
        return (f"--backend custom needs a CUDA GPU and this machine has none ({probe.get('reason') or 'no device'});"
                f" use --backend host to benchmark the CPU shared-memory backend")
    if _factory() is None:
        return ("--backend custom needs gpucoll.testing.virtual_ranks (gpucoll's own CUDA kernels), which this "
                "gpucoll does not have; use --backend nccl (or --backend host)")
    if devmem.cuda_lib() is None:
        return "--backend custom allocates CUDA buffers with torch or CuPy: install one with CUDA support"
    if coll is not None and not runs(coll):
        return f"--backend custom (gpucoll's own kernels) does not run {coll}: use --backend nccl"
    return None


def kernel_problem(dtype: str, op: str | None) -> str | None:
    """Why gpucoll's own allreduce kernels have no kernel for gpucoll dtype `dtype` with `op` (None: any op), or
    None. Asked of the custom backend's eligibility rules (csrc/backends/custom/eligibility.cc) rather than a
    copy of their lists: a row the kernels refuse fails every virtual rank's run."""
    why = _C.custom_eligibility(1, ["localhost"], [1], getattr(_C.DType, dtype), getattr(_C.RedOp, op or "sum"),
                                False, 64, 0, 0)
    return None if why["ok"] else why["reason"]


def algo_problem(algo: str) -> str | None:
    """Why gpucoll's own kernels have no algorithm `algo` (the host schedules have more: halving_doubling,
    hierarchical, direct), or None."""
    if algo == "auto":
        return None
    try:
        _C.custom_algo_name(algo)
    except InvalidArgument:
        return "gpucoll's CUDA kernels implement oneshot, twoshot, ring and tree (dbt: tree)"
    return None


class _World:
    """The P virtual ranks' meeting point: exchange() returns once every rank deposited its value, with this
    rank's share of combine(values), run once by the last rank to arrive."""

    def __init__(self, vr, nranks: int, device: int, timeout: float):
        self.vr, self.n, self.device = vr, nranks, device
        self._slots: list = [None] * nranks
        self._results: list = [None] * nranks
        self._error: BaseException | None = None
        # A rank reads its result right after the wait, before it can deposit again; the next action runs only
        # once every rank deposited again, i.e. after every rank read: one barrier per call is enough.
        self._barrier = threading.Barrier(nranks, action=self._act, timeout=timeout)

    def _act(self) -> None:
        names = {s[0] for s in self._slots}
        try:
            if len(names) != 1:
                raise InvalidArgument(f"virtual ranks called different operations at once: {sorted(names)}")
            out = self._slots[0][2]([s[1] for s in self._slots])
            self._results = list(out) if out is not None else [None] * self.n
            self._error = None
        except BaseException as e:  # noqa: BLE001 - handed to every rank
            self._results, self._error = [None] * self.n, e
        self._slots = [None] * self.n

    def exchange(self, rank: int, name: str, value, combine):
        self._slots[rank] = (name, value, combine)
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RemoteError(f"virtual rank {rank}: another virtual rank failed or timed out during {name}",
                              ranks=(rank,)) from None
        if self._error is not None:
            raise self._error
        return self._results[rank]

    def abort(self) -> None:
        self._barrier.abort()

    def stream(self, rank: int):
        streams = getattr(self.vr, "streams", None)
        return streams[rank] if streams is not None else "device"


def _issue(vr, name: str, kwargs: dict):
    """combine() for a collective: call vr.<name> with per-rank lists (x, out) and the shared arguments."""
    def combine(values):
        fn = getattr(vr, name, None)
        if fn is None:
            raise Unsupported(f"gpucoll.testing.virtual_ranks has no {name}")
        xs = [v[0] for v in values]
        outs = [v[1] for v in values]
        extra = dict(kwargs)
        if any(o is not None for o in outs):
            extra["outs"] = outs
        res = fn(xs, **extra)
        return res if isinstance(res, (list, tuple)) and len(res) == len(values) else None
    return combine


class _CallCheckSwitch:
    """What --compare unchecked switches on a virtual rank: the kernels' cross-rank call check, on every rank (each
    rank's thread sets the same value before the calls it times meet in _World.exchange)."""

    def __init__(self, vr):
        self._vr = vr

    def _set_call_check(self, on: bool) -> None:
        for c in self._vr.comms:
            c._set_call_check(on)


class VirtualComm:
    """One virtual rank, with the Communicator methods the harness calls."""

    backend = "custom"

    def __init__(self, world: _World, rank: int):
        self._world = world
        self.rank, self.world_size = rank, world.n
        self.device = f"cuda:{world.device}"
        self.bench_stream = world.stream(rank)
        self._ops = types.SimpleNamespace(impl=_CallCheckSwitch(world.vr))  # as Communicator._ops.impl

    def _call(self, name: str, x, out=None, **kwargs):
        res = self._world.exchange(self.rank, name, (x, out), _issue(self._world.vr, name, kwargs))
        return res if res is not None else (out if out is not None else x)

    def host_all_reduce(self, arr: np.ndarray, op: str = "sum") -> np.ndarray:
        """The harness's bookkeeping (devmem reduce_small): a host array reduced over the virtual ranks."""
        reduced = self._world.exchange(self.rank, f"host {op}", arr.copy(),
                                       lambda vals: [_HOST_OPS[op](np.stack(vals))] * len(vals))
        arr[...] = reduced
        return arr

    def barrier(self) -> None:
        self._world.exchange(self.rank, "barrier", None, lambda vals: None)

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        """The kernel a call runs, as CustomComm names it ("custom:oneshot"): virtual ranks resolve "auto" by
        gpucoll.testing.VirtualRanks' rule, the kernels' own size rule. Their kernels are all_reduce's (coll 0)."""
        if coll != 0:
            raise Unsupported("virtual ranks run gpucoll's all_reduce kernels only")
        return f"custom:{custom.resolve_algo(algo, nbytes, self.world_size)}"

    def all_reduce(self, x, out=None, op="sum", algo="auto"):
        return self._call("all_reduce", x, out, op=op, algo=algo)

    def broadcast(self, x, root=0, algo="auto"):
        return self._call("broadcast", x, root=root, algo=algo)

    def reduce(self, x, out=None, op="sum", root=0, algo="auto"):
        return self._call("reduce", x, out, op=op, root=root, algo=algo)

    def all_gather(self, x, out=None, algo="auto"):
        return self._call("all_gather", x, out, algo=algo)

    def reduce_scatter(self, x, out=None, op="sum", algo="auto"):
        return self._call("reduce_scatter", x, out, op=op, algo=algo)

    def all_to_all(self, x, out=None, algo="auto"):
        return self._call("all_to_all", x, out, algo=algo)

    def gather(self, x, out=None, root=0, algo="auto"):
        return self._call("gather", x, out, root=root, algo=algo)

    def scatter(self, x, out=None, root=0, algo="auto"):
        return self._call("scatter", x, out, root=root, algo=algo)

    @contextlib.contextmanager
    def group(self):
        raise Unsupported("virtual ranks have no point-to-point operations (sendrecv): use --backend nccl")
        yield  # pragma: no cover


def run(fn, nranks: int, args: tuple = (), timeout: float = 300.0, device: int = 0) -> list:
    """fn(comm, *args) on `nranks` virtual ranks of `device`, one thread each; the results in rank order. The
    first failure (not a consequence of another rank's) is raised with `.rank` set."""
    factory = _factory()
    if factory is None:
        raise Unsupported(problem() or "gpucoll.testing.virtual_ranks is not available")
    # The kernels' own wait for peers (a spinning rank gives up after it) is the run's timeout too.
    vr = factory(nranks, device=device, timeout=timeout)
    world = _World(vr, nranks, device, timeout)
    results: list = [None] * nranks
    errors: dict = {}

    def target(rank: int) -> None:
        try:
            results[rank] = fn(VirtualComm(world, rank), *args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller below
            errors[rank] = e
            world.abort()

    threads = [threading.Thread(target=target, args=(r,), name=f"gpucoll-bench-vrank{r}", daemon=True)
               for r in range(nranks)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 30.0)
        if not errors and not any(t.is_alive() for t in threads):
            # A kernel that gave up waiting for a peer leaves a flag and wrong (or, with -c 0, unchecked) rows:
            # vr.synchronize() raises CollectiveTimeout naming the ranks instead of a clean-looking table.
            sync = getattr(vr, "synchronize", None)
            if sync is not None:
                sync()
    finally:
        close = getattr(vr, "close", None)
        if close is not None:
            close()
    if any(t.is_alive() for t in threads):
        world.abort()
        raise RemoteError(f"virtual ranks did not finish within {timeout + 30.0:g} s", ranks=tuple(range(nranks)))
    if errors:
        # A rank's own error first; "another virtual rank failed" errors are consequences.
        rank = min(errors, key=lambda r: (isinstance(errors[r], RemoteError), r))
        exc = errors[rank]
        exc.rank = rank
        raise exc
    return results
