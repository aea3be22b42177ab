"""NCCL's in-place layouts on the host backend: all_gather/gather with x = this rank's block of out, and
reduce_scatter/scatter with out = this rank's block of x. Bit-exact, every algorithm that serves the call."""

from __future__ import annotations

import numpy as np
import pytest

import gpucoll
from gpucoll import _C

pytestmark = pytest.mark.spawns

N = 100_003  # several pieces per block, ragged last piece
ALL_GATHER, REDUCE_SCATTER, GATHER, SCATTER = 3, 4, 6, 7


def _algos(coll, P):
    return ["auto"] + [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, coll, P, 0, 0) is None]


def _worker(comm):
    """Every element distinct (its global index; scatter adds a per-rank offset), so that a piece written at the
    wrong offset, within its block or into another, or data taken from the wrong rank, changes the result. All
    values stay below 2**24: exact in float32, sums included."""
    P, r, n = comm.world_size, comm.rank, N
    errs = []
    idx = np.arange(P * n, dtype=np.float32)
    mine = slice(r * n, (r + 1) * n)

    def check(what, got, want):
        bad = np.flatnonzero(got != want)
        if bad.size:
            errs.append(f"{what}: {bad.size} elements differ, first at [{bad[0]}]: got {got[bad[0]]}, "
                        f"expected {want[bad[0]]}")

    for algo in _algos(ALL_GATHER, P):
        out = np.zeros(P * n, np.float32)
        out[mine] = idx[mine] + 1
        got = comm.all_gather(out[mine], out=out, algo=algo)
        if got is not out:
            errs.append(f"all_gather {algo}: did not return out")
        check(f"all_gather {algo}", out, idx + 1)
    for algo in _algos(REDUCE_SCATTER, P):
        x = idx + r
        comm.reduce_scatter(x, out=x[mine], algo=algo)
        check(f"reduce_scatter {algo}", x[mine], (P * idx + sum(range(P)))[mine])
    for root in range(P):
        for algo in _algos(GATHER, P):
            out = np.zeros(P * n, np.float32)
            out[mine] = idx[mine] + 1
            comm.gather(out[mine], out=out, root=root, algo=algo)
            if r == root:
                check(f"gather {algo} root {root}", out, idx + 1)
        for algo in _algos(SCATTER, P):
            x = idx + 1_000_000 * r
            comm.scatter(x, out=x[mine], root=root, algo=algo)
            check(f"scatter {algo} root {root}", x[mine], (idx + 1_000_000 * root)[mine])
    return errs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_in_place_layouts(world_size):
    per_rank = gpucoll.spawn(_worker, world_size, backend="host", timeout=60)
    assert per_rank == [[]] * world_size, per_rank
