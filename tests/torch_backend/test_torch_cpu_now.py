"""`dist.all_reduce(t)` on a CPU tensor, waited for at once: the torch backend's one-call path (ReduceMixin.
_allreduce_now: a NumPy view of `t` straight to the host backend's one-call all_reduce) must give exactly what the
general path gives, for every dtype and op it takes, and must step aside (the general path runs) wherever its
conditions do not hold: async_op, a queued background all_reduce before it, a non-contiguous or grad-requiring
tensor, bfloat16, PREMUL_SUM. Each rank counts the one-call path's calls (a spy on the communicator's fast path), so
a path that silently stopped being taken fails here too."""

from __future__ import annotations

import pytest
import torch_ranks

pytestmark = pytest.mark.spawns

P = 4  # a power of two: AVG pre-multiplies floats by 1/P (as ncclAvg), exact only then
# dtype, op, values of rank r at element i (small integers: exact in every dtype), and the expected reduction
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")


def _value(r: int, i: int) -> int:
    return (r + 1) * ((i % 3) + 1) + (i % 5)


def _want(op: str, i: int, P: int, dtype: str) -> float:
    vals = [_value(q, i) for q in range(P)]
    if op == "SUM":
        return sum(vals)
    if op == "MAX":
        return max(vals)
    if op == "MIN":
        return min(vals)
    if op == "PRODUCT":
        out = 1
        for v in vals:
            out *= v
        return out % 256 if dtype == "uint8" else out
    total = sum(vals)
    return total / P if dtype.startswith("float") else int(total / P)  # integers truncate toward zero


def _worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from gpucoll.backends.host import Host

    taken = []
    real = Host.fast_all_reduce

    def spy(self, x, op, algo, stream, async_op):
        done = real(self, x, op, algo, stream, async_op)
        taken.append(bool(done))
        return done

    Host.fast_all_reduce = spy
    n = 11
    out = {"results": {}, "now": {}}
    dist.all_reduce(torch.zeros(1))  # the group's CPU communicator comes with the first operation
    for dtype in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"):
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
            if dtype == "int8" and op == "PRODUCT":
                continue  # 3 * 6 * 9 ... overflows int8; the products are checked on the other dtypes
            t = torch.tensor([_value(rank, i) for i in range(n)], dtype=getattr(torch, dtype))
            del taken[:]
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out["results"][f"{dtype}/{op}"] = t.double().tolist()
            out["now"][f"{dtype}/{op}"] = list(taken)
    # Where the one-call path must step aside, each result is still exact.
    steps = {}
    x = torch.full((8,), float(rank + 1))
    del taken[:]
    w = dist.all_reduce(x, async_op=True)  # the background worker runs it
    y = torch.full((8,), float(10 * (rank + 1)))
    dist.all_reduce(y)  # queued behind x's: the general path drains the worker first
    w.wait()
    steps["after_async"] = (x.tolist(), y.tolist(), list(taken))
    z = torch.arange(16, dtype=torch.float32).reshape(4, 4).t() + rank  # not contiguous
    del taken[:]
    dist.all_reduce(z)
    steps["strided"] = (z.tolist(), list(taken))
    g = torch.full((4,), float(rank + 1), requires_grad=True)
    with torch.no_grad():
        del taken[:]
        dist.all_reduce(g)
    steps["grad"] = (g.detach().tolist(), list(taken))
    b = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
    del taken[:]
    dist.all_reduce(b)
    steps["bfloat16"] = (b.float().tolist(), list(taken))
    pm = torch.full((4,), float(rank + 1))
    del taken[:]
    dist.all_reduce(pm, op=dist._make_nccl_premul_sum(2.0))
    steps["premul"] = (pm.tolist(), list(taken))
    out["steps"] = steps
    Host.fast_all_reduce = real
    return out


def test_every_dtype_and_op_is_exact_and_takes_one_call():
    res = torch_ranks.run(_worker, P, backend="gpucoll")
    n = 11
    total = sum(range(1, P + 1))
    for rank, out in enumerate(res):
        for key, got in out["results"].items():
            dtype, op = key.split("/")
            want = [float(_want(op, i, P, dtype)) for i in range(n)]
            assert got == want, f"rank {rank} {key}: {got} != {want}"
            assert out["now"][key] == [True], f"rank {rank} {key}: the one-call path was not taken: {out['now'][key]}"
        s = out["steps"]
        x, y, taken = s["after_async"]
        assert x == [float(total)] * 8 and y == [float(10 * total)] * 8, s["after_async"]
        assert True not in taken, f"rank {rank}: the all_reduce queued behind an async one ran on the caller: {taken}"
        z, taken = s["strided"]
        want_z = [[float(P * (4 * j + i) + total - P) for j in range(4)] for i in range(4)]  # sum of base.t() + r
        assert z == want_z, (z, want_z)
        assert True not in taken, f"rank {rank}: a strided tensor took the one-call path"
        assert s["grad"][0] == [float(total)] * 4 and s["grad"][1] == [True], s["grad"]
        assert s["bfloat16"][0] == [float(total)] * 4 and s["bfloat16"][1] != [True], s["bfloat16"]
        assert s["premul"][0] == [2.0 * total] * 4 and s["premul"][1] != [True], s["premul"]

