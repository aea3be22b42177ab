"""The Backend interface: what every backend (host.py, nccl.py, custom.py) gives the Communicator, written down once.

The Communicator checks a call's arguments and resolves its buffers (gpucoll/_buffers.py); everything that depends
on the backend happens behind this interface, and the Communicator names no backend. Each backend is one object, a
subclass of :class:`Backend` built by every rank together over the rendezvous store (``Backend.create``), with the
backend's rules: which buffers it takes, how one call runs, what ``algo=`` may name, what an ``async_op=True`` call
returns. It holds its native communicator as ``impl``: ``gpucoll._C.HostComm`` (host), ``NcclComm`` (nccl),
``CustomComm`` (custom). Tests and tools reach the backend as ``Communicator._ops`` (with backend='auto' on a GPU,
``_ops`` is router.py's per-device Router, which holds the GPU backend and a host one and is neither).

Adding a backend is one file in this package with a Backend subclass, and one line in the registry (__init__.py).
"""

from __future__ import annotations

import abc
import contextlib

from gpucoll._native import _C
from gpucoll.errors import Unsupported

# Collective ids: the numbering of gpucoll::algo::Coll.
ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER = range(8)
# Collectives whose buffer is world_size blocks of `count` elements: a call's size counts all of them.
BLOCKED = (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER)

# all_reduce's lower-case op names, for the backends' one-call paths (fast_all_reduce).
FAST_OPS = {name: getattr(_C.RedOp, name) for name in ("sum", "prod", "min", "max", "avg")}
# Per array type: whether a GPU backend's one-call path may read it in C++ (python/cuda_array.cc). torch tensors and
# CuPy arrays also export __cuda_array_interface__, but they are ordered on their framework's current stream, which
# only Python can ask; NumPy arrays are host memory, which the general path refuses with its message.
_PLAIN_CAI: dict = {}


def plain_cuda_array(x) -> bool:
    """Whether x's type is one the GPU backends' one-call paths read (an array that only exports
    __cuda_array_interface__: gpucoll's DeviceArray, Numba, ...)."""
    plain = _PLAIN_CAI.get(type(x))
    if plain is None:
        plain = _PLAIN_CAI.setdefault(type(x), not type(x).__module__.startswith(("torch", "cupy", "numpy")))
    return plain


