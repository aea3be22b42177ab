"""The Communicator: argument checks, buffer resolution and algorithm choice in one place, then one call into
the backend. ``gpucoll.init`` builds one from the launcher's environment and a rendezvous store."""

from __future__ import annotations

import contextlib
import socket
from typing import Optional

from gpucoll import _buffers, _log
from gpucoll.errors import InvalidArgument, InvalidUsage, Unsupported

OPS = ("sum", "prod", "min", "max", "avg")
BACKENDS = ("auto", "host", "nccl", "custom")

# Collective ids: the numbering of gpucoll::algo::Coll.
ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER = range(8)
_BLOCKED = (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER)


_OP_CACHE: dict = {}


def _parse_op(op):
    try:
        return _OP_CACHE[op]
    except (KeyError, TypeError):
        pass
    from gpucoll import _C

    if isinstance(op, _C.RedOp):
        return op
    if isinstance(op, str) and op.lower() in OPS:
        _OP_CACHE[op] = getattr(_C.RedOp, op.lower())
        return _OP_CACHE[op]
    raise InvalidArgument(f"op must be one of {', '.join(OPS)}; got {op!r}")


def _resolve_backend(backend: str) -> str:
    from gpucoll import config

    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        backend = config.get("GPUCOLL_BACKEND").strip().lower() or "host"
        if backend not in BACKENDS[1:]:
            raise InvalidArgument(f"GPUCOLL_BACKEND must be one of host, nccl, custom; got {backend!r}")
    if backend in ("nccl", "custom"):
        raise Unsupported(f"backend {backend!r} is not available in this version of gpucoll yet; use "
                          f"backend='host' for CPU arrays")
    return backend


