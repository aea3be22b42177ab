"""avg and premul_sum on the host backend, as NCCL computes them (core/dispatch.h):

* floating avg is a pre-multiplied sum: each input times NCCL's 1/n rounded to the dtype, then summed. Three
  float16 60000s average to 60000 (a sum first would be inf), on every algorithm; and where x * (1/3 rounded)
  and x / 3 round differently, the result is the former, NCCL's.
* integer avg is the wrapped sum divided by n, truncating toward zero.
* premul_sum(s) runs on the host backend: all_reduce, reduce and reduce_scatter, in and out of place, float and
  integer (an integer scalar wraps like NCCL's), and a bad scalar is the same InvalidArgument on every rank, which
  leaves the communicator usable.

One spawn per world size; the cases run inside it and come back as failure text (the distributed tests' pattern).
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import InvalidArgument

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZES = (2, 3, 5)
SENTINEL = 0x5A


def _algos(comm) -> list:
    from gpucoll import _C

    names = [a for a in _C.algorithm_names() if _C.algorithm_supports(a, 0)
             and _C.predict(a, 0, comm.world_size, 1024, 0)["usable"]]
    return ["auto", *names]


def _out(shape, dtype):
    out = np.empty(shape, dtype)
    out.view(np.uint8).fill(SENTINEL)
    return out


def _worker(comm):
    W, r = comm.world_size, comm.rank
    fails = []

    def expect(what, got, want):
        if not np.array_equal(np.asarray(got), np.asarray(want)) or np.asarray(got).dtype != np.asarray(want).dtype:
            fails.append(f"{what}: got {np.asarray(got).tolist()[:6]}, expected {np.asarray(want).tolist()[:6]}")

    # float16 avg near the top of the range: no overflow, on every algorithm, in place and out of place
    for algo in _algos(comm):
        x = np.full(37, 60000, np.float16)
        comm.all_reduce(x, op="avg", algo=algo)
        expect(f"{algo}: float16 avg of {W} x 60000 in place", x, np.full(37, 60000, np.float16))
        out = _out(37, np.float16)
        comm.all_reduce(np.full(37, -60000, np.float16), out=out, op="avg", algo=algo)
        expect(f"{algo}: float16 avg of {W} x -60000", out, np.full(37, -60000, np.float16))
    # reduce and reduce_scatter pre-multiply too
    red = _out(4, np.float16)
    comm.reduce(np.full(4, 60000, np.float16), out=red if r == 0 else None, op="avg", root=0)
    if r == 0:
        expect("reduce float16 avg of 60000", red, np.full(4, 60000, np.float16))
    rs = comm.reduce_scatter(np.full(3 * W, 60000, np.float16), op="avg")
    expect("reduce_scatter float16 avg of 60000", rs, np.full(3, 60000, np.float16))

    # one rank's x, zeros elsewhere: the result is x times NCCL's 1/n rounded once, not x / n rounded
    ks = np.array([5, 7, 10, 14, 17, 20, 23, 25, 28, 31], np.float64)
    for dtype in ("float32", "float16", "float64"):
        x = (ks if r == 0 else np.zeros_like(ks)).astype(dtype)
        comm.all_reduce(x, op="avg")
        expect(f"{dtype} avg of [k, 0, ...]", x, helpers.avg_premul(ks, dtype, W).astype(dtype))

    # integer avg: wrapped sum, then truncation toward zero
    xi = np.array([7, -7, 100, -100, 127, -128], np.int8) if r == 0 else np.zeros(6, np.int8)
    comm.all_reduce(xi, op="avg")
    expect("int8 avg", xi, helpers.avg_int(np.array([7, -7, 100, -100, 127, -128], np.int64), W, "int8"))

    # premul_sum on the host backend
    base = np.arange(10, dtype=np.float32) + 1
    out = _out(10, np.float32)
    comm.all_reduce(base * (r + 1), out=out, op=gpucoll.premul_sum(0.5))
    expect("all_reduce premul_sum(0.5) float32", out, base * (W * (W + 1) / 2 * 0.5))
    xi32 = np.arange(6, dtype=np.int32) + r
    comm.all_reduce(xi32, op=gpucoll.premul_sum(3))
    expect("all_reduce premul_sum(3) int32", xi32, 3 * (np.arange(6, dtype=np.int32) * W + W * (W - 1) // 2))
    xu8 = np.full(4, 200, np.uint8)
    comm.all_reduce(xu8, op=gpucoll.premul_sum(3))  # 600 wraps to 88 per rank, as NCCL's integer pre-op
    expect("all_reduce premul_sum(3) uint8 wraps", xu8, np.full(4, (88 * W) % 256, np.uint8))
    red = _out(5, np.float64)
    comm.reduce(np.full(5, float(r + 1)), out=red if r == W - 1 else None, op=gpucoll.premul_sum(0.25), root=W - 1)
    if r == W - 1:
        expect("reduce premul_sum(0.25) float64", red, np.full(5, W * (W + 1) / 2 * 0.25))
    rs = comm.reduce_scatter(np.arange(2 * W, dtype=np.float32) * (r + 1), op=gpucoll.premul_sum(2.0))
    expect("reduce_scatter premul_sum(2)", rs, (np.arange(2 * W, dtype=np.float32) * (W * (W + 1)))[2 * r:2 * r + 2])
    # a per-rank scalar is allowed (each rank scales its own input), as in NCCL
    y = np.ones(3, np.float64)
    comm.all_reduce(y, op=gpucoll.premul_sum(float(r)))
    expect("premul_sum with a scalar per rank", y, np.full(3, W * (W - 1) / 2))

    # bad scalars: the same InvalidArgument on every rank, nothing left half done
    for scalar, dtype, match in ((0.5, np.int32, "is not an integer"), (300, np.uint8, "does not fit in uint8"),
                                 (1e6, np.float16, "overflows float16")):
        try:
            comm.all_reduce(np.ones(4, dtype), op=gpucoll.premul_sum(scalar))
            fails.append(f"premul_sum({scalar}) on {np.dtype(dtype).name} did not raise")
        except InvalidArgument as e:
            if match not in str(e):
                fails.append(f"premul_sum({scalar}) on {np.dtype(dtype).name}: {e}")
    try:
        comm.broadcast(np.ones(4, np.float32), root=0)
        comm.all_gather(np.ones(2, np.float32))
    except Exception as e:  # noqa: BLE001
        fails.append(f"after the refused premul_sum calls: {type(e).__name__}: {e}")
    problem = helpers.still_works(comm)
    if problem:
        fails.append(problem)
    return fails


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_avg_and_premul_sum_as_nccl_computes_them(world_size):
    per_rank = gpucoll.spawn(_worker, world_size, backend="host", timeout=60.0)
    failures = helpers.merge_rank_failures([{"f": f} for f in per_rank], "f")
    assert not failures, helpers.format_failures(failures)