class Backend(abc.ABC):
    """One backend as the Communicator sees it. Subclasses set ``name`` and implement the abstract methods; the
    others have defaults that fit a backend without the feature."""

    name = ""  # what init(backend=...) calls it
    group_fuses = False  # group() fuses collectives (coalesced calls then issue theirs inside one)
    on_gpu = False  # takes CUDA buffers and init(device=...)

    def __init__(self, impl, *, rank: int, world_size: int, local_size: int = 0, selector=None,
                 chosen: bool = False):
        """`impl`: the native communicator; `selector`: the per-call choice of backend and algorithm (select.py)
        where the backend has one; `chosen`: backend='auto' picked this backend (its selector may then choose among
        every backend)."""
        self.impl = impl
        self.rank, self.world_size, self.local_size = rank, world_size, local_size
        self.selector, self.chosen = selector, chosen

    @classmethod
    @abc.abstractmethod
    def create(cls, launch, store, *, timeout: float, local_size: int, device, chosen: bool = False) -> Backend:
        """This rank's backend, built by every rank together over `store` (`chosen`: as __init__)."""

    # -- placement ------------------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def device(self) -> str:
        """Where this backend's buffers live: "cpu" or "cuda:N"."""

    @abc.abstractmethod
    def check_buffer(self, buf, arg: str) -> None:
        """InvalidArgument or Unsupported, naming `arg`, unless this backend takes the resolved buffer `buf`."""

    def check_out(self, src, dst) -> None:
        """InvalidArgument unless an output `dst` may go with the input `src` (both already passed check_buffer)."""

    # -- operations -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        """Run collective `coll` (`redop`: a gpucoll._C.RedOp, a PreMulSum, or None where the collective has no
        op); returns a Work for async_op where the operation may still run, else None."""

    def compressed_all_reduce(self, src, dst, redop, compress: str, stream, async_op: bool):
        """all_reduce(x, compress=...): the sum or avg moved in a compressed wire format (gpucoll/compression.py);
        returns like collective. Backends without one raise Unsupported."""
        raise Unsupported(f"all_reduce(compress={compress!r}) is not available on the {self.name} backend: the host "
                          f"backend (CPU arrays) and gpucoll's kernels (backend='custom') compress; NCCL moves nothing "
                          f"narrower than the array's own dtype")

    # p2p, group and barrier go to the native communicator as they are, unless a backend says otherwise.
    def p2p(self, send: bool, peer: int, buf, stream, async_op: bool):
        """Send `buf` to `peer`, or receive into it; returns like collective."""
        return self.impl.p2p(send, peer, buf, stream, async_op)

    def group(self):
        """A context manager: the operations issued inside it progress together when the outermost one exits."""
        return self.impl.group()

    def barrier(self) -> None:
        """Returns once every rank called barrier()."""
        self.impl.barrier()

    def all_reduce_coalesced(self, bufs, redop, async_op: bool, keep):
        """all_reduce of each buffer of `bufs` (one dtype, one device) in place, as few calls as the backend can
        (gpucoll/_coalesced.py); returns like collective. `keep`: the caller's arrays. By default one all_reduce per
        buffer, inside group() where it fuses them (group_fuses: NCCL's)."""
        return self._per_array(ALL_REDUCE, bufs, bufs, redop, async_op)

    def all_gather_coalesced(self, srcs, dsts, async_op: bool):
        """all_gather of each buffer of `srcs` into the same place of `dsts`; as all_reduce_coalesced."""
        return self._per_array(ALL_GATHER, srcs, dsts, None, async_op)

    def _per_array(self, coll: int, srcs, dsts, redop, async_op: bool):
        """One collective per buffer, in list order; the last Work (they run in order on one stream)."""
        work = None
        with self.group() if self.group_fuses else contextlib.nullcontext():
            for s, d in zip(srcs, dsts):
                w = self.collective(coll, "auto", s, d, s.count, redop, 0, None, async_op)
                work = w if w is not None else work
        return work

    @abc.abstractmethod
    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        """What a call of `coll` moving `nbytes` in all runs with `algo` (see Communicator.algorithm_for)."""

    # -- buffer registration --------------------------------------------------------------------------------------
    def registrar(self, what: str):
        """The object whose register / register_graph_buffers / graph_capture serve `what`."""
        raise Unsupported(f"{what} applies to backend='custom'; this communicator uses {self.name}")

    # -- new communicators from this one (gpucoll/group.py) -------------------------------------------------------
    def can_split(self) -> bool:
        """Whether split() below can run now. Without it (the default) a split or subgroup builds each child
        afresh over the store, with this backend's create(); ranks compare the answer and use split() only when
        every rank says yes."""
        return False

    def split(self, color, key: int, store):
        """Collective over every rank, through the backend's own split (ncclCommSplit): the backend of this
        rank's child, made of the ranks with the same `color` ordered by `key`, over the child's rendezvous
        `store`; None for color None, which takes part all the same."""
        raise Unsupported(f"split is not implemented by the {self.name} backend")

    def can_shrink(self) -> bool:
        """Whether shrink() below can run now (compared across the survivors, like can_split)."""
        return False

    def shrink(self, gone: list, store):
        """Collective over the ranks not in `gone`, through the backend's own shrink (ncclCommShrink): the backend
        of this rank's communicator among them, renumbered in rank order, over `store`."""
        raise Unsupported(f"shrink is not implemented by the {self.name} backend")

    def stragglers(self, reset: bool) -> dict:
        """Per-rank lateness at recent collectives (csrc/core/stragglers.h), as the native window reports it."""
        raise Unsupported(f"stragglers() is measured on the host, nccl and custom backends; the {self.name} backend "
                          f"does not compare arrival times")

    def trace(self, last: int) -> dict:
        """The flight recorder's last `last` operations (0: all it holds) with both clocks (csrc/python/trace.cc)."""
        raise Unsupported(f"the flight recorder records on the host, nccl and custom backends; the {self.name} "
                          f"backend does not record its operations")

    def trace_key(self) -> str:
        """A name every rank of this communicator gives alike and no other communicator shares: its dump files and
        the store keys of a hang report carry it."""
        raise Unsupported(f"the {self.name} backend has no flight recorder")

    def peer_states(self):
        """Where every rank is as this rank can see without asking them (HostComm.peer_states), or None."""

    # -- teardown -------------------------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Stop at once without waiting for issued operations, where the native communicator can; close() follows."""
        abort = getattr(self.impl, "abort", None)
        if abort is not None:
            abort(reason)

    def close(self) -> None:
        """Release the backend's resources (called once)."""
        self.impl.close()
