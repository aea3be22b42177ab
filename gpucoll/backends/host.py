"""The host backend: ranks on one machine reduce CPU arrays through a shared-memory region, running gpucoll's
schedules (csrc/backends/host/, bound as ``gpucoll._C.HostComm``) on the calling thread. Ranks on several machines
get host_nodes.py's HostNodes instead, which holds one of these per machine.

Set-up (``Host.create``, every rank together): rank 0 creates the region and publishes its handle through the
rendezvous store; the others attach to it. A call is checked here (CPU memory, no fp8, no stream), its schedule
picked by the host cost model (``_C.select_algorithm``, or ``algo=``), and run; sends and receives inside
``group()`` are queued and run together when the block exits.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import socket

from gpucoll import _buffers
from gpucoll._native import _C
from gpucoll.backends.base import ALL_REDUCE, BLOCKED, FAST_OPS, Backend
from gpucoll.backends.host_nodes import HostNodes
from gpucoll.bootstrap._liveness import pid_exited
from gpucoll.errors import CollectiveTimeout, InvalidArgument, SystemError, Unsupported

_KIND_NAMES = {"torch": "torch tensor", "cupy": "CuPy array", "cai": "__cuda_array_interface__ array",
               "dlpack": "DLPack array"}
_HOST_STREAM = "stream= applies to the nccl backend; the host backend runs each operation on the calling thread"


class Host(Backend):
    """backend='host' as the Communicator sees it; the impl is gpucoll._C.HostComm."""

    name = "host"

    def __init__(self, impl, **kw):
        super().__init__(impl, **kw)
        self._group = None  # sends and receives queued inside group(): [(send, peer, buf)]
        self._group_depth = 0

    @classmethod
    def create(cls, launch, store, *, timeout: float, local_size: int, device, chosen: bool = False):
        """This rank's host backend; where the ranks run on several machines, HostNodes (host_nodes.py), which holds
        one of these per machine."""
        made = _init_host(launch, store, timeout)
        if isinstance(made, _Machines):
            return HostNodes.create(launch, store, timeout=timeout, hosts=made.hosts, prefix=made.prefix,
                                    make_local=lambda lo, st, t: cls(_init_host(lo, st, t), rank=lo.rank,
                                                                     world_size=lo.world_size,
                                                                     local_size=lo.world_size))
        return cls(made, rank=launch.rank, world_size=launch.world_size, local_size=local_size, chosen=chosen)

    @property
    def device(self) -> str:
        return "cpu"

    def check_buffer(self, buf, arg: str) -> None:
        """The host backend's placement rule: CPU memory, and no fp8 (it has no fp8 arithmetic)."""
        if buf.device != "cpu":
            what = _KIND_NAMES.get(buf.kind, f"{buf.kind} array")
            where = "CUDA memory" if buf.device == "cuda" else f"CUDA memory ({buf.device})"
            raise InvalidArgument(f"{arg} is a {what} in {where}, but this communicator uses the host backend, which "
                                  f"works on CPU memory: create it with backend='nccl' for CUDA arrays, or copy {arg} "
                                  f"to the host first")
        if buf.dtype_name in _buffers.FP8:
            raise Unsupported(f"{arg} has dtype {buf.dtype_name}: only the nccl backend handles fp8 (NCCL >= 2.24); "
                              f"the host backend supports {', '.join(_buffers.SUPPORTED)}")

    def check_out(self, src, dst) -> None:
        if dst.kind != src.kind or dst.device != src.device:
            raise InvalidArgument(f"out must be a {src.kind} array on {src.device} like x; got a {dst.kind} "
                                  f"array on {dst.device}")

    # -- operations -----------------------------------------------------------------------------------------------
    def fast_all_reduce(self, x, op, algo, stream, async_op) -> bool:
        """all_reduce(x) in place of a NumPy array or a CPU torch.Tensor with algo='auto' and a lower-case op name, in
        one native call; False where anything else was asked, a group() is open or the native call declines (another
        type, anything unusual), and the general path then runs the call and raises its typed errors."""
        if (stream is not None or async_op is not False or type(algo) is not str or algo != "auto"
                or type(op) is not str or self._group is not None):
            return False
        redop = FAST_OPS.get(op)
        return redop is not None and self.impl.all_reduce_array(x, redop, self.local_size)

    def torch_all_reduce(self, ops: dict):
        """gpucoll.torch's dist.all_reduce(t) in one native call: `now(tensors, opts)` reads torch's arguments as they
        come and runs, or returns False having run nothing (HostComm.all_reduce_torch). `ops`: hash(ReduceOp) to
        gpucoll's op name."""
        return functools.partial(self.impl.all_reduce_torch, {h: FAST_OPS[name] for h, name in ops.items()},
                                 self.local_size)

    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        if stream is not None:
            raise InvalidArgument(_HOST_STREAM)
        premul = None
        if redop is not None and type(redop) is not _C.RedOp:  # a premul_sum (the Communicator allows nothing else)
            premul, redop = float(redop.scalar), _C.RedOp.sum
        self._flush_p2p()
        nbytes = count * src.itemsize * (self.world_size if coll in BLOCKED else 1)  # the selector counts it so
        name = self._select(coll, algo, nbytes)
        op = redop if redop is not None else _C.RedOp.sum
        auto = algo is None or algo == "auto"
        if async_op and self._group is None:
            # On the communicator's progress thread, in call order with every other operation of it; src and dst
            # stay alive until it ran (csrc/backends/host/progress.h).
            return self.impl.run_async((src.obj, dst.obj), name, coll, src.ptr, dst.ptr, count, src.dtype, op, root,
                                       self.local_size, premul, auto)
        self.impl.run(name, coll, src.ptr, dst.ptr, count, src.dtype, op, root, self.local_size, premul, auto)
        return None

    def _flush_p2p(self) -> None:
        """Runs the sends and receives queued in an open group() before a collective of it: collectives keep their
        order relative to each other, and a group that mixes both sees its sends/recvs done first, as NCCL's would."""
        if self._group:
            batch, self._group = self._group, []
            self.impl.p2p([(send, peer, buf.ptr, buf.nbytes) for send, peer, buf in batch])

    def compressed_all_reduce(self, src, dst, redop, compress: str, stream, async_op: bool):
        """The two-shot schedule over block-encoded records (csrc/backends/host/compressed.cc); the C++ side checks the
        format's name, the dtype and the op after comparing the ranks' calls."""
        if stream is not None:
            raise InvalidArgument(_HOST_STREAM)
        premul = None
        if type(redop) is not _C.RedOp:  # a premul_sum: refused on every rank alike by the C++ check
            premul, redop = float(redop.scalar), _C.RedOp.sum
        args = ("twoshot", ALL_REDUCE, src.ptr, dst.ptr, src.count, src.dtype, redop, 0, self.local_size, premul,
                False, compress)
        self._flush_p2p()
        if async_op and self._group is None:
            return self.impl.run_async((src.obj, dst.obj), *args)
        self.impl.run(*args)
        return None

    def p2p(self, send: bool, peer: int, buf, stream, async_op: bool):
        if stream is not None:
            raise InvalidArgument(_HOST_STREAM)
        if self._group is not None:
            self._group.append((send, peer, buf))
        else:
            self.impl.p2p([(send, peer, buf.ptr, buf.nbytes)])

    @contextlib.contextmanager
    def group(self):
        if self._group is not None:
            self._group_depth += 1
            try:
                yield
            finally:
                self._group_depth -= 1
            return
        self._group = []
        self._group_depth = 1
        ok = False
        try:
            yield
            ok = True
        finally:
            batch, self._group, self._group_depth = self._group, None, 0
            if ok and batch:
                self.impl.p2p([(send, peer, buf.ptr, buf.nbytes) for send, peer, buf in batch])

    def barrier(self) -> None:
        self.impl.barrier()

    def stragglers(self, reset: bool) -> dict:
        return self.impl.stragglers(reset)

    def trace(self, last: int) -> dict:
        return self.impl.trace(last)

    def trace_key(self) -> str:
        # The region's random token, which every rank checked on attach; hashed, as the key goes into file names.
        return "host-" + hashlib.sha256(f"{self.impl.handle[2]}:{self.impl.handle[3]}".encode()).hexdigest()[:16]

    def peer_states(self):
        return self.impl.peer_states()

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        return self._select(coll, algo, nbytes)

    # -- coalesced calls (gpucoll/_coalesced.py; csrc/python/host_coalesced.cc) --------------------------------------
    def _fusion(self):
        """This communicator's HostCoalescer (its staging buffer), made on first use; queued sends and receives of an
        open group() run first, as before any collective of it."""
        self._flush_p2p()
        fusion = getattr(self, "_coalescer", None)
        if fusion is None:
            fusion = self._coalescer = _C.HostCoalescer(_C.config_bytes("GPUCOLL_HOST_FUSION_BYTES"))
        return fusion

    def fast_all_reduce_coalesced(self, arrays, redop, async_op: bool):
        """One native call that reads the arrays (NumPy, CPU torch) and runs: None or its Work; else the index of the
        first array it declined, having run nothing (the general path then names the problem)."""
        return self._fusion().all_reduce(self.impl, arrays, redop, self.local_size, async_op and self._group is None)

    def all_reduce_coalesced(self, bufs, redop, async_op: bool, keep):
        if type(redop) is not _C.RedOp:  # premul_sum: the native path reduces with RedOps only
            return super().all_reduce_coalesced(bufs, redop, async_op, keep)
        dtype = bufs[0].dtype if bufs else _C.DType.float32  # an empty list is still one (empty) collective
        return self._fusion().all_reduce_ptrs(self.impl, [(b.ptr, b.nbytes) for b in bufs], dtype, redop,
                                              self.local_size, async_op and self._group is None,
                                              tuple(b.obj for b in bufs))

    def all_gather_coalesced(self, srcs, dsts, async_op: bool):
        dtype = srcs[0].dtype if srcs else _C.DType.float32  # an empty list is still one (empty) collective
        return self._fusion().all_gather_ptrs(self.impl, [(b.ptr, b.nbytes) for b in srcs], [d.ptr for d in dsts],
                                              dtype, self.local_size, async_op and self._group is None,
                                              tuple(b.obj for b in (*srcs, *dsts)))

    def _select(self, coll: int, algo, nbytes: int) -> str:
        if algo is None:
            algo = "auto"
        if not isinstance(algo, str):
            raise InvalidArgument(f"algo must be a string ('auto' or an algorithm name); got {algo!r}")
        return _C.select_algorithm(coll, self.world_size, nbytes, self.local_size, algo)


