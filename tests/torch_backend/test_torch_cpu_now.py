"""`dist.all_reduce(t)` on a CPU tensor, waited for at once: the torch backend's one-call path
(ProcessGroupGpucoll.allreduce: `t` straight to the host backend's one-call all_reduce, which reads the tensor in
C++) must give exactly what the general path gives, for every dtype and op it takes, and must step aside (the general
path runs) wherever its conditions do not hold: async_op, a non-contiguous or lazily negated tensor, PREMUL_SUM (a
call after an async one takes it: the host communicator runs its operations in call order). Each rank counts the
one-call path's calls (a spy on the communicator's fast path), so a path that silently stopped being taken fails here
too."""

from __future__ import annotations

import pytest
import torch_ranks

pytestmark = pytest.mark.spawns

P = 4  # a power of two: AVG pre-multiplies floats by 1/P (as ncclAvg), exact only then
# dtype, op, values of rank r at element i (small integers: exact in every dtype), and the expected reduction
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
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
    return total / P if "float" in dtype else int(total / P)  # integers truncate toward zero


def _worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from gpucoll.backends.host import Host

    taken = []
    real = Host.torch_all_reduce

    def spy(self, ops):  # what the group calls its one native call with, counted on the caller's thread
        now = real(self, ops)

        def counted(tensors, opts):
            done = now(tensors, opts)
            taken.append(bool(done))
            return done

        return counted

    Host.torch_all_reduce = spy
    n = 11
    out = {"results": {}, "now": {}}
    dist.all_reduce(torch.zeros(1))  # the group's CPU communicator comes with the first operation
    for dtype in DTYPES:
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
            if dtype in ("int8", "bfloat16") and op == "PRODUCT":
                continue  # 3 * 6 * 9 ... overflows int8 and is inexact in bfloat16; the other dtypes check products
            t = torch.tensor([_value(rank, i) for i in range(n)], dtype=getattr(torch, dtype))
            del taken[:]
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out["results"][f"{dtype}/{op}"] = t.double().tolist()
            out["now"][f"{dtype}/{op}"] = list(taken)
    # Where the one-call path must step aside, each result is still exact.
    steps = {}
    x = torch.full((8,), float(rank + 1))
    del taken[:]
    w = dist.all_reduce(x, async_op=True)  # the host communicator's progress thread runs it
    y = torch.full((8,), float(10 * (rank + 1)))
    dist.all_reduce(y)  # the one-call path, which runs after x's (C++ keeps the communicator's call order)
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
    neg = torch._neg_view(torch.arange(4, dtype=torch.float32) + rank)  # its memory holds -(arange + rank)
    del taken[:]
    dist.all_reduce(neg)
    steps["neg_view"] = (neg.tolist(), list(taken))
    pm = torch.full((4,), float(rank + 1))
    del taken[:]
    dist.all_reduce(pm, op=dist._make_nccl_premul_sum(2.0))
    steps["premul"] = (pm.tolist(), list(taken))
    out["steps"] = steps
    Host.torch_all_reduce = real
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
        assert taken == [False, True], f"rank {rank}: async_op declines the one-call path, the call after takes it: {taken}"
        z, taken = s["strided"]
        want_z = [[float(P * (4 * j + i) + total - P) for j in range(4)] for i in range(4)]  # sum of base.t() + r
        assert z == want_z, (z, want_z)
        assert True not in taken, f"rank {rank}: a strided tensor took the one-call path"
        assert s["grad"][0] == [float(total)] * 4 and s["grad"][1] == [True], s["grad"]
        assert s["bfloat16"][0] == [float(total)] * 4 and s["bfloat16"][1] == [True], s["bfloat16"]
        want_neg = [-(P * i + total - P) for i in range(4)]  # sum over r of -(i + r)
        assert s["neg_view"][0] == want_neg and True not in s["neg_view"][1], s["neg_view"]
        assert s["premul"][0] == [2.0 * total] * 4 and s["premul"][1] != [True], s["premul"]



def test_a_completed_work_is_reused_only_while_nothing_holds_it():
    """DoneWorks hands the last Work out again once its caller dropped it (dist.all_reduce does), never while a
    reference or a weak reference holds it, and a reused Work tells its new call's outputs, future included."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    from gpucoll.torch.work import DoneWorks

    works = DoneWorks()
    outs = [[torch.full((1,), float(i))] for i in range(5)]
    first = works.get(outs[0])
    assert first.get_future().value() == outs[0]
    held = first
    second = works.get(outs[1])
    assert second is not held and held.result() == outs[0] and second.result() == outs[1]
    assert held.get_future().value() == outs[0]
    del first, held
    gc.collect()
    seen = id(second)
    assert second.get_future().value() == outs[1]
    del second
    third = works.get(outs[2])  # nothing holds the last one: it is the same object, with the new call's outputs
    assert id(third) == seen and third.result() == outs[2] and third.get_future().value() == outs[2]
    assert third.wait() and third.is_completed() and third.exception() is None
    weak = weakref.ref(third)
    del third
    fourth = works.get(outs[3])  # a weak reference holds it: a new Work (the old one then dies, or still tells outs[2])
    old = weak()
    assert fourth.result() == outs[3] and (old is None or (old is not fourth and old.result() == outs[2]))
