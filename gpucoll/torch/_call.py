"""Small pieces of gpucoll's torch ProcessGroup: torch's timeout and ReduceOp spellings, and the context of one
operation in flight (its communicator, the gpucoll Works it enqueued, the strided outputs to copy back)."""

from __future__ import annotations

import datetime

import torch

from gpucoll import _timeout

BACKEND_NAME = "gpucoll"  # the name registered with torch.distributed


def _seconds(timeout) -> float:
    if timeout is None:
        return 1800.0
    if isinstance(timeout, datetime.timedelta):
        return _timeout.clamp(max(timeout.total_seconds(), 1e-3))  # torch allows any timedelta
    return _timeout.clamp(float(timeout))


def _op_name(op) -> str:
    """"SUM", "PREMUL_SUM", ... for a torch ReduceOp (object or enum value)."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None)
    if name is None:  # older pybind enums: str() is "RedOpType.SUM"
        name = str(kind).rsplit(".", 1)[-1]
    return str(name).upper()


def _premul_factor(op):
    """ReduceOp.PREMUL_SUM's scalar as a Python number, or None where torch does not tell it. torch 2.13 has the
    ``factor`` property; torch 2.11 (the GPU machines') and older have only the pickled state, ``(op, factor)``."""
    factor = getattr(op, "factor", None)
    if factor is None:
        try:
            state = op.__getstate__()
            factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
        except (AttributeError, RuntimeError, TypeError):
            return None
    if isinstance(factor, torch.Tensor):
        factor = factor.item()  # one element (torch checks); a CUDA factor syncs once here
    return factor


class _Call:
    """One operation in flight inside a method: its communicator, what it enqueued, what to copy back."""

    __slots__ = ("comm", "cuda", "device", "works", "writebacks")

    def __init__(self, comm, device: torch.device):
        self.comm = comm
        self.device = device
        self.cuda = device.type == "cuda"
        self.works = []
        self.writebacks = []

    def track(self, result):
        """Keeps the gpucoll Work of an async_op=True call (CUDA; host calls are made synchronous: async_op=call.cuda)."""
        if self.cuda and result is not None and hasattr(result, "wait"):
            self.works.append(result)

    def result(self, returned):
        """What a collective called with async_op=self.cuda returned, as its synchronous call returns it (a CUDA
        call's Work is kept: track)."""
        if not self.cuda:
            return returned
        self.track(returned)
        return returned.result()

    def out(self, t: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """`t` as a contiguous tensor to write into: `t` itself, or for a strided `t` a contiguous one copied back
        into it at the end (holding `t`'s values first when `keep`: an in-place operation reads them). A lazily
        negated view (torch._neg_view: its memory holds -t) is such a `t` too."""
        if t.is_contiguous() and not t.is_neg():
            return t
        tmp = t.resolve_neg().contiguous() if keep else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self.writebacks.append((t, tmp))
        return tmp
