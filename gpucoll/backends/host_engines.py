"""What carries data between machines for the host backend (host_nodes.py): an engine that already moves CPU
buffers over the network, torch's gloo or MPI, behind the few calls HostNodes makes. One engine object per group of
ranks (the machines' leaders, or every rank).

Which one: MPI where the job was launched under MPI (mpiexec/mpirun/srun with PMI, or ``init(mpi_comm=...)``) and
mpi4py is installed, since its processes already share a working MPI; else gloo, wherever torch is installed.
gloo meets its peers through gpucoll's own authenticated store (GlooStore), so the job opens no second rendezvous.

Both return the same bits on every rank. gloo's all-reduce reduces each chunk once and sends the result round (its
ring); the MPI engine gathers the machines' partials and every rank folds them in machine order (MPI does not
promise the same bits everywhere, and has no bfloat16), so its all-reduce moves K times the data for K machines.
An engine's failure is an EngineFailure with gloo's or MPI's own words; HostNodes names the lost ranks.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import weakref

import numpy as np

from gpucoll._native import _C

_BF16_NAN = np.uint16(0x7FC0)


class EngineFailure(Exception):
    """The engine gave up: `timed_out` when it waited too long, else a peer failed or a connection broke."""

    def __init__(self, text: str, timed_out: bool):
        super().__init__(text)
        self.timed_out = timed_out


def _bytes(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def storage(buf, count: int | None = None, offset: int = 0) -> np.ndarray:
    """A NumPy view of `count` elements of `buf` from element `offset` (bfloat16 as its uint16 bits)."""
    n = buf.count if count is None else count
    raw = _bytes(buf.ptr + offset * buf.itemsize, n * buf.itemsize)
    return raw.view(np.uint16 if buf.dtype_name == "bfloat16" else np.dtype(buf.dtype_name))


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Rounded to nearest, ties to even, as the host backend's bfloat16 arithmetic does; NaN stays NaN."""
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), _BF16_NAN, rounded)


_NP_FOLD = {_C.RedOp.sum: np.add, _C.RedOp.prod: np.multiply, _C.RedOp.min: np.minimum, _C.RedOp.max: np.maximum}


def fold(parts: list, op, bf16: bool) -> np.ndarray:
    """The machines' partial results combined in machine order, in their dtype (int8 wraps, float16 rounds at every
    step): the same bits wherever it runs."""
    f = _NP_FOLD[op]
    if bf16:
        acc = _bf16_to_f32(parts[0])
        for p in parts[1:]:
            acc = _bf16_to_f32(_f32_to_bf16(f(acc, _bf16_to_f32(p))))
        return _f32_to_bf16(acc)
    acc = parts[0].copy()
    for p in parts[1:]:
        with np.errstate(over="ignore", invalid="ignore"):
            acc = f(acc, p).astype(parts[0].dtype, copy=False)
    return acc


# -- gloo -----------------------------------------------------------------------------------------------------------

def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, None
    return torch, dist


def gloo_available() -> bool:
    torch, dist = _torch()
    return torch is not None and dist.is_available() and dist.is_gloo_available()


def _gloo_store(base, timeout: float):
    """gpucoll's rendezvous store (a prefixed view of it) as a torch.distributed Store, for gloo's rendezvous."""
    _, dist = _torch()

    class GlooStore(dist.Store):
        def set(self, key, value):
            base.set(key, value if isinstance(value, bytes) else str(value).encode())

        def get(self, key):
            return base.get(key, timeout=timeout)

        def add(self, key, amount):
            return base.add(key, amount)

        def wait(self, keys, wait_timeout=None):
            for key in keys:
                base.get(key, timeout=timeout)

        def check(self, keys):
            return all(base.check(k) for k in keys)

    return GlooStore()


# Every gloo engine not yet closed. gloo runs each operation on a worker thread of its process group, which drops
# its reference to the operation (and to the tensors in it) when the operation ends. One that timed out here may
# end on that thread later, after the caller has moved on; if that is during the interpreter's finalization, torch
# must take the GIL to release the tensors' Python objects, Python ends the thread instead (pthread_exit), and the
# unwinding through torch's destructor aborts the process ("terminate called without an active exception", after
# a job that had recovered and finished). Closing every engine at exit, while Python still runs, destroys each
# process group, whose destructor joins its worker threads: what they still hold is released before finalization.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close()


atexit.register(_close_all)


