"""The per-device router of backend='auto' on a GPU machine: CUDA buffers go to the GPU backend (nccl or custom), CPU
buffers to the host backend, as torch.distributed's process groups route a call by its tensors' device type.

torch.distributed's default group does the same (gloo for CPU tensors, NCCL for CUDA ones), and without it the
first NumPy example a user tries fails on any GPU machine, where 'auto' picks NCCL. Explicit backends keep their
rule: backend='nccl' refuses CPU buffers, backend='host' CUDA ones.

The host communicator is built over the communicator's rendezvous store on the first call with CPU buffers. That
build is collective, and it is safe where it happens: ranks match collectives by order, so every rank makes that
same call at the same point of its program and builds there. A rank that passes CPU buffers where the others pass
CUDA ones waits in the build and raises CollectiveTimeout (the others time out in the GPU call) instead of hanging.
A GPU-only job never builds it. Inside group(): the host backend's group opens when the first CPU-buffer operation
of the outermost group arrives and closes with it, so its sends and receives progress together like the GPU ones.
"""

from __future__ import annotations

import contextlib

import numpy as np

from gpucoll import _log
from gpucoll.backends.base import Backend
from gpucoll.backends.host import Host
from gpucoll.errors import InvalidArgument


def host_maker(launch, store, timeout: float):
    """Router's make_host: the host Backend of these ranks over `store`, built by every rank together."""
    def make_host():
        host = Host.create(launch, store, timeout=timeout, local_size=0, device=None)
        _log.debug(f"rank {launch.rank}: CPU buffers run on a host communicator (backend='auto' on a GPU)")
        return host
    return make_host


class Router:
    """A communicator's backends by device type: the GPU backend for CUDA buffers, a host backend built on demand
    for CPU buffers (see the module docstring). It holds the backends and is none of them: it forwards each call to
    the one the call's buffer belongs to, and everything that is not about a buffer (group membership, splits, the
    flight recorder, stragglers) to the GPU backend, the one training steps synchronise on."""

    on_gpu = True

    def __init__(self, gpu, make_host):
        """`gpu`: the communicator's GPU Backend; `make_host()`: the host Backend, built by every rank together."""
        self.gpu, self.host = gpu, None
        self._make_host = make_host
        self._depth = 0  # group() nesting
        self._stack = None  # the outermost group's contexts, while it is open
        self._host_grouped = False

    @property
    def name(self) -> str:
        return self.gpu.name

    @property
    def impl(self):
        return self.gpu.impl

    @property
    def selector(self):
        return self.gpu.selector

    def _for(self, buf) -> Backend:
        if buf.device != "cpu":
            return self.gpu
        if self.host is None:
            self.host = self._make_host()
        if self._stack is not None and not self._host_grouped:
            self._stack.enter_context(self.host.group())
            self._host_grouped = True
        return self.host

    # -- placement ------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self.gpu.device

    def check_buffer(self, buf, arg: str) -> None:
        self._for(buf).check_buffer(buf, arg)

    def check_out(self, src, dst) -> None:
        if (src.device == "cpu") != (dst.device == "cpu"):
            raise InvalidArgument(f"out must be in the same memory as x (x is on {src.device}, out on {dst.device}): "
                                  f"CPU buffers run on the host backend, CUDA buffers on the {self.gpu.name} backend")
        self._for(src).check_out(src, dst)

    # -- operations -----------------------------------------------------------------------------------------------
    def fast_all_reduce(self, x, op, algo, stream, async_op) -> bool:
        """The one-call path of the backend x belongs to: NumPy arrays and CPU torch tensors on the host backend's once
        it is built and no group() is open (the general path builds it and joins it to the group), other arrays on
        the GPU backend's where it has one. False sends the call down the general path."""
        if type(x) is np.ndarray or getattr(x, "is_cpu", False) is True:
            host = self.host
            return host is not None and self._stack is None and host.fast_all_reduce(x, op, algo, stream, async_op)
        fast = getattr(self.gpu, "fast_all_reduce", None)
        return fast is not None and fast(x, op, algo, stream, async_op)

    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        return self._for(src).collective(coll, algo, src, dst, count, redop, root, stream, async_op)

    def compressed_all_reduce(self, src, dst, redop, compress: str, stream, async_op: bool):
        return self._for(src).compressed_all_reduce(src, dst, redop, compress, stream, async_op)

    def p2p(self, send: bool, peer: int, buf, stream, async_op: bool):
        return self._for(buf).p2p(send, peer, buf, stream, async_op)

    @contextlib.contextmanager
    def group(self):
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.gpu.group())
            self._stack, self._host_grouped = stack, False
            try:
                yield
            finally:
                # Leaving the stack ends the host group (if one opened) and then the GPU one, each running what it
                # queued, also when the block raised.
                self._stack, self._depth = None, 0

    def barrier(self) -> None:
        self.gpu.barrier()

    def all_reduce_coalesced(self, bufs, redop, async_op: bool, keep):
        if not bufs:
            return None
        return self._for(bufs[0]).all_reduce_coalesced(bufs, redop, async_op, keep)

    def all_gather_coalesced(self, srcs, dsts, async_op: bool):
        if not srcs:
            return None
        return self._for(srcs[0]).all_gather_coalesced(srcs, dsts, async_op)

    def stragglers(self, reset: bool) -> dict:
        return self.gpu.stragglers(reset)  # the GPU communicator's: the one training steps synchronise on

    def trace(self, last: int) -> dict:
        return self.gpu.trace(last)

    def trace_key(self) -> str:
        return self.gpu.trace_key()

    def peer_states(self):
        return self.gpu.peer_states()

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        return self.gpu.algorithm_for(coll, nbytes, dtype, algo)

    def registrar(self, what: str):
        return self.gpu.registrar(what)

    # -- new communicators from this one --------------------------------------------------------------------------
    def can_split(self) -> bool:
        return self.gpu.can_split()

    def split(self, color, key: int, store):
        return self.gpu.split(color, key, store)

    def can_shrink(self) -> bool:
        return self.gpu.can_shrink()

    def shrink(self, gone: list, store):
        return self.gpu.shrink(gone, store)

    # -- teardown -------------------------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        try:
            if self.host is not None:
                self.host.abort(reason)
        finally:
            self.gpu.abort(reason)

    def close(self) -> None:
        try:
            if self.host is not None:
                self.host.close()
        finally:
            self.gpu.close()