class Communicator:
    """A group of ranks that run collectives together. Build one with ``gpucoll.init`` or ``gpucoll.spawn``."""

    def __init__(self, *, rank: int, world_size: int, backend: str, impl, store, timeout: float,
                 local_size: int = 0):
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._impl = impl
        self._store = store
        self._timeout = timeout
        self._closed = False
        self._local_size = local_size
        self._group = None
        self._group_depth = 0

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
    def closed(self) -> bool:
        return self._closed

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
            self._impl.close()
        finally:
            if self._store is not None:
                self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidUsage(f"{what} on a closed communicator (close() was called)")

    # -- collectives --------------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Returns once every rank has called barrier()."""
        self._check_open("barrier")
        self._impl.barrier()

    def all_reduce(self, x, out=None, op="sum", algo="auto"):
        """Reduce `x` element-wise across ranks with `op`; every rank gets the result.

        In place when `out` is None (the result is written to `x`, which is returned); otherwise `out` must
        have x's size and dtype and not overlap it, and is returned.
        """
        self._check_open("all_reduce")
        src = _buffers.resolve(x, "x", writable=out is None)
        dst = self._resolve_out(src, out, src.count)
        redop = _parse_op(op)
        self._run(ALL_REDUCE, algo, src, dst, src.count, redop, 0)
        return dst.obj

    def broadcast(self, x, root=0, algo="auto"):
        """Copy root's `x` into `x` on every rank (in place); returns `x`."""
        self._check_open("broadcast")
        root = self._check_rank(root, "root")
        src = _buffers.resolve(x, "x", writable=True)
        self._run(BROADCAST, algo, src, src, src.count, None, root)
        return x

    def reduce(self, x, out=None, op="sum", root=0, algo="auto"):
        """Reduce `x` across ranks onto `root`: the result lands in `out` (or `x` when out is None) on root;
        other ranks' buffers are left as they were. Returns the output array on root, `x` elsewhere."""
        self._check_open("reduce")
        root = self._check_rank(root, "root")
        redop = _parse_op(op)
        src = _buffers.resolve(x, "x", writable=out is None and self._rank == root)
        # `out` is checked wherever it is given, root or not: an argument error must stop every rank that made
        # it, or the ranks that went ahead would run this collective alone and fall out of step.
        dst = self._resolve_out(src, out, src.count) if self._rank == root or out is not None else src
        self._run(REDUCE, algo, src, dst, src.count, redop, root)
        return dst.obj if self._rank == root else src.obj

    def all_gather(self, x, out=None, algo="auto"):
        """Concatenate every rank's `x` along axis 0 in rank order: ``world_size * len(x)`` rows."""
        self._check_open("all_gather")
        src = _buffers.resolve(x, "x")
        shape = self._scaled_shape(src, self._world_size)
        dst = self._resolve_out(src, out, src.count * self._world_size, shape)
        self._run(ALL_GATHER, algo, src, dst, src.count, None, 0)
        return dst.obj

    def reduce_scatter(self, x, out=None, op="sum", algo="auto"):
        """Reduce `x` across ranks and give rank r the r-th of ``world_size`` equal blocks along axis 0."""
        self._check_open("reduce_scatter")
        redop = _parse_op(op)
        src = _buffers.resolve(x, "x")
        shape = self._split_shape(src, "reduce_scatter")
        n = src.count // self._world_size
        dst = self._resolve_out(src, out, n, shape)
        self._run(REDUCE_SCATTER, algo, src, dst, n, redop, 0)
        return dst.obj

    def all_to_all(self, x, out=None, algo="auto"):
        """Block j (of ``world_size`` along axis 0) of rank i lands as block i on rank j."""
        self._check_open("all_to_all")
        src = _buffers.resolve(x, "x")
        self._split_shape(src, "all_to_all")
        dst = self._resolve_out(src, out, src.count, tuple(src.shape), alias_ok=False)
        self._run(ALL_TO_ALL, algo, src, dst, src.count // self._world_size, None, 0)
        return dst.obj

    def gather(self, x, out=None, root=0, algo="auto"):
        """Concatenate every rank's `x` along axis 0 on `root`. Returns the result on root, None elsewhere."""
        self._check_open("gather")
        root = self._check_rank(root, "root")
        src = _buffers.resolve(x, "x")
        is_root = self._rank == root
        dst = self._resolve_out(src, out, src.count * self._world_size,
                                self._scaled_shape(src, self._world_size)) if is_root or out is not None else src
        self._run(GATHER, algo, src, dst, src.count, None, root)
        return dst.obj if is_root else None

    def scatter(self, x, out=None, root=0, algo="auto"):
        """Rank r receives block r of root's `x` (``world_size`` equal blocks along axis 0). `x` must have the
        same shape on every rank (only root's content is read); returns this rank's block."""
        self._check_open("scatter")
        root = self._check_rank(root, "root")
        src = _buffers.resolve(x, "x")
        shape = self._split_shape(src, "scatter")
        n = src.count // self._world_size
        dst = self._resolve_out(src, out, n, shape)
        self._run(SCATTER, algo, src, dst, n, None, root)
        return dst.obj

    def send(self, x, peer):
        """Send `x` to rank `peer`, which must post a matching recv of the same size."""
        self._check_open("send")
        self._p2p(True, x, peer)

    def recv(self, x, peer):
        """Receive into `x` (filled in place) from rank `peer`; returns `x`."""
        self._check_open("recv")
        self._p2p(False, x, peer)
        return x

    @contextlib.contextmanager
    def group(self):
        """Issue several operations as one, like ncclGroupStart/End: sends and receives inside the block
        are queued and progress together when it exits, so matching pairs never deadlock whatever their
        order. Collectives inside the block run in issue order."""
        self._check_open("group")
        if self._group is not None:
            self._group_depth += 1
            try:
                yield self
            finally:
                self._group_depth -= 1
            return
        self._group = []
        self._group_depth = 1
        ok = False
        try:
            yield self
            ok = True
        finally:
            batch, self._group, self._group_depth = self._group, None, 0
            if ok and batch:
                self._impl.p2p([(send, peer, buf.ptr, buf.nbytes) for send, peer, buf in batch])

    # -- helpers ------------------------------------------------------------------------------------------
    def _p2p(self, send: bool, x, peer) -> None:
        peer = self._check_rank(peer, "peer")
        if peer == self._rank:
            raise InvalidArgument(f"peer must be another rank than this one ({self._rank}); got {peer}")
        buf = _buffers.resolve(x, "x", writable=not send)
        if self._group is not None:
            self._group.append((send, peer, buf))
        else:
            self._impl.p2p([(send, peer, buf.ptr, buf.nbytes)])

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

    def _run(self, coll: int, algo, src, dst, count: int, redop, root: int) -> None:
        from gpucoll import _C

        if self._group is not None and self._group:
            # Collectives keep their order relative to each other; queued p2p goes first so a group that
            # mixes both sees its sends/recvs done before the collective, as NCCL's group would.
            batch, self._group = self._group, []
            self._impl.p2p([(send, peer, buf.ptr, buf.nbytes) for send, peer, buf in batch])
        nbytes = count * src.itemsize * (self._world_size if coll in _BLOCKED else 1)
        name = self._select(coll, algo, nbytes)
        op = redop if redop is not None else _C.RedOp.sum
        self._impl.run(name, coll, src.ptr, dst.ptr, count, src.dtype, op, root, self._local_size)

    def _resolve_out(self, src, out, count: int, shape=None, alias_ok: bool = True):
        if out is None:
            if shape is None:
                return src
            return _buffers.resolve(_buffers.empty_like(src, count, shape), "out", writable=True)
        dst = _buffers.resolve(out, "out", writable=True)
        if dst.dtype != src.dtype:
            raise InvalidArgument(f"out must have x's dtype {src.dtype_name}; got {dst.dtype_name}")
        if dst.count != count:
            raise InvalidArgument(f"out must have {count} elements; got {dst.count} (shape {dst.shape})")
        if dst.kind != src.kind or dst.device != src.device:
            raise InvalidArgument(f"out must be a {src.kind} array on {src.device} like x; got a {dst.kind} "
                                  f"array on {dst.device}")
        if dst.overlaps(src) and (dst.ptr != src.ptr or not alias_ok or dst.count != src.count):
            raise InvalidArgument("out overlaps x; pass a separate array"
                                  + (" (or the same array, for in place)" if alias_ok else ""))
        return dst

    def _select(self, coll: int, algo, nbytes: int) -> str:
        from gpucoll import _C

        if algo is None:
            algo = "auto"
        if not isinstance(algo, str):
            raise InvalidArgument(f"algo must be a string ('auto' or an algorithm name); got {algo!r}")
        return _C.select_algorithm(coll, self._world_size, nbytes, self._local_size, algo)


def init(rank: Optional[int] = None, world_size: Optional[int] = None, *, backend: str = "auto",
         address: Optional[str] = None, port: Optional[int] = None, timeout: float = 300.0,
         local_size: Optional[int] = None) -> Communicator:
    """Create this rank's communicator. Missing values come from the launcher's environment (torchrun,
    Open MPI, MPICH/PMI, Slurm); rank 0 hosts the rendezvous store at address:port.

    `local_size` (or GPUCOLL_LOCAL_SIZE) declares ranks per node for hierarchical algorithms; on one machine
    it lays out virtual nodes of that many consecutive ranks."""
    from gpucoll import _C
    from gpucoll.bootstrap import TCPStore, detect_launch

    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds; got {timeout!r}")
    kind = _resolve_backend(backend)
    if local_size is None:
        from gpucoll import config

        local_size = config.get_int("GPUCOLL_LOCAL_SIZE")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 0:
        raise InvalidArgument(f"local_size must be a non-negative int (0: one node); got {local_size!r}")
    launch = detect_launch(rank=rank, world_size=world_size, address=address, port=port)
    _C.set_log_rank(launch.rank)
    store = TCPStore(launch.address, launch.port, is_server=launch.rank == 0, timeout=timeout)
    try:
        impl = _init_host(launch, store, timeout)
    except BaseException:
        store.close()
        raise
    _log.debug(f"communicator ready: rank {launch.rank}/{launch.world_size}, backend {kind}")
    return Communicator(rank=launch.rank, world_size=launch.world_size, backend=kind, impl=impl, store=store,
                        timeout=timeout, local_size=local_size)


def _init_host(launch, store, timeout: float):
    from gpucoll import _C

    host = socket.gethostname()
    store.set(f"gpucoll/host/hostname/{launch.rank}", host.encode())
    if launch.rank == 0:
        for r in range(1, launch.world_size):
            other = store.get(f"gpucoll/host/hostname/{r}", timeout=timeout).decode()
            if other != host:
                store.set("gpucoll/host/shm", b"")
                raise Unsupported(f"the host backend needs every rank on one machine; rank {r} runs on {other!r}, "
                                  f"rank 0 on {host!r}")
        name = _C.HostComm.make_name()
        impl = _C.HostComm(0, launch.world_size, float(timeout), name, True)
        store.set("gpucoll/host/shm", name.encode())
    else:
        name = store.get("gpucoll/host/shm", timeout=timeout).decode()
        if not name:
            raise Unsupported("the host backend needs every rank on one machine (rank 0 found ranks on other hosts)")
        impl = _C.HostComm(launch.rank, launch.world_size, float(timeout), name, False)
    impl.wait_attached()
    return impl
