"""comm.all_reduce(x) of a NumPy array in place with algo='auto' runs in one native call on the host backend
(HostComm.all_reduce_array): bit-exact for every dtype and op the general path takes, the same typed errors for
what it declines (they come from the general path), and a group() or any other argument still takes the general
path."""

from __future__ import annotations

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.backends.host import Host
from gpucoll.errors import InvalidArgument, Unsupported

pytestmark = pytest.mark.spawns

DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")
COUNTS = (1, 7, 4099)


def _exact(comm):
    """Every dtype x op x count on the one-call path, against the reference; the general path is switched off,
    so a call that fell back to it would fail loudly instead of passing unseen."""
    P, r = comm.world_size, comm.rank
    general = Host.collective
    Host.collective = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the general path ran"))
    errs = []
    try:
        for dtype in DTYPES:
            for op in OPS:
                for count in COUNTS:
                    inputs = [helpers.make_input(dtype, op, count, q, P, seed=count) for q in range(P)]
                    x = np.array(inputs[r], dtype=dtype)
                    comm.all_reduce(x, op=op)
                    want = helpers.reference(inputs, dtype, op)
                    if not np.array_equal(x.view(np.uint8), np.asarray(want, dtype=dtype).view(np.uint8)):
                        errs.append(f"{dtype} {op} n={count}")
    finally:
        Host.collective = general
    return errs


def _warm_ops(comm):
    for op in OPS:  # the op cache is per process: fill it on the general path first
        comm.all_reduce(np.zeros(1, np.float32), op=op)


def _exact_after_warm(comm):
    _warm_ops(comm)
    return _exact(comm)


@pytest.mark.parametrize("P", (2, 3))
def test_every_dtype_and_op_is_exact_on_the_one_call_path(P):
    assert gpucoll.spawn(_exact_after_warm, P, backend="host") == [[]] * P


def _declines(comm):
    """What the one-call path declines raises the general path's typed error, on every rank."""
    _warm_ops(comm)
    seen = []
    for make, exc, what in (
        (lambda: np.zeros(4, np.float32)[::2], InvalidArgument, "C-contiguous"),
        (lambda: np.zeros(4, np.float32).view(), None, None),
        (lambda: np.zeros(4, np.uint32), Unsupported, "uint32"),
        (lambda: np.zeros(4, np.bool_), Unsupported, "bool"),
        (lambda: np.zeros(4, np.int16), Unsupported, "int16"),
    ):
        x = make()
        if exc is None:
            comm.all_reduce(x)
            continue
        with pytest.raises(exc, match=what):
            comm.all_reduce(x)
        seen.append(what)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="writable"):
        comm.all_reduce(ro)
    with pytest.raises(InvalidArgument, match="byte order"):  # reduced as ours, it would be silently wrong
        comm.all_reduce(np.arange(4, dtype=np.dtype(np.float32).newbyteorder()))
    empty = np.zeros(0, np.float32)
    assert comm.all_reduce(empty) is empty
    with comm.group():  # an open group takes the general path
        x = np.full(3, comm.rank + 1, np.float32)
        comm.all_reduce(x)
    assert (x == comm.world_size * (comm.world_size + 1) / 2).all()
    return seen


def test_what_it_declines_raises_the_same_typed_errors_on_every_rank():
    assert gpucoll.spawn(_declines, 2, backend="host") == [["C-contiguous", "uint32", "bool", "int16"]] * 2
