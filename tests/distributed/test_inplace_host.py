"""NCCL's in-place layouts on the host backend: all_gather/gather with x = this rank's block of out, and
reduce_scatter/scatter with out = this rank's block of x. Bit-exact, every algorithm that serves the call."""

from __future__ import annotations

import numpy as np
import pytest

import gpucoll
from gpucoll import _C

N = 100_003  # several pieces per block, ragged last piece
ALL_GATHER, REDUCE_SCATTER, GATHER, SCATTER = 3, 4, 6, 7


def _algos(coll, P):
    return ["auto"] + [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, coll, P, 0, 0) is None]


def _worker(comm):
    P, r, n = comm.world_size, comm.rank, N
    errs = []
    base = np.arange(P * n, dtype=np.float32) % 9
    for algo in _algos(ALL_GATHER, P):
        out = np.zeros(P * n, np.float32)
        out[r * n:(r + 1) * n] = r + 1
        got = comm.all_gather(out[r * n:(r + 1) * n], out=out, algo=algo)
        if got is not out or not np.array_equal(out, np.repeat(np.arange(1, P + 1, dtype=np.float32), n)):
            errs.append(f"all_gather {algo}")
    for algo in _algos(REDUCE_SCATTER, P):
        x = base + r
        comm.reduce_scatter(x, out=x[r * n:(r + 1) * n], algo=algo)
        if not np.array_equal(x[r * n:(r + 1) * n], (P * base + sum(range(P)))[r * n:(r + 1) * n]):
            errs.append(f"reduce_scatter {algo}")
    for root in range(P):
        for algo in _algos(GATHER, P):
            out = np.zeros(P * n, np.float32)
            out[r * n:(r + 1) * n] = base[:n] + r
            comm.gather(out[r * n:(r + 1) * n], out=out, root=root, algo=algo)
            if r == root and not np.array_equal(out, np.concatenate([base[:n] + q for q in range(P)])):
                errs.append(f"gather {algo} root {root}")
        for algo in _algos(SCATTER, P):
            x = base + 10 * r
            comm.scatter(x, out=x[r * n:(r + 1) * n], root=root, algo=algo)
            if not np.array_equal(x[r * n:(r + 1) * n], (base + 10 * root)[r * n:(r + 1) * n]):
                errs.append(f"scatter {algo} root {root}")
    return errs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_in_place_layouts(world_size):
    per_rank = gpucoll.spawn(_worker, world_size, backend="host", timeout=60)
    assert per_rank == [[]] * world_size, per_rank
