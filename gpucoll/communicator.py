"""The Communicator: argument checks, buffer resolution and algorithm choice in one place, then one call into
the backend. ``gpucoll.init`` builds one from the launcher's environment and a rendezvous store."""

from __future__ import annotations

import socket
from typing import Optional

from gpucoll import _buffers, _log
from gpucoll.errors import InvalidArgument, InvalidUsage, Unsupported

OPS = ("sum", "prod", "min", "max", "avg")
BACKENDS = ("auto", "host", "nccl", "custom")

# Collective ids: the numbering of gpucoll::algo::Coll.
ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER = range(8)


def _parse_op(op):
    from gpucoll import _C

    if isinstance(op, _C.RedOp):
        return op
    if isinstance(op, str) and op.lower() in OPS:
        return getattr(_C.RedOp, op.lower())
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

    def __init__(self, *, rank: int, world_size: int, backend: str, impl, store, timeout: float):
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._impl = impl
        self._store = store
        self._timeout = timeout
        self._closed = False

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
        src = _buffers.resolve(x, "x")
        dst = self._resolve_out(src, out, src.count)
        redop = _parse_op(op)
        algo_name = self._select(ALL_REDUCE, "all_reduce", algo, src.nbytes)
        self._impl.run(algo_name, ALL_REDUCE, src.ptr, dst.ptr, src.count, src.dtype, redop, 0, 0)
        return dst.obj

    # -- helpers ------------------------------------------------------------------------------------------
    def _resolve_out(self, src, out, count: int):
        if out is None:
            return src
        dst = _buffers.resolve(out, "out", writable=True)
        if dst.dtype != src.dtype:
            raise InvalidArgument(f"out must have x's dtype {src.dtype_name}; got {dst.dtype_name}")
        if dst.count != count:
            raise InvalidArgument(f"out must have {count} elements; got {dst.count} (shape {dst.shape})")
        if dst.kind != src.kind or dst.device != src.device:
            raise InvalidArgument(f"out must be a {src.kind} array on {src.device} like x; got a {dst.kind} "
                                  f"array on {dst.device}")
        if dst.ptr != src.ptr and dst.overlaps(src):
            raise InvalidArgument("out partially overlaps x; pass the same array for in place, or a separate one")
        return dst

    def _select(self, coll: int, what: str, algo, nbytes: int) -> str:
        from gpucoll import _C

        names = _C.algorithm_names()
        if algo is None or algo == "auto":
            return "ring"
        if not isinstance(algo, str) or algo not in names:
            raise InvalidArgument(f"algo must be 'auto' or one of {', '.join(names)}; got {algo!r}")
        if not _C.algorithm_supports(algo, coll):
            raise InvalidArgument(f"algo {algo!r} cannot run {what}")
        return algo


def init(rank: Optional[int] = None, world_size: Optional[int] = None, *, backend: str = "auto",
         address: Optional[str] = None, port: Optional[int] = None, timeout: float = 300.0) -> Communicator:
    """Create this rank's communicator. Missing values come from the launcher's environment (torchrun,
    Open MPI, MPICH/PMI, Slurm); rank 0 hosts the rendezvous store at address:port."""
    from gpucoll import _C
    from gpucoll.bootstrap import TCPStore, detect_launch

    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds; got {timeout!r}")
    kind = _resolve_backend(backend)
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
                        timeout=timeout)


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
