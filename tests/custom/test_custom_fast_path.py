"""comm.all_reduce(x) in place, sync, algo auto, of an array that only exports __cuda_array_interface__ (gpucoll's
DeviceArray here) runs in one native call on the custom backend (CustomComm.all_reduce_array): the selector's answer
for the call's dtype and size bucket is read from a table (Selector.fast_choices) that the first call of a bucket
fills. Bit-exact for every dtype and op the kernels take, with the general path counted and required not to run;
what the kernels decline (other dtypes and ops) through the general path and its NCCL fallback; a bucket the
selector gives NCCL through NCCL's own one-call path; the interface's stream; the general path's typed errors for
what the one call declines; and the table emptied where the selector's cache is."""

from __future__ import annotations

import os

import gpu_arrays
import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.backends.custom import Custom
from gpucoll.errors import InvalidArgument
from gpucoll.testing import DeviceArray

pytestmark = [pytest.mark.spawns, pytest.mark.gpu, *helpers.timeout_mark(300)]

DTYPES = ("float16", "float32", "float64", "int32", "int8", "uint8", "int64")
OPS = ("sum", "min", "max", "avg", "prod")
KERNEL_DTYPES = ("float16", "float32", "float64", "int32")  # bfloat16 has no __cuda_array_interface__ type string
KERNEL_OPS = ("sum", "min", "max", "avg")
COUNTS = (1, 7, 1000, 40000)  # 40000 float64 (320 KB) is several staging pieces on the emulated device


def _device(comm) -> int:
    return int(comm.device.split(":")[1])


def _counting_general_path():
    """Custom.collective wrapped to count its calls; returns (the list it appends to, a function that restores it)."""
    real, ran = Custom.collective, []

    def counted(self, coll, *a, **k):
        ran.append(coll)
        return real(self, coll, *a, **k)

    Custom.collective = counted
    return ran, lambda: setattr(Custom, "collective", real)


def _exact(comm, with_nccl: bool):
    """Every dtype x op x count against the reference, the output's every byte compared; the kernels' cases must not
    touch the general path, the others must (and then need the NCCL fallback)."""
    P, r, dev = comm.world_size, comm.rank, _device(comm)
    ran, restore = _counting_general_path()
    errs = []
    try:
        for dtype in DTYPES:
            for op in OPS:
                kernel = dtype in KERNEL_DTYPES and op in KERNEL_OPS
                if (op == "avg" and not dtype.startswith("float")) or (not kernel and not with_nccl):
                    continue  # integer avg is NCCL's own rounding; other declines need the fallback
                for count in COUNTS:
                    inputs = [helpers.make_input(dtype, op, count, q, P, seed=count) for q in range(P)]
                    x = DeviceArray.from_host(np.asarray(inputs[r], dtype=dtype), device=dev)
                    before = len(ran)
                    comm.all_reduce(x, op=op)
                    got = x.to_host()
                    want = np.asarray(helpers.reference(inputs, dtype, op), dtype=dtype)
                    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                        errs.append(f"{dtype} {op} n={count}: wrong result")
                    if kernel and len(ran) != before:
                        errs.append(f"{dtype} {op} n={count}: the general path ran")
                    if not kernel and len(ran) == before:
                        errs.append(f"{dtype} {op} n={count}: a call the kernels decline did not reach the fallback")
    finally:
        restore()
    stats = dict(comm._ops.stats)
    table = dict(comm._ops.selector.fast_choices) if comm._ops._modelled() else None
    if table is not None:  # each bucket's entry is the selector's answer for that bucket, under the native key
        sel = comm._ops.selector
        for dtype in KERNEL_DTYPES:
            for count in COUNTS:
                nbytes = count * np.dtype(dtype).itemsize
                key = int(getattr(gpucoll._C.DType, dtype)) * 64 + (nbytes - 1).bit_length()
                choice = sel.choose(0, nbytes, dtype, "auto", backend="custom")
                if table.get(key, "missing") != choice.algorithm:
                    errs.append(f"{dtype} n={count}: table[{key}] = {table.get(key, 'missing')!r}, the selector "
                                f"says {choice.algorithm!r}")
    return errs, stats, table


def test_every_dtype_and_op_is_exact_and_the_kernels_take_theirs_in_one_call():
    with_nccl = gpu_arrays.nccl_ranks_problem(2) is None  # a GPU with an NCCL older than 2.30 has no fallback
    results = gpucoll.spawn(_exact, 2, args=(with_nccl,), backend="custom")
    for errs, stats, table in results:
        assert errs == [], errs
        kernel_calls = len(KERNEL_DTYPES) * len(KERNEL_OPS) * len(COUNTS) - len(COUNTS) * (len(KERNEL_OPS) - 3)
        assert stats["custom"] == kernel_calls, stats
        if table is not None:  # the selector decides: one entry per dtype and size bucket seen, the same on every rank
            assert table and all(v is None or isinstance(v, str) for v in table.values()), table
    assert results[0][2] == results[1][2]