# At interpreter exit the progress threads of host communicators still open get this long to finish what is queued
# (their completion callbacks no longer run: no thread may take the GIL then); one stuck on a peer that never comes
# is left to the process's end.
_EXIT_WAIT_S = 10.0
atexit.register(_C.host_at_exit, _EXIT_WAIT_S)


# -- set-up -----------------------------------------------------------------------------------------------------


# Tests only: called with the name of each step of the host backend's set-up (the kill sweep of
# tests/failures/test_init_failures.py stops ranks at each). None in normal use.
_STAGE_HOOK = None


def stage(name: str) -> None:
    if _STAGE_HOOK is not None:
        _STAGE_HOOK(name)


def _parse_hosts(raw: bytes, world_size: int):
    """Rank 0's list of every rank's machine, where it published one instead of a region handle; else None."""
    try:
        hosts = json.loads(raw.decode("utf-8")).get("hosts")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    if hosts is None:
        return None
    if not (isinstance(hosts, list) and len(hosts) == world_size and all(isinstance(h, str) and h for h in hosts)):
        raise InvalidArgument(f"the rendezvous store holds a malformed list of the ranks' machines: {raw[:200]!r}")
    return hosts


def _parse_handle(raw: bytes):
    """The region handle rank 0 published, validated: it came over the network and becomes a /proc path."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        pid, fd, token = doc["pid"], doc["fd"], doc["token"]
        values = (pid, fd, *token)
        ok = (len(token) == 2 and all(type(v) is int for v in values) and 0 < pid < 2**31 and 0 <= fd < 2**31
              and all(0 <= t < 2**64 for t in token))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgument(f"the rendezvous store holds a malformed host-backend region handle: {raw[:200]!r}")
    return pid, fd, token[0], token[1]


class _Machines:
    """_init_host's answer where the ranks run on several machines: every rank's host name, by rank."""

    def __init__(self, hosts: list, prefix: str):
        self.hosts, self.prefix = hosts, prefix


def _init_host(launch, store, timeout: float):
    """The shared-memory communicator of this machine's ranks, or _Machines where they run on several."""
    host = socket.gethostname()
    # Several communicators may be built over one store (torch's, or repeated inits): each gets its own keys.
    generation = (store.add("gpucoll/host/count", 1) - 1) // launch.world_size
    prefix = f"gpucoll/host/{generation}/"
    store.set(f"{prefix}hostname/{launch.rank}", host.encode())
    stage("registered")
    if launch.rank == 0:
        hosts = [host]
        for r in range(1, launch.world_size):
            hosts.append(store.get(f"{prefix}hostname/{r}", timeout=timeout).decode())
            if r == launch.world_size - 1:
                stage("met")  # every rank has reached the store
        if len(set(hosts)) > 1:
            store.set(f"{prefix}region", json.dumps({"hosts": hosts}).encode())
            return _Machines(hosts, prefix)
        impl = _C.HostComm(0, launch.world_size, float(timeout))
        stage("created")
        pid, fd, t0, t1 = impl.handle
        store.set(f"{prefix}region", json.dumps({"pid": pid, "fd": fd, "token": [t0, t1]}).encode())
    else:
        raw = store.get(f"{prefix}region", timeout=timeout)
        hosts = _parse_hosts(raw, launch.world_size)
        if hosts is not None:
            return _Machines(hosts, prefix)
        handle = _parse_handle(raw)
        try:
            impl = _C.HostComm(launch.rank, launch.world_size, float(timeout), handle)
        except SystemError:
            if pid_exited(handle[0]):
                raise CollectiveTimeout(f"rank 0 exited before this rank could attach to the host backend's region "
                                        f"(its process {handle[0]} is gone)", ranks=(0,)) from None
            raise
    stage("attached")
    # Every rank attached before rank 0 lets go of the region's descriptor. Through the store where it has a
    # barrier: gpucoll's server notices a rank whose connection closed (it died) and names it at once;
    # wait_attached then only confirms (and is the whole wait over a store without one).
    barrier = getattr(store, "barrier", None)
    if barrier is not None:
        barrier(f"{prefix}attached", launch.world_size, timeout=timeout, rank=launch.rank)
    impl.wait_attached()
    stage("ready")
    return impl
