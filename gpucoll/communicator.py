"""The Communicator: argument checks and buffer resolution in one place, then one call into its backend
(gpucoll/backends/: the Backend interface in base.py). ``gpucoll.init`` (gpucoll/_make.py) builds one from the
launcher's environment and a rendezvous store; ``_build`` here, from a store and a launch description (init, and the
communicators that split, shrink and grow make)."""

from __future__ import annotations

import contextlib
import functools

from gpucoll import _buffers, _coalesced, _log, backends, compression, config, flight_recorder
from gpucoll import group as groups
from gpucoll._native import _C
from gpucoll.backends.base import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    GATHER,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
)
from gpucoll.backends.premul import PreMulSum
from gpucoll.backends.router import Router, host_maker
from gpucoll.backends.usable import BACKENDS  # noqa: F401 - init's backend names (also used from here)
from gpucoll.bootstrap import LaunchInfo
from gpucoll.bootstrap.store import TCPStore
from gpucoll.errors import (
    CollectiveTimeout,
    GpucollError,
    InternalError,
    InvalidArgument,
    InvalidUsage,
    RemoteError,
    Unsupported,
)
from gpucoll.stragglers import Stragglers

OPS = ("sum", "prod", "min", "max", "avg")


_OP_CACHE: dict = {}


def _parse_op(op):
    try:
        return _OP_CACHE[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, _C.RedOp):
        return op
    if isinstance(op, str) and op.lower() in OPS:
        _OP_CACHE[op] = getattr(_C.RedOp, op.lower())
        return _OP_CACHE[op]
    if type(op) is PreMulSum:
        return op
    raise InvalidArgument(f"op must be one of {', '.join(OPS)} or gpucoll.premul_sum(scalar); got {op!r}")


def _result(work, value):
    """What an async_op=True call returns: the backend's gpucoll._C.Work, or a completed one."""
    if work is None:
        return _C.Work(value)
    work._result = value
    return work


