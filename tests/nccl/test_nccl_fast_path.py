"""comm.all_reduce(x) in place, sync, of an array that only exports __cuda_array_interface__ (gpucoll's DeviceArray
here) runs in one native call on the nccl backend (NcclComm.all_reduce_array): bit-exact for every dtype and op
with the general path switched off, on x's own stream; what it declines (strided, read-only, masked, foreign byte
order, raw bytes, empty, async_op, an NCCL algo name) takes the general path and raises its typed errors."""

from __future__ import annotations

import gpu_arrays
import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll._device_array import DeviceArray
from gpucoll.backends.nccl import Nccl
from gpucoll.errors import Unsupported

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")
COUNTS = (1, 7, 1000)


def _device(comm) -> int:
    return int(comm.device.split(":")[1])


def _exact(comm):
    """Every dtype x op x count on the one-call path against the reference, the general path off: a call that fell
    back to it fails loudly instead of passing unseen."""
    P, r, dev = comm.world_size, comm.rank, _device(comm)
    general = Nccl.collective
    Nccl.collective = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the general path ran"))
    errs = []
    try:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype not in ("float16", "float32", "float64"):
                    continue  # integer avg is NCCL's own rounding; the general path's tests cover it
                for count in COUNTS:
                    inputs = [helpers.make_input(dtype, op, count, q, P, seed=count) for q in range(P)]
                    x = DeviceArray.from_host(np.asarray(inputs[r], dtype=dtype), device=dev)
                    comm.all_reduce(x, op=op)
                    got = x.to_host()
                    want = np.asarray(helpers.reference(inputs, dtype, op), dtype=dtype)
                    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                        errs.append(f"{dtype} {op} n={count}")
    finally:
        Nccl.collective = general
    return errs


def test_every_dtype_and_op_is_exact_on_the_one_call_path():
    gpu_arrays.require_nccl_ranks(2)
    assert gpucoll.spawn(_exact, 2, backend="nccl") == [[]] * 2


def _on_its_stream(comm):
    return gpu_arrays.reduce_on_interface_stream(comm, Nccl)


def test_an_interface_stream_is_the_one_it_runs_on():
    gpu_arrays.require_nccl_ranks(2)
    for taken, bad in gpucoll.spawn(_on_its_stream, 2, backend="nccl"):
        assert taken == [True] * 3 and bad == [], (taken, bad)


def _declines(comm):
    """What the one-call path declines raises the general path's typed error, on every rank."""
    dev = _device(comm)
    x = DeviceArray.from_host(np.zeros(8, np.float32), device=dev)
    seen = gpu_arrays.declined_interfaces_raise(comm, x)
    with pytest.raises(Unsupported, match="uint32"):
        comm.all_reduce(gpu_arrays.Interface(x, typestr="<u4"))
    seen.append("uint32")
    empty = DeviceArray.from_host(np.zeros(0, np.float32), device=dev)
    assert comm.all_reduce(empty) is empty
    y = DeviceArray.from_host(np.full(5, comm.rank + 1, np.float32), device=dev)
    comm.all_reduce(y, async_op=True).wait()  # async: the general path, with its Work
    comm.all_reduce(y, op="MAX")  # an op spelled otherwise: the general path
    comm.all_reduce(y, algo="nccl")  # the one call
    return seen, y.to_host().tolist()


def test_what_it_declines_raises_the_same_typed_errors_on_every_rank():
    gpu_arrays.require_nccl_ranks(2)
    want = [w for _, _, w in gpu_arrays.DECLINED_INTERFACES] + ["uint32"]
    assert gpucoll.spawn(_declines, 2, backend="nccl") == [(want, [6.0] * 5)] * 2  # 1+2, max, then sum