class Gloo:
    """A gloo process group over `size` ranks meeting in `store`."""

    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout: float):
        torch, dist = _torch()
        self._torch, self._dist = torch, dist
        self.rank, self.size = rank, size
        self.pg = dist.ProcessGroupGloo(_gloo_store(store, timeout), rank, size,
                                        datetime.timedelta(seconds=float(timeout)))
        _LIVE.add(self)

    def close(self) -> None:
        """Destroys the process group now, even while a failed call's traceback still holds this engine: its
        destructor (which torch runs without the GIL) waits for gloo's worker threads, so an operation that timed
        out here and still runs there (until gloo's own timeout) ends first. Idempotent."""
        self.pg = None
        _LIVE.discard(self)

    def _t(self, arr: np.ndarray):
        return self._torch.from_numpy(arr) if arr.size else self._torch.empty(0, dtype=self._torch.uint8)

    def _view(self, buf, count=None, offset=0):
        t = self._t(storage(buf, count, offset))
        return t.view(self._torch.bfloat16) if buf.dtype_name == "bfloat16" else t

    @staticmethod
    def _wait(work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise EngineFailure(str(e), "imed out" in str(e)) from None

    def allgather_bytes(self, record: np.ndarray) -> np.ndarray:
        out = np.empty((self.size, record.size), np.uint8)
        self._wait(self.pg.allgather([[self._t(row) for row in out]], [self._t(record)]))
        return out

    def allreduce(self, buf, op) -> None:
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = {_C.RedOp.sum: self._dist.ReduceOp.SUM, _C.RedOp.prod: self._dist.ReduceOp.PRODUCT,
                         _C.RedOp.min: self._dist.ReduceOp.MIN, _C.RedOp.max: self._dist.ReduceOp.MAX}[op]
        self._wait(self.pg.allreduce([self._view(buf)], opts))

    def broadcast(self, buf, root: int) -> None:
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self.pg.broadcast([self._view(buf)], opts))

    def all_gather(self, src, dst, count: int) -> None:
        blocks = [self._view(dst, count, r * count) for r in range(self.size)]
        self._wait(self.pg.allgather([blocks], [self._view(src, count)]))

    def all_to_all(self, src, dst, count: int) -> None:
        n = count * self.size
        self._wait(self.pg.alltoall_base(self._view(dst, n), self._view(src, n), [], []))

    def gather(self, src, dst, count: int, root: int) -> None:
        opts = self._dist.GatherOptions()
        opts.rootRank = root
        blocks = [[self._view(dst, count, r * count) for r in range(self.size)]] if self.rank == root else []
        self._wait(self.pg.gather(blocks, [self._view(src, count)], opts))

    def scatter(self, src, dst, count: int, root: int) -> None:
        opts = self._dist.ScatterOptions()
        opts.rootRank = root
        blocks = [[self._view(src, count, r * count) for r in range(self.size)]] if self.rank == root else []
        self._wait(self.pg.scatter([self._view(dst, count)], blocks, opts))

    def p2p(self, batch) -> None:
        # Every send and receive is posted before any is waited for: a group's pairs never wait on each other.
        works = [(self.pg.send if send else self.pg.recv)([self._view(buf)], peer, 0) for send, peer, buf in batch]
        for work in works:
            self._wait(work)

    def barrier(self) -> None:
        self._wait(self.pg.barrier())


# -- MPI ------------------------------------------------------------------------------------------------------------

_MPI_LAUNCH_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")


def mpi_world(world_size: int, rank: int):
    """MPI's world communicator, where this process was launched under MPI with these rank and size and mpi4py is
    installed; else None. Importing mpi4py initialises MPI, so nothing is imported without an MPI launcher."""
    if not any(os.environ.get(v) for v in _MPI_LAUNCH_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    return world if (world.Get_size(), world.Get_rank()) == (world_size, rank) else None


class Mpi:
    """An mpi4py communicator (errors returned, not fatal, so that a failure reaches the caller as an error)."""

    name = "MPI"

    def __init__(self, comm):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _do(self, fn, *args) -> None:
        try:
            fn(*args)
        except self._MPI.Exception as e:
            raise EngineFailure(f"MPI error: {e}", False) from None

    def allgather_bytes(self, record: np.ndarray) -> np.ndarray:
        out = np.empty((self.size, record.size), np.uint8)
        self._do(self.comm.Allgather, record, out)
        return out

    def allreduce(self, buf, op) -> None:
        mine = storage(buf)
        parts = self.allgather_bytes(mine.view(np.uint8).reshape(-1))
        folded = fold([row.view(mine.dtype) for row in parts], op, buf.dtype_name == "bfloat16")
        mine[...] = folded

    def broadcast(self, buf, root: int) -> None:
        self._do(self.comm.Bcast, storage(buf).view(np.uint8), root)

    def all_gather(self, src, dst, count: int) -> None:
        self._do(self.comm.Allgather, storage(src, count).view(np.uint8), storage(dst, count * self.size).view(np.uint8))

    def all_to_all(self, src, dst, count: int) -> None:
        n = count * self.size
        self._do(self.comm.Alltoall, storage(src, n).view(np.uint8), storage(dst, n).view(np.uint8))

    def gather(self, src, dst, count: int, root: int) -> None:
        out = storage(dst, count * self.size).view(np.uint8) if self.rank == root else None
        self._do(self.comm.Gather, storage(src, count).view(np.uint8), out, root)

    def scatter(self, src, dst, count: int, root: int) -> None:
        whole = storage(src, count * self.size).view(np.uint8) if self.rank == root else None
        self._do(self.comm.Scatter, whole, storage(dst, count).view(np.uint8), root)

    def p2p(self, batch) -> None:
        reqs = []
        try:
            for send, peer, buf in batch:
                data = storage(buf).view(np.uint8)
                reqs.append(self.comm.Isend(data, peer, 0) if send else self.comm.Irecv(data, peer, 0))
            self._MPI.Request.Waitall(reqs)
        except self._MPI.Exception as e:
            raise EngineFailure(f"MPI error: {e}", False) from None

    def barrier(self) -> None:
        self._do(self.comm.Barrier)
