"""GPUCOLL_DEBUG_CHECKS=1 on the NCCL backend (gpucoll/_call_check.py): every kind of mismatched call raises the same
InvalidArgument on every rank, naming each rank's call, before anything is enqueued, and the communicator stays
usable (the next matched call is exact); point-to-point between some ranks does not disturb the numbering; a rank
that skips a collective is named. Three ranks, one spawn for the matrix; on the emulated device here and on a GPU.
"""

from __future__ import annotations

import time

import gpu_arrays
import numpy as np
import pytest
from nccl_ranks import Arrays

import gpucoll
from gpucoll.errors import CollectiveTimeout, InvalidArgument

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

W = 3
N = 8

# kind -> what every message must say (_mismatched_call says what the odd rank does instead)
KINDS = {
    "count": "differ in count",
    "dtype": "differ in dtype",
    "op": "differ in op",
    "root": "differ in root",
    "collective": "all_gather",
    "premul": "premul_sum",
    "barrier": "barrier()",
}


def _device(comm) -> int:
    return int(comm.device.split(":")[1])


def _mismatched_call(comm, A, kind: str, odd: bool) -> None:
    x = A.put(np.arange(N, dtype=np.float32) + comm.rank, "float32")
    if kind == "count":
        comm.all_reduce(x[:N - 1] if odd else x)
    elif kind == "dtype":
        comm.all_reduce(A.put(np.arange(N, dtype=np.int32), "int32") if odd else x)
    elif kind == "op":
        comm.all_reduce(x, op="max" if odd else "sum")
    elif kind == "root":
        comm.broadcast(x, root=2 if odd else 0)
    elif kind == "collective":
        if odd:
            comm.all_gather(x[:2], out=A.empty(2 * W, "float32"))
        else:
            comm.all_reduce(x)
    elif kind == "premul":
        comm.all_reduce(x, op=gpucoll.premul_sum(2.0) if odd else "sum")
    else:
        if odd:
            comm.barrier()
        else:
            comm.all_reduce(x)


def _matrix_worker(comm):
    """Each kind with each rank as the odd one; then a matched all_reduce, which must be exact; p2p between ranks 0
    and 1 only, between every case."""
    A = Arrays("device_array", _device(comm))
    seen = []
    for kind in KINDS:
        for odd_rank in range(W):
            try:
                _mismatched_call(comm, A, kind, comm.rank == odd_rank)
                seen.append((kind, odd_rank, "no error"))
            except InvalidArgument as e:
                seen.append((kind, odd_rank, str(e), list(e.ranks)))
            if comm.rank < 2:  # point-to-point among some ranks: not part of the collective sequence
                mine = A.put(np.arange(5, dtype=np.int64) + 10 * comm.rank, "int64")
                got = A.empty(5, "int64")
                with comm.group():
                    comm.send(mine, 1 - comm.rank)
                    comm.recv(got, 1 - comm.rank)
                if A.get(got, "int64").tolist() != list(range(10 * (1 - comm.rank), 10 * (1 - comm.rank) + 5)):
                    seen.append((kind, odd_rank, "p2p wrong"))
            y = A.put(np.arange(N, dtype=np.float32) + comm.rank, "float32")
            comm.all_reduce(y)
            want = (np.arange(N, dtype=np.float32) * W + sum(range(W))).tolist()
            if A.get(y, "float32").tolist() != want:
                seen.append((kind, odd_rank, "matched call after the mismatch was wrong"))
    comm.barrier()
    return seen


def test_every_mismatch_raises_the_same_error_on_every_rank(monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG_CHECKS", "1")  # the spawned ranks inherit it
    gpu_arrays.require_nccl_ranks(W)
    per_rank = gpucoll.spawn(_matrix_worker, W, backend="nccl", timeout=120.0)
    assert per_rank[0] == per_rank[1] == per_rank[2], "ranks saw different outcomes"
    rows = per_rank[0]
    assert len(rows) == len(KINDS) * W, rows  # nothing else was recorded: p2p and the matched calls were exact
    for kind, odd_rank, message, ranks in rows:
        assert message.startswith("ranks made different calls as collective #"), (kind, odd_rank, message)
        assert KINDS[kind] in message, (kind, odd_rank, message)
        # The lines name each rank's call: the odd rank on its own line (rank 0 odd: ranks 1-2 share the other).
        assert f"rank {odd_rank}:" in message, (kind, odd_rank, message)
        assert ranks == ([1, 2] if odd_rank == 0 else [odd_rank]), (kind, odd_rank, ranks)


def _skip_worker(comm):
    """Rank 1 skips one all_reduce: rank 0 and 2 are told that rank 1 never made collective #1."""
    A = Arrays("device_array", _device(comm))
    x = A.put(np.arange(N, dtype=np.float32), "float32")
    comm.all_reduce(x)
    if comm.rank == 1:
        return "skipped"
    try:
        comm.all_reduce(x)
    except CollectiveTimeout as e:
        if comm.rank == 0:  # rank 0 serves the store: rank 2, which began waiting a little later, still uses it
            time.sleep(2.0)
        return (list(e.ranks), "collective #1" in str(e), "GPUCOLL_DEBUG_CHECKS" in str(e))
    return "no error"


def test_a_rank_that_skips_a_collective_is_named(monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG_CHECKS", "1")
    gpu_arrays.require_nccl_ranks(W)
    results = gpucoll.spawn(_skip_worker, W, backend="nccl", timeout=3.0)
    assert results == [([1], True, True), "skipped", ([1], True, True)], results
