"""all_reduce_coalesced and all_gather_coalesced on CUDA memory (a GPU, or the emulated device of GPUCOLL_CUDA=emulate
builds): the nccl backend issues one collective per array inside one NCCL group, the custom backend one call per
array (gpucoll/_coalesced.py). Exact small-integer data, 3 ranks, sync and async_op."""

from __future__ import annotations

import numpy as np
import pytest
from nccl_ranks import Arrays

import gpucoll

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

SIZES = (5, 1, 1000, 33)


def _worker(comm):
    W, r = comm.world_size, comm.rank
    A = Arrays("device_array", int(comm.device.split(":")[1]))
    fails = []
    for async_op in (False, True):
        host = [np.arange(n, dtype=np.float32) * (k + 1) + r for k, n in enumerate(SIZES)]
        xs = [A.put(h, "float32") for h in host]
        res = comm.all_reduce_coalesced(xs, async_op=async_op)
        if async_op:
            res.synchronize()
            res = res.result()
        if res is not xs:
            fails.append(f"async_op={async_op}: returned something other than the list")
        for k, (x, n) in enumerate(zip(xs, SIZES)):
            want = np.arange(n, dtype=np.float32) * (k + 1) * W + W * (W - 1) / 2
            got = A.get(x, "float32")
            if not np.array_equal(got, want):
                fails.append(f"all_reduce_coalesced async_op={async_op} arrays[{k}]: {got[:4]} != {want[:4]}")
    ins = [A.put(np.full(n, 100 * r + k, np.int32), "int32") for k, n in enumerate(SIZES)]
    outs = comm.all_gather_coalesced(ins)
    for k, (o, n) in enumerate(zip(outs, SIZES)):
        want = np.concatenate([np.full(n, 100 * q + k, np.int32) for q in range(W)])
        if not np.array_equal(A.get(o, "int32"), want):
            fails.append(f"all_gather_coalesced outputs[{k}]")
    try:
        comm.all_reduce_coalesced([xs[0], ins[0]])
        fails.append("mixed dtype did not raise")
    except gpucoll.InvalidArgument as e:
        if "arrays[1]" not in str(e):
            fails.append(f"mixed dtype: {e}")
    return fails


@pytest.mark.parametrize("backend", ["nccl", "custom"])
def test_coalesced_on_cuda_memory(backend):
    per_rank = gpucoll.spawn(_worker, 3, backend=backend, timeout=300.0)
    failures = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not failures, "\n".join(failures)
