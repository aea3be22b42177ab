"""torch's coalesced all-reduces on CPU tensors through gpucoll's torch backend: dist.all_reduce_coalesced and the
all-reduces inside dist._coalescing_manager (what FSDP and DDP use) reach ProcessGroupGpucoll.allreduce_coalesced,
which hands the whole list to the host communicator's all_reduce_coalesced: one native call and one collective for
a list below the fusion chunk, no per-tensor all_reduce. Each rank counts both (spies on the Communicator) and the
host communicator's collectives (op_seq), so a path that silently went back to one call per tensor fails here."""

from __future__ import annotations

import pytest
import torch_ranks

pytestmark = pytest.mark.spawns

P = 4  # a power of two: AVG pre-multiplies floats by 1/P (as ncclAvg), exact only then


def _worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from gpucoll.communicator import Communicator

    calls = {"coalesced": 0, "all_reduce": 0}
    real_coalesced, real_all_reduce = Communicator.all_reduce_coalesced, Communicator.all_reduce

    def coalesced(self, *a, **k):
        calls["coalesced"] += 1
        return real_coalesced(self, *a, **k)

    def all_reduce(self, *a, **k):
        calls["all_reduce"] += 1
        return real_all_reduce(self, *a, **k)

    Communicator.all_reduce_coalesced, Communicator.all_reduce = coalesced, all_reduce
    dist.all_reduce(torch.zeros(1))  # the group's CPU communicator comes with the first operation
    comm = dist.distributed_c10d._get_default_group().communicator("cpu")
    out = {}

    def run(key, fn, tensors):
        calls.update(coalesced=0, all_reduce=0)
        seq = comm._ops.impl.op_seq
        fn()
        out[key] = ([t.to(torch.float64).tolist() if not t.is_complex() else torch.view_as_real(t).tolist()
                     for t in tensors], dict(calls), comm._ops.impl.op_seq - seq)

    def values(shape, dtype=torch.float32, k=0):
        n = 1
        for s in shape:
            n *= s
        return (torch.arange(n, dtype=torch.float64) % 7 + 10 * k + rank + 1).reshape(shape).to(dtype)

    ts = [values((3, 4)), values((5,), k=1), values((6, 4), k=2).t(), values((), k=3)]  # a strided one, a 0-d one
    run("all_reduce_coalesced", lambda: dist.all_reduce_coalesced(ts), ts)
    bf = [values((7,), torch.bfloat16), values((2, 3), torch.bfloat16, k=1)]
    run("bfloat16 MAX", lambda: dist.all_reduce_coalesced(bf, op=dist.ReduceOp.MAX), bf)
    cx = [torch.complex(values((4,)), values((4,), k=1)), torch.complex(values((2,), k=2), values((2,), k=3))]
    run("complex SUM", lambda: dist.all_reduce_coalesced(cx), cx)
    iv = [values((5,), torch.int32), values((3,), torch.int32, k=1)]
    run("int32 AVG", lambda: dist.all_reduce_coalesced(iv, op=dist.ReduceOp.AVG), iv)

    cm = [values((9,), k=k) for k in range(5)]

    def manager():
        with dist._coalescing_manager():
            for t in cm:
                dist.all_reduce(t)
    run("coalescing_manager", manager, cm)

    flat = torch.cat([values((n,), k=k) for k, n in enumerate((4, 6, 3))])
    views = [flat[0:4], flat[4:10], flat[10:13]]  # a bucket's gradients: consecutive views of one buffer

    def manager_async():
        with dist._coalescing_manager(async_ops=True) as c:
            for t in views:
                dist.all_reduce(t)
        c.wait()
    run("coalescing_manager async views", manager_async, views)
    Communicator.all_reduce_coalesced, Communicator.all_reduce = real_coalesced, real_all_reduce
    return out


def _want(shape_values, op):
    import torch

    if op == "MAX":
        return torch.stack(shape_values).amax(0)
    total = torch.stack(shape_values).sum(0)
    return torch.div(total, P, rounding_mode="trunc") if op == "AVG" else total


def test_coalesced_cpu_is_one_native_call_and_exact():
    torch = pytest.importorskip("torch")
    res = torch_ranks.run(_worker, P, backend="gpucoll")

    def values(r, shape, k=0):
        n = 1
        for s in shape:
            n *= s
        return (torch.arange(n, dtype=torch.float64) % 7 + 10 * k + r + 1).reshape(shape)

    want = {
        "all_reduce_coalesced": [_want([values(r, (3, 4)) for r in range(P)], "SUM"),
                                 _want([values(r, (5,), 1) for r in range(P)], "SUM"),
                                 _want([values(r, (6, 4), 2).t() for r in range(P)], "SUM"),
                                 _want([values(r, (), 3) for r in range(P)], "SUM")],
        "bfloat16 MAX": [_want([values(r, (7,)) for r in range(P)], "MAX"),
                         _want([values(r, (2, 3), 1) for r in range(P)], "MAX")],
        "complex SUM": [torch.stack([_want([values(r, (4,)) for r in range(P)], "SUM"),
                                     _want([values(r, (4,), 1) for r in range(P)], "SUM")], -1),
                        torch.stack([_want([values(r, (2,), 2) for r in range(P)], "SUM"),
                                     _want([values(r, (2,), 3) for r in range(P)], "SUM")], -1)],
        "int32 AVG": [_want([values(r, (5,)) for r in range(P)], "AVG"),
                      _want([values(r, (3,), 1) for r in range(P)], "AVG")],
        "coalescing_manager": [_want([values(r, (9,), k) for r in range(P)], "SUM") for k in range(5)],
        "coalescing_manager async views": [_want([values(r, (n,), k) for r in range(P)], "SUM")
                                           for k, n in enumerate((4, 6, 3))],
    }
    for rank, out in enumerate(res):
        for key, expected in want.items():
            got, calls, collectives = out[key]
            assert got == [w.tolist() for w in expected], f"rank {rank} {key}: {got}"
            assert calls == {"coalesced": 1, "all_reduce": 0}, f"rank {rank} {key}: {calls}"
            assert collectives == 1, f"rank {rank} {key}: {collectives} collectives, not one"