class Communicator:
    """A group of ranks that run collectives together. Build one with ``gpucoll.init`` or ``gpucoll.spawn``."""

    def __init__(self, *, rank: int, world_size: int, backend: str, ops, store, timeout: float,
                 local_size: int = 0, make_host=None):
        """`ops`: this rank's Backend of kind `backend` (gpucoll/backends/), built over `store`."""
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._store = store
        self._timeout = timeout
        self._closed = False
        self._local_size = local_size
        self._close_reason = "close() was called"
        self._failed: set = set()  # ranks named by a CollectiveTimeout or RemoteError of this communicator
        self._shrinks = self._grows = self._group_depth = 0
        self._group_refs: list = []  # buffers of the operations queued in the open group()
        # Everything that depends on the backend (backends/base.py); with backend='auto' on a GPU, its Router.
        self._ops = ops if make_host is None else Router(ops, make_host)
        # The host backend's one-call path for the commonest call, all_reduce(x) of a NumPy array in place.
        self._fast_all_reduce = getattr(self._ops, "fast_all_reduce", None)

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def timeout(self) -> float:
        """Seconds a collective (and set-up) may wait for peers before failing."""
        return self._timeout

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def device(self) -> str:
        """Where this communicator's buffers live: "cuda:N" (nccl backend) or "cpu"."""
        return self._ops.device

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<gpucoll.Communicator rank={self._rank} world_size={self._world_size} backend={self._backend} {state}>"

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the communicator's resources. Idempotent; later calls raise InvalidUsage."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ops.close()
        finally:
            if isinstance(self._store, TCPStore):  # rank 0 serves it: peers may still be leaving the last barrier
                self._store.close(wait_for_others=0.0 if self._failed else min(self._timeout, 3.0))
            elif self._store is not None:
                self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def abort(self) -> None:
        """Stop at once without waiting for issued operations (nccl: ncclCommAbort, which also ends kernels
        waiting on peers), then close. Idempotent; later calls raise InvalidUsage."""
        if self._closed:
            return
        try:
            self._ops.abort(f"abort() was called on rank {self._rank}")
        finally:
            self._close_reason = "abort() was called"
            self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidUsage(f"{what} on a closed communicator ({self._close_reason})")

    # -- collectives --------------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Returns once every rank has called barrier()."""
        self._check_open("barrier")
        try:
            self._ops.barrier()
        except (CollectiveTimeout, RemoteError) as e:
            self._failure(e)
            raise

    def trace(self, last: int = 0) -> dict:
        """This rank's flight recorder: its last `last` operations (0: all it holds, GPUCOLL_TRACE_BUFFER), oldest
        first, each with its call, size, algorithm, state and times (CLOCK_MONOTONIC ns; add realtime_ns -
        monotonic_ns for wall-clock time). What a failed collective dumps to a file (python -m gpucoll trace)."""
        self._check_open("trace")
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise InvalidArgument(f"last must be an int >= 0 (0: every entry held); got {last!r}")
        return self._ops.trace(last)

    def dump_trace(self, path: str | None = None) -> str:
        """Writes this rank's flight recorder to `path` (default: GPUCOLL_TRACE_DIR or the temporary directory,
        gpucoll-trace-<communicator>-rank<r>.json) and returns the path; no communication. Dump every rank and
        merge the files with python -m gpucoll trace for the timeline and the straggler table of a running job."""
        self._check_open("dump_trace")
        return flight_recorder.dump(self._trace_source(), path)

    def stragglers(self, reset: bool = False) -> Stragglers:
        """Each rank's lateness at the last 1000 collectives, and how often it arrived last (gpucoll/stragglers.py):
        who sets everyone's pace. reset=True empties the window after reading. The host backend measures every
        collective where it compares the calls (local and free); the NCCL backend compares enqueue times, reading the
        peers' published samples from the store (not collective: any rank may ask at any time)."""
        self._check_open("stragglers")
        return Stragglers.from_native(self._ops.stragglers(bool(reset)))

    # -- new communicators from this one (gpucoll/group.py) ---------------------------------------------
    def split(self, color, key=None):
        """Collective, like MPI_Comm_split: the ranks that pass the same `color` (an int >= 0) form a new
        communicator of this one's backend, ranked by `key` (default: this rank), ties by rank; color None takes
        no part and gets None. The new communicator shares nothing with this one at run time (its own shared
        memory, NCCL communicator or peer memory), so both, and siblings, may run collectives at once. Close it
        before this one: it meets its peers through this communicator's rendezvous store."""
        self._check_open("split")
        return groups.split(self._store, self._rank, self._world_size, self._timeout, color, key, self._child,
                            native=self._native_split())

    def subgroup(self, ranks):
        """Collective: the communicator of the ranks in `ranks` (a gpucoll.Group or an iterable of ranks, the same
        on every rank), numbered in rank order; None on the ranks outside it."""
        self._check_open("subgroup")
        g = ranks if isinstance(ranks, groups.Group) else groups.Group(ranks)
        outside = [r for r in g if r >= self._world_size]
        if outside or not len(g):
            raise InvalidArgument(f"ranks must be a non-empty set of ranks of this communicator (0 to "
                                  f"{self._world_size - 1}); got {g!r}")
        return groups.split(self._store, self._rank, self._world_size, self._timeout, 0 if self._rank in g else None,
                            None, self._child, asked=list(g.ranks), native=self._native_split())

    def shrink(self, exclude=()):
        """Collective over the surviving ranks, after a failure: a communicator of this one's backend holding every
        rank that calls shrink, except those in `exclude`, renumbered densely in rank order. Ranks named dead by an
        earlier CollectiveTimeout or RemoteError of this communicator (or excluded by any rank) are not waited
        for; any other rank is waited for up to the timeout. Survivors agree through the rendezvous store (served
        by rank 0, which must be alive) even when they saw different failures first; a rank that arrives after
        the survivors were decided gets InvalidUsage. This communicator is left as it is: close or abort it."""
        self._check_open("shrink (shrink first, then close or abort this communicator: the new one meets its "
                         "peers through this one's rendezvous store)")
        if isinstance(exclude, int) and not isinstance(exclude, bool):
            exclude = (exclude,)
        self._shrinks += 1
        return groups.shrink(self._store, self._rank, self._world_size, self._timeout, self._shrinks, exclude,
                             self._failed, self._child, native=self._native_shrink())

    def grow(self):
        """Collective over this communicator's ranks, at a point where every rank is (a step boundary): admit every
        process waiting in gpucoll.join() on this communicator's store. Returns a communicator of this one's
        backend with the newcomers as ranks world_size, world_size + 1, ... (in the order they asked), every old
        rank keeping its number. This communicator is left as it is: close it. waiting_to_join() tells whether
        anyone is waiting (ask on one rank and broadcast the answer, so that every rank decides alike)."""
        self._check_open("grow")
        self._grows += 1
        return groups.grow(self._store, self._rank, self._world_size, self._timeout, self._grows, self._child)

    def waiting_to_join(self) -> int:
        """How many processes are waiting in gpucoll.join() to be admitted by grow() (local; no communication with
        the other ranks)."""
        self._check_open("waiting_to_join")
        return groups.waiting_to_join(self._store)

    def join_address(self) -> tuple:
        """(address, port) for gpucoll.join(): this communicator's rendezvous store, when it is gpucoll's own (a
        communicator from init or spawn, or one made by shrink or grow)."""
        self._check_open("join_address")
        if not isinstance(self._store, TCPStore):
            raise Unsupported("join_address: this communicator meets through another store (torch's, or its "
                              "parent's, for split and subgroup); new processes can join only a communicator with "
                              "gpucoll's own store (from init, spawn, shrink or grow)")
        return self._store.reachable_address(), self._store.port

    def _native_split(self):
        """The backend's own split for groups.split (ncclCommSplit), where it can run now; else None."""
        if not self._ops.can_split():
            return None

        def native(color, rank: int, size: int, store, members: list):
            return self._adopt(self._ops.split(color, rank, store), rank, size, store, members, "split off")
        return native

    def _adopt(self, made, rank: int, size: int, store, members: list, how: str):
        """A Communicator around the Backend that the backend made from this one's (None stays None)."""
        if made is None:
            return None
        if (made.rank, made.world_size) != (rank, size):
            raise InternalError(f"the {self._backend} backend made rank {made.rank} of {made.world_size}; the ranks "
                                f"agreed on rank {rank} of {size} (members {members})")
        _log.debug(f"rank {self._rank} is rank {rank} of {size} in a communicator of ranks {members} {how} by the "
                   f"{self._backend} backend")
        return type(self)(rank=rank, world_size=size, backend=self._backend, ops=made, store=store,
                          timeout=self._timeout, make_host=host_maker(_store_launch(rank, size), store, self._timeout)
                          if isinstance(self._ops, Router) else None)

    def _native_shrink(self):
        """The backend's own shrink for groups.shrink (ncclCommShrink), where it can run now; else None."""
        if self._failed or not self._ops.can_shrink():
            return None

        def native(gone: list, rank: int, size: int, store, members: list):
            return self._adopt(self._ops.shrink(gone, store), rank, size, store, members, "shrunk")
        return native

    def _child(self, rank: int, size: int, store, members: list):
        """The communicator of a split, subgroup or shrink: this one's backend, device and timeout, over `store`."""
        device = self._ops.device
        index = int(device.split(":")[1]) if device.startswith("cuda:") else None
        _log.debug(f"rank {self._rank} is rank {rank} of {size} in a new communicator of ranks {members}")
        return _build(_store_launch(rank, size), store, self._backend, self._timeout, 0, index, self._backend,
                      with_host=isinstance(self._ops, Router))

    def all_reduce(self, x, out=None, op="sum", algo="auto", *, compress=None, stream=None, async_op=False):
        """Reduce `x` element-wise across ranks with `op`; every rank gets the result.

        In place when `out` is None (the result is written to `x`, which is returned); otherwise `out` must
        have x's size and dtype and not overlap it, and is returned.

        compress="int8", "fp8" or "bf16": a float sum or avg moved in that format, reduced in float32; the same bits
        on every rank, within gpucoll.compression.error_bound (docs/compression.md). Host backend.
        """
        self._check_open("all_reduce")
        if compress is not None:
            return self._compressed_all_reduce(x, out, op, algo, compress, stream, async_op)
        if out is None and self._fast_all_reduce is not None:
            try:
                if self._fast_all_reduce(x, op, algo, stream, async_op):
                    return x
            except (CollectiveTimeout, RemoteError) as e:
                self._failure(e)
                raise
        src = self._resolve(x, "x", writable=out is None)
        dst = self._resolve_out(src, out, src.count)
        redop = _parse_op(op)
        work = self._run(ALL_REDUCE, algo, src, dst, src.count, redop, 0, stream, async_op)
        return _result(work, dst.obj) if async_op else dst.obj

    def _compressed_all_reduce(self, x, out, op, algo, compress, stream, async_op):
        compression.check_call(compress, algo)
        src = self._resolve(x, "x", writable=out is None)
        dst = self._resolve_out(src, out, src.count)
        try:
            work = self._ops.compressed_all_reduce(src, dst, _parse_op(op), compress, stream, async_op)
        except (CollectiveTimeout, RemoteError) as e:
            self._failure(e)
            raise
        return self._fused(work, dst.obj, async_op)

    def _torch_all_reduce(self, ops: dict):
        """The backend's one native call for gpucoll.torch's dist.all_reduce (Host.torch_all_reduce), or None."""
        make = getattr(self._ops, "torch_all_reduce", None)
        return make(ops) if make is not None else None

    def broadcast(self, x, root=0, algo="auto", *, stream=None, async_op=False):
        """Copy root's `x` into `x` on every rank (in place); returns `x`."""
        self._check_open("broadcast")
        root = self._check_rank(root, "root")
        src = self._resolve(x, "x", writable=True)
        work = self._run(BROADCAST, algo, src, src, src.count, None, root, stream, async_op)
        return _result(work, x) if async_op else x

    def reduce(self, x, out=None, op="sum", root=0, algo="auto", *, stream=None, async_op=False):
        """Reduce `x` across ranks onto `root`: the result lands in `out` (or `x` when out is None) on root;
        other ranks' buffers are left as they were. Returns the output array on root, `x` elsewhere."""
        self._check_open("reduce")
        root = self._check_rank(root, "root")
        redop = _parse_op(op)
        src = self._resolve(x, "x", writable=out is None and self._rank == root)
        # `out` is checked wherever it is given, root or not: an argument error must stop every rank that made
        # it, or the ranks that went ahead would run this collective alone and fall out of step.
        dst = self._resolve_out(src, out, src.count) if self._rank == root or out is not None else src
        work = self._run(REDUCE, algo, src, dst, src.count, redop, root, stream, async_op)
        result = dst.obj if self._rank == root else src.obj
        return _result(work, result) if async_op else result

    def all_gather(self, x, out=None, algo="auto", *, stream=None, async_op=False):
        """Concatenate every rank's `x` along axis 0 in rank order: ``world_size * len(x)`` rows."""
        self._check_open("all_gather")
        src = self._resolve(x, "x")
        shape = self._scaled_shape(src, self._world_size)
        dst = self._resolve_out(src, out, src.count * self._world_size, shape, slice_in_place="x_in_out")
        work = self._run(ALL_GATHER, algo, src, dst, src.count, None, 0, stream, async_op)
        return _result(work, dst.obj) if async_op else dst.obj

    def all_reduce_coalesced(self, arrays, op="sum", *, async_op=False):
        """all_reduce of each array of `arrays` (one dtype) in place, fused into as few collectives as the backend can
        (tensor fusion; gpucoll/_coalesced.py says how on each backend). Every rank passes arrays of the same sizes in
        the same order. Returns `arrays` (a Work for async_op)."""
        self._check_open("all_reduce_coalesced")
        return self._fused(_coalesced.all_reduce(self, arrays, _parse_op(op), async_op), arrays, async_op)

    def all_gather_coalesced(self, inputs, outputs=None, *, async_op=False):
        """all_gather of each array of `inputs` (one dtype) into its own output of ``world_size * len(inputs[i])``
        rows (new arrays when `outputs` is None), fused as all_reduce_coalesced is. Returns the outputs."""
        self._check_open("all_gather_coalesced")
        return self._fused(*_coalesced.all_gather(self, inputs, outputs, async_op), async_op)

    def _fused(self, work, value, async_op: bool):
        if not async_op:
            return value
        return _result(self._watch(work), value)

    def reduce_scatter(self, x, out=None, op="sum", algo="auto", *, stream=None, async_op=False):
        """Reduce `x` across ranks and give rank r the r-th of ``world_size`` equal blocks along axis 0."""
        self._check_open("reduce_scatter")
        redop = _parse_op(op)
        src = self._resolve(x, "x")
        shape = self._split_shape(src, "reduce_scatter")
        n = src.count // self._world_size
        dst = self._resolve_out(src, out, n, shape, slice_in_place="out_in_x")
        work = self._run(REDUCE_SCATTER, algo, src, dst, n, redop, 0, stream, async_op)
        return _result(work, dst.obj) if async_op else dst.obj

    def all_to_all(self, x, out=None, algo="auto", *, stream=None, async_op=False):
        """Block j (of ``world_size`` along axis 0) of rank i lands as block i on rank j."""
        self._check_open("all_to_all")
        src = self._resolve(x, "x")
        self._split_shape(src, "all_to_all")
        dst = self._resolve_out(src, out, src.count, tuple(src.shape), alias_ok=False)
        work = self._run(ALL_TO_ALL, algo, src, dst, src.count // self._world_size, None, 0, stream, async_op)
        return _result(work, dst.obj) if async_op else dst.obj

    def gather(self, x, out=None, root=0, algo="auto", *, stream=None, async_op=False):
        """Concatenate every rank's `x` along axis 0 on `root`. Returns the result on root, None elsewhere."""
        self._check_open("gather")
        root = self._check_rank(root, "root")
        src = self._resolve(x, "x")
        is_root = self._rank == root
        dst = self._resolve_out(src, out, src.count * self._world_size,
                                self._scaled_shape(src, self._world_size),
                                slice_in_place="x_in_out") if is_root or out is not None else src
        work = self._run(GATHER, algo, src, dst, src.count, None, root, stream, async_op)
        value = dst.obj if is_root else None
        return _result(work, value) if async_op else value

    def scatter(self, x, out=None, root=0, algo="auto", *, stream=None, async_op=False):
        """Rank r receives block r of root's `x` (``world_size`` equal blocks along axis 0). `x` must have the
        same shape on every rank (only root's content is read); returns this rank's block."""
        self._check_open("scatter")
        root = self._check_rank(root, "root")
        src = self._resolve(x, "x")
        shape = self._split_shape(src, "scatter")
        n = src.count // self._world_size
        dst = self._resolve_out(src, out, n, shape, slice_in_place="out_in_x")
        work = self._run(SCATTER, algo, src, dst, n, None, root, stream, async_op)
        return _result(work, dst.obj) if async_op else dst.obj

    def send(self, x, peer, *, stream=None, async_op=False):
        """Send `x` to rank `peer`, which must post a matching recv of the same size."""
        self._check_open("send")
        work = self._p2p(True, x, peer, stream, async_op)
        return _result(work, None) if async_op else None

    def recv(self, x, peer, *, stream=None, async_op=False):
        """Receive into `x` (filled in place) from rank `peer`; returns `x`."""
        self._check_open("recv")
        work = self._p2p(False, x, peer, stream, async_op)
        return _result(work, x) if async_op else x

    @contextlib.contextmanager
    def group(self):
        """Issue several operations as one, like ncclGroupStart/End: sends and receives inside the block
        are queued and progress together when it exits, so matching pairs never deadlock whatever their
        order. Collectives inside the block run in issue order. On the nccl backend the block is
        ncclGroupStart/ncclGroupEnd: everything in it launches together when the outermost block exits."""
        self._check_open("group")
        self._group_depth += 1
        try:
            with self._ops.group():
                yield self
        finally:
            self._group_depth -= 1
            if self._group_depth == 0:
                # Until here the queued operations may still read or write them (a temporary passed to send
                # would otherwise be freed before the group ran it).
                self._group_refs.clear()

    # -- buffer registration (backend='custom') -----------------------------------------------------------
    def _registrar(self, what: str):
        self._check_open(what)
        return self._ops.registrar(what)

    def register(self, x) -> None:
        """Register `x` once (collective: every rank, same order, same size) so that allreduces whose input is
        exactly `x` read every rank's copy in place instead of staging it (backend='custom'). The communicator holds
        `x` until it closes (registration is by address: a freed buffer's address may be handed out again)."""
        impl = self._registrar("register")
        impl.register(self._resolve(x, "x"))

    def register_graph_buffers(self) -> int:
        """Collective: register the inputs first seen while capturing inside graph_capture(); returns how many."""
        return self._registrar("register_graph_buffers").register_graph_buffers()

    def graph_capture(self):
        """A context to wrap CUDA graph capture (e.g. inside ``torch.cuda.graph``): allreduce inputs first seen
        inside it are read in place by the captured kernels and registered across ranks when it exits."""
        return self._registrar("graph_capture").graph_capture()

    # -- helpers ------------------------------------------------------------------------------------------
    def _p2p(self, send: bool, x, peer, stream=None, async_op=False):
        peer = self._check_rank(peer, "peer")
        if peer == self._rank:
            raise InvalidArgument(f"peer must be another rank than this one ({self._rank}); got {peer}")
        buf = self._resolve(x, "x", writable=not send)
        if self._group_depth:
            self._group_refs.append(buf.obj)
        return self._ops.p2p(send, peer, buf, stream, async_op)

    def _resolve(self, x, arg: str, writable: bool = False):
        buf = _buffers.resolve(x, arg, writable=writable)
        self._ops.check_buffer(buf, arg)
        return buf

    def _check_rank(self, value, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name} must be an int rank in [0, {self._world_size}); got {value!r}")
        if not 0 <= value < self._world_size:
            raise InvalidArgument(f"{name} must be in [0, {self._world_size}); got {value}")
        return value

    def _scaled_shape(self, src, factor: int) -> tuple:
        if not src.shape:
            return (factor,)
        return (src.shape[0] * factor, *src.shape[1:])

    def _split_shape(self, src, what: str) -> tuple:
        rows = src.shape[0] if src.shape else 1
        if rows % self._world_size != 0:
            raise InvalidArgument(f"{what} needs len(x) divisible by world_size {self._world_size}; got len(x) = "
                                  f"{rows} (shape {src.shape})")
        return (rows // self._world_size, *src.shape[1:]) if src.shape else (1,)

    def _run(self, coll: int, algo, src, dst, count: int, redop, root: int, stream=None, async_op=False):
        """Hands one collective to the backend; returns its Work for async_op where the operation may still run."""
        try:
            work = self._ops.collective(coll, algo, src, dst, count, redop, root, stream, async_op)
        except (CollectiveTimeout, RemoteError) as e:
            self._failure(e)
            raise
        return self._watch(work) if async_op else work

    def _watch(self, work):
        """`work`; one that runs on another thread (the host backend's) has its failure recorded when it ends."""
        if work is not None and work.device is None:
            work.add_done_callback(functools.partial(self._ended, work))
        return work

    def _ended(self, work) -> None:
        """An operation that ran on another thread ended (on that thread): its failure is recorded as a synchronous
        one's is; wait() raises it to the caller."""
        try:
            work.is_completed()
        except (CollectiveTimeout, RemoteError) as e:
            self._failure(e)
        except GpucollError:
            pass  # the caller's wait() raises it

    def _failure(self, e) -> None:
        """A collective timed out or a peer failed: remember the ranks it names (what shrink() knows of dead ranks
        without waiting for them), and dump the flight recorder, saying in `e` where every rank is."""
        self._failed.update(e.ranks or ())
        flight_recorder.on_failure(self._trace_source(), self._store, e)

    def _trace_source(self):
        ops = self._ops
        return flight_recorder.Source(self._rank, self._world_size, self._timeout, self._backend, ops.trace,
                                      ops.trace_key, ops.peer_states)

    def _resolve_out(self, src, out, count: int, shape=None, alias_ok: bool = True, slice_in_place=None):
        """`out` checked against `src`. slice_in_place names NCCL's in-place layouts, where the two overlap on
        purpose: "x_in_out" (all_gather, gather: x is this rank's block of out) and "out_in_x" (reduce_scatter,
        scatter: out is this rank's block of x)."""
        if out is None:
            if shape is None:
                return src
            return self._resolve(_buffers.empty_like(src, count, shape), "out", writable=True)
        dst = self._resolve(out, "out", writable=True)
        if dst.dtype != src.dtype:
            raise InvalidArgument(f"out must have x's dtype {src.dtype_name}; got {dst.dtype_name}")
        if dst.count != count:
            raise InvalidArgument(f"out must have {count} elements; got {dst.count} (shape {dst.shape})")
        self._ops.check_out(src, dst)
        if slice_in_place == "x_in_out" and src.ptr == dst.ptr + self._rank * src.nbytes:
            return dst
        if slice_in_place == "out_in_x" and dst.ptr == src.ptr + self._rank * dst.nbytes:
            return dst
        if dst.overlaps(src) and (dst.ptr != src.ptr or not alias_ok or dst.count != src.count):
            raise InvalidArgument("out overlaps x; pass a separate array"
                                  + (" (or the same array, for in place)" if alias_ok else ""))
        return dst

    def algorithm_for(self, coll: int, nbytes: int, dtype: str = "float32", algo="auto") -> str:
        """What a call of collective `coll` (gpucoll's numbering, e.g. communicator.ALL_REDUCE) moving `nbytes` in all
        (the world-sized buffer for all_gather, reduce_scatter, all_to_all, gather, scatter) runs with `algo`: the
        host backend's schedule name, "custom:<kernel>" when the custom backend runs one of its kernels, "nccl"
        where NCCL runs it (NCCL picks its own algorithm)."""
        return self._ops.algorithm_for(coll, nbytes, dtype, algo)


def _build(launch, store, kind: str, timeout: float, local_size: int, device, requested: str = "auto",
           with_host: bool | None = None) -> Communicator:
    """This rank's backend over `store` (closed again if the backend cannot be built), wrapped in a Communicator.
    `with_host`: CPU buffers go to a host communicator built on demand (backends/router.py); by default when
    backend='auto' (and no GPUCOLL_BACKEND) resolved to a GPU backend."""
    kind, ops = backends.build(launch, store, kind, timeout, local_size, device, requested)
    _log.debug(f"communicator ready: rank {launch.rank}/{launch.world_size}, backend {kind} ({launch.launcher})")
    if with_host is None:
        with_host = requested == "auto" and not config.get("GPUCOLL_BACKEND").strip()
    make_host = host_maker(launch, store, timeout) if with_host and kind != "host" else None
    return Communicator(rank=launch.rank, world_size=launch.world_size, backend=kind, ops=ops, store=store,
                        timeout=timeout, local_size=local_size, make_host=make_host)


def _store_launch(rank: int, size: int) -> LaunchInfo:
    """The launch description of a communicator made over an existing store (split, shrink, grow, join)."""
    return LaunchInfo(rank=rank, world_size=size, local_rank=0, local_world_size=1, address="", port=0,
                      launcher="store")
