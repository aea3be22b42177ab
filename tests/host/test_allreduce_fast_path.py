"""comm.all_reduce(x) of a NumPy array in place with algo='auto' runs in one native call on the host backend
(HostComm.all_reduce_array): bit-exact for every dtype and op the general path takes, the same typed errors for
what it declines (they come from the general path), and a group() or any other argument still takes the general
path."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def _general_path_off():
    """A call that fell back to the general path fails loudly inside, instead of passing unseen."""
    general = Host.collective
    Host.collective = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the general path ran"))
    try:
        yield
    finally:
        Host.collective = general


def _exact(comm):
    """Every dtype x op x count on the one-call path, against the reference, the general path switched off."""
    P, r = comm.world_size, comm.rank
    errs = []
    with _general_path_off():
        for dtype in DTYPES:
            for op in OPS:
                for count in COUNTS:
                    inputs = [helpers.make_input(dtype, op, count, q, P, seed=count) for q in range(P)]
                    x = np.array(inputs[r], dtype=dtype)
                    comm.all_reduce(x, op=op)
                    want = helpers.reference(inputs, dtype, op)
                    if not np.array_equal(x.view(np.uint8), np.asarray(want, dtype=dtype).view(np.uint8)):
                        errs.append(f"{dtype} {op} n={count}")
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


# -- CPU torch tensors: read in C++ (python/host_array.cc) on the same one-call path ------------------------------

TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


def _small(count: int, q: int) -> np.ndarray:
    """Rank q's bfloat16 inputs as float32: small integers, distinct per rank and element, whose sums over a few
    ranks bfloat16 holds exactly (it has 8 significant bits)."""
    return np.array([(q + 1) * (i % 3 + 1) + i % 5 for i in range(count)], np.float32)


def _torch_exact(comm):
    """Every dtype (bfloat16 too, which NumPy lacks) x op x count of a CPU tensor on the one-call path, with the
    general path switched off, against the NumPy reference (computed in float32 for bfloat16)."""
    import torch

    _warm_ops(comm)
    P, r = comm.world_size, comm.rank
    errs = []
    with _general_path_off():
        for dtype in TORCH_DTYPES:
            ref_dtype = "float32" if dtype == "bfloat16" else dtype
            for op in OPS:
                if dtype == "bfloat16" and op in ("prod", "avg"):
                    continue  # products and 1/P multiples of the reference's inputs are not all bfloat16 values
                for count in COUNTS:
                    inputs = ([helpers.make_input(dtype, op, count, q, P, seed=count) for q in range(P)]
                              if dtype != "bfloat16" else [_small(count, q) for q in range(P)])
                    x = torch.from_numpy(np.array(inputs[r], dtype=ref_dtype)).to(getattr(torch, dtype))
                    assert comm.all_reduce(x, op=op) is x
                    want = torch.from_numpy(np.asarray(helpers.reference(inputs, ref_dtype, op), dtype=ref_dtype))
                    if not torch.equal(x, want.to(x.dtype)):
                        errs.append(f"{dtype} {op} n={count}")
    return errs


@pytest.mark.parametrize("P", (2, 3))
def test_cpu_torch_tensors_are_exact_on_the_one_call_path(P):
    pytest.importorskip("torch")
    assert gpucoll.spawn(_torch_exact, P, backend="host") == [[]] * P


def _torch_declines(comm):
    """What the C++ reader declines takes the general path: its typed error on every rank, or the right result (a
    lazily negated view raises rather than reducing the memory under it, which holds the values negated)."""
    import torch

    _warm_ops(comm)
    P, r = comm.world_size, comm.rank
    total = P * (P + 1) // 2
    seen = []
    for make, exc, what in (
        (lambda: torch.zeros(4, 2)[:, 0], InvalidArgument, "contiguous"),
        (lambda: torch._neg_view(torch.ones(4)), InvalidArgument, "negated"),
        (lambda: torch.zeros(4, dtype=torch.bool), Unsupported, "bool"),
        (lambda: torch.zeros(4, dtype=torch.complex64), Unsupported, "complex64"),
        (lambda: torch.zeros(4, dtype=torch.int16), Unsupported, "int16"),
    ):
        with pytest.raises(exc, match=what):
            comm.all_reduce(make())
        seen.append(what)

    class Sub(torch.Tensor):  # a subclass may mean anything by its storage: the general path decides (refuses)
        pass

    s = torch.full((3,), float(r + 1)).as_subclass(Sub)
    with pytest.raises(InvalidArgument, match="DLPack"):
        comm.all_reduce(s)
    assert s.tolist() == [float(r + 1)] * 3
    calls = []
    general = Host.collective

    def counted(self, *a, **k):
        calls.append(1)
        return general(self, *a, **k)

    Host.collective = counted
    try:
        p = torch.nn.Parameter(torch.full((3,), float(r + 1)))  # read in C++ like a plain tensor
        with torch.no_grad():
            comm.all_reduce(p)
        assert calls == [] and p.tolist() == [float(total)] * 3, (calls, p)
        t = torch.full((2, 3), float(r + 1))[1]  # a contiguous view at an offset: its own data_ptr
        comm.all_reduce(t)
        assert calls == [] and t.tolist() == [float(total)] * 3, (calls, t)
        comm.all_reduce(t, t)  # out= is the general path's
        assert calls == [1] and t.tolist() == [float(P * total)] * 3, (calls, t)
    finally:
        Host.collective = general
    return seen


def test_what_the_tensor_reader_declines_raises_or_takes_the_general_path():
    pytest.importorskip("torch")
    assert gpucoll.spawn(_torch_declines, 2, backend="host") == [["contiguous", "negated", "bool", "complex64",
                                                                   "int16"]] * 2