def _nccl_bucket(comm):
    """backend='auto' (its GPU side the custom backend, free to choose NCCL) and GPUCOLL_ALGO=nccl, set before spawn:
    the selector gives every all_reduce to NCCL, which the one-call path then runs through NCCL's own
    (Nccl.all_reduce_array), the general path untouched."""
    gpu = comm._ops.gpu
    ran, restore = _counting_general_path()
    x = DeviceArray.from_host(np.full(1000, comm.rank + 1, np.float32), device=_device(comm))
    try:
        comm.all_reduce(x)
        comm.all_reduce(x)
    finally:
        restore()
    return gpu.name, ran, dict(gpu.stats), dict(gpu.selector.fast_choices), x.to_host()[[0, -1]].tolist()


def test_a_bucket_the_selector_gives_nccl_runs_through_nccls_one_call(monkeypatch):
    gpu_arrays.require_nccl_ranks(2)
    monkeypatch.setenv("GPUCOLL_ALGO", "nccl")
    monkeypatch.setenv("GPUCOLL_EMU_DEVICES", "2")  # 'auto' takes the custom backend where each rank has a GPU
    for name, ran, stats, table, ends in gpucoll.spawn(_nccl_bucket, 2, backend="auto"):
        if name != "custom":
            pytest.skip(f"backend='auto' chose {name} here, not the custom backend")
        assert ran == [] and stats == {"custom": 0, "nccl": 2}, (ran, stats)
        assert list(table.values()) == [None], table
        assert ends == [6.0, 6.0]  # (1 + 2), then (3 + 3)


def _on_its_stream(comm):
    return gpu_arrays.reduce_on_interface_stream(comm, Custom)


def test_an_interface_stream_is_the_one_it_runs_on():
    for taken, bad in gpucoll.spawn(_on_its_stream, 2, backend="custom"):
        ran = [t for t in taken if type(t) is not int]  # an int: the first call of a size bucket filled the table
        assert ran == [True] * 3 and bad == [], (taken, bad)


def _declines(comm):
    """What the one-call path declines raises the general path's typed error, on every rank; the rest runs."""
    dev = _device(comm)
    x = DeviceArray.from_host(np.zeros(8, np.float32), device=dev)
    seen = gpu_arrays.declined_interfaces_raise(comm, x)
    with pytest.raises(InvalidArgument, match="aligned"):  # a per-rank fact: an argument error, never a fallback
        comm.all_reduce(gpu_arrays.Interface(x, data=(x.ptr + 2, False), shape=(7,)))
    seen.append("aligned")
    empty = DeviceArray.from_host(np.zeros(0, np.float32), device=dev)
    assert comm.all_reduce(empty) is empty
    y = DeviceArray.from_host(np.full(5, comm.rank + 1, np.float32), device=dev)
    comm.all_reduce(y, async_op=True).wait()  # async: the general path, with its Work
    comm.all_reduce(y, op="MAX")  # an op spelled otherwise: the general path
    comm.all_reduce(y, algo="oneshot")  # a named algorithm: the general path
    comm.all_reduce(y)  # the one call
    return seen, y.to_host().tolist()


def test_what_it_declines_raises_the_same_typed_errors_on_every_rank():
    want = [w for _, _, w in gpu_arrays.DECLINED_INTERFACES] + ["aligned"]
    # 1 + 2 = 3, max 3, 3 + 3 = 6, 6 + 6 = 12
    assert gpucoll.spawn(_declines, 2, backend="custom") == [(want, [12.0] * 5)] * 2


def _table_follows_the_cache(comm):
    """The table is emptied with the selector's cache (a pair's P2P found broken changes the answers)."""
    x = DeviceArray.from_host(np.full(64, 1.0, np.float32), device=_device(comm))
    comm.all_reduce(x)
    sel = comm._ops.selector
    filled = len(sel.fast_choices)
    sel.mark_p2p_failed([])
    return filled, len(sel.fast_choices)


def test_the_table_is_emptied_with_the_selectors_cache():
    results = gpucoll.spawn(_table_follows_the_cache, 2, backend="custom")
    if os.environ.get("GPUCOLL_NO_NVML") or results[0][0] == 0:
        pytest.skip("the selector does not decide here (no GPU topology): the kernels' own size rule runs")
    assert results == [(1, 0)] * 2
