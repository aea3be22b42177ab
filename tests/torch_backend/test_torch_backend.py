"""The torch.distributed backend "gpucoll" (gpucoll/torch), on CPU tensors, checked exactly against gloo.

Every rank runs with a gloo default group and, in the same processes, a ``new_group(backend="gpucoll")`` over the
same ranks: each torch functional operation runs once on each group with the same integer-valued inputs, and the
results must be equal element for element (what gloo cannot do, AVG on integers, PREMUL_SUM, int16 broadcast, is
checked against the value torch's semantics give). World sizes 2, 3 and 4, one spawn each, all cases in a loop
inside; the workers return their failures as text. Also here: subsets through new_group, async ops (wait,
is_completed, get_future), point-to-point patterns, typed errors for bad input (and the group still works after
each), ``init_process_group("gpucoll")`` as the default group, and a script run by ``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import helpers
import pytest
import torch_ranks

torch = helpers.require("torch")
dist = helpers.require("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZES = (2, 3, 4)
RED_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
GLOO_OPS = ("SUM", "PRODUCT", "MIN", "MAX")


# -- inputs --------------------------------------------------------------------------------------------------------

def _values(shape, dtype, op, rank, seed, k=0):
    """Integer-valued input `k` (its place among the tensors of one call) of `rank`: sums, products, minima and maxima
    are exact in every dtype at 4 ranks. Each (seed, k, rank) has its own stream, so the tensors of one call differ
    (identical tensors, or prefixes of one stream, hide a packing offset that does not advance)."""
    import torch

    g = torch.Generator().manual_seed((seed * 64 + k) * 1009 + rank)
    dt = getattr(torch, dtype)
    if op == "PRODUCT":
        v = torch.tensor([1, 2, -1, -2] if dtype != "uint8" else [1, 2, 1, 2])
        x = v[torch.randint(0, 4, shape, generator=g)]
    else:
        lo = 0 if dtype == "uint8" else -8
        x = torch.randint(lo, 9, shape, generator=g)
    return x.to(dt)


def _ops_worker(rank, n):
    import torch
    import torch.distributed as dist

    from gpucoll.errors import InvalidArgument, Unsupported

    R = dist.ReduceOp
    gl = dist.group.WORLD
    gc = dist.new_group(backend="gpucoll")
    failures = []
    seed = [0]
    calls = [0]  # inp() calls so far in this run of a check's function: the k of the next tensor

    def run(fn, *args):
        calls[0] = 0
        return fn(*args)

    def check(name, fn, ref_group=None, expected=None):
        """fn(group) -> list of tensors; compared between gloo and gpucoll (or with `expected`)."""
        seed[0] += 1
        try:
            got = [t.clone() for t in run(fn, gc)]
            want = run(expected) if expected is not None else [t.clone() for t in run(fn, ref_group or gl)]
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name}: {type(e).__name__}: {e}")
            return
        if len(got) != len(want):
            failures.append(f"{name}: {len(got)} outputs, expected {len(want)}")
            return
        for i, (a, b) in enumerate(zip(got, want)):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                failures.append(f"{name}: output {i} differs:\n   gpucoll {a.flatten()[:8].tolist()}\n   "
                                f"expected {b.flatten()[:8].tolist()}")
                return

    def inp(shape, dtype="float32", op="SUM", r=None, k=None):
        """The next tensor of this call (k counts them; an expected value names the k it stands for)."""
        if k is None:
            k, calls[0] = calls[0], calls[0] + 1
        return _values(shape, dtype, op, rank if r is None else r, seed[0], k)

    # all_reduce: every dtype x every op gloo has, sync and async (the same Work path torch's DDP uses)
    for dtype in RED_DTYPES:
        for op in GLOO_OPS:
            for async_op in (False, True):
                def f(g, dtype=dtype, op=op, async_op=async_op):
                    x = inp((5, 7), dtype, op)
                    w = dist.all_reduce(x, op=getattr(R, op), group=g, async_op=async_op)
                    if async_op:
                        w.wait()
                    return [x]
                check(f"all_reduce {dtype} {op} async={async_op}", f)

    # AVG: floats on inputs n * y, whose products with NCCL's 1/n round to y exactly (n = 2, 3, 4 here), so that
    # gpucoll's pre-multiplied sum (NCCL's avg) is exactly the mean; integers against NCCL's rule (the sum divided
    # with truncation)
    for dtype in ("float32", "float64", "int32", "int64", "int8"):
        def f(g, dtype=dtype):
            x = inp((33,), dtype)
            if x.is_floating_point():
                x *= n
            dist.all_reduce(x, op=R.AVG, group=g)
            return [x]

        def avg_ref(dtype=dtype):
            total = sum(inp((33,), dtype, r=r, k=0).to(torch.int64 if dtype.startswith("int") else torch.float64)
                        for r in range(n))
            if dtype.startswith("int"):
                return [torch.div(total, n, rounding_mode="trunc").to(getattr(torch, dtype))]
            return [total.to(getattr(torch, dtype))]  # the mean of the n * y inputs: exact
        check(f"all_reduce {dtype} AVG", f, expected=avg_ref)

    # PREMUL_SUM (gloo has none): sum over ranks of factor * x
    for factor in (0.5, torch.tensor([0.25])):
        def f(g, factor=factor):
            x = inp((16,), "float32")
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor), group=g)
            return [x]
        fv = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
        check(f"all_reduce PREMUL_SUM({fv})", f,
              expected=lambda fv=fv: [sum(inp((16,), r=r, k=0) * fv for r in range(n))])

    # coalesced, list of tensors, complex, strided, empty, 0-d
    def f(g):
        ts = [inp((3, 4), "int64"), inp((5,), "int64"), inp((1,), "int64")]
        dist.all_reduce_coalesced(ts, group=g)
        return ts
    check("all_reduce_coalesced", f)

    def f(g):
        ts = [inp((6,), "int32"), inp((6,), "int32")]
        opts = dist.AllreduceOptions()
        opts.reduceOp = R.SUM
        g.allreduce(ts, opts).wait()
        return ts
    check("allreduce of a list of tensors", f)

    def f(g):
        x = torch.complex(inp((4,)), inp((4,)) + 1)
        dist.all_reduce(x, group=g)
        return [x]
    check("all_reduce complex64 SUM", f)

    def f(g):
        base = inp((6, 4), "int64")
        x = base.t()  # not contiguous
        dist.all_reduce(x, op=R.MAX, group=g)
        return [x, base]
    check("all_reduce strided", f)

    for shape in ((0,), ()):
        def f(g, shape=shape):
            x = inp(shape, "float64")
            dist.all_reduce(x, group=g)
            return [x]
        check(f"all_reduce shape {shape}", f)

    # broadcast / reduce for every root
    for root in range(n):
        def f(g, root=root):
            x = inp((9, 2), "float64")
            dist.broadcast(x, root, group=g)
            return [x]
        check(f"broadcast root={root}", f)

        def f(g, root=root):
            x = inp((11,), "int32")
            dist.reduce(x, root, op=R.SUM, group=g)
            return [x] if rank == root else []
        check(f"reduce root={root}", f)

    def f(g):
        x = inp((3,), "int32").to(torch.int16)  # no gloo reduction, but a broadcast is a copy: moved as bytes
        dist.broadcast(x, 0, group=g)
        return [x]
    check("broadcast int16", f, expected=lambda: [_values((3,), "int32", "SUM", 0, seed[0], 0).to(torch.int16)])

    # all_gather (list and into a tensor), including dtypes gpucoll only moves (bool, complex)
    for dtype in ("float32", "int8", "bfloat16"):
        def f(g, dtype=dtype):
            outs = [torch.zeros(2, 3, dtype=getattr(torch, dtype)) for _ in range(n)]
            dist.all_gather(outs, inp((2, 3), dtype), group=g)
            return outs
        check(f"all_gather {dtype}", f)

    def f(g):
        outs = [torch.zeros(5, dtype=torch.bool) for _ in range(n)]
        dist.all_gather(outs, inp((5,), "int32") > 0, group=g)
        return outs
    check("all_gather bool", f)

    def f(g):
        out = torch.zeros(n * 4, dtype=torch.complex64)
        dist.all_gather_into_tensor(out, torch.complex(inp((4,)), inp((4,))), group=g)
        return [out]
    check("all_gather_into_tensor complex64", f)

    def f(g):
        out = torch.zeros(n * 3, 2, dtype=torch.int64)
        dist.all_gather_into_tensor(out, inp((3, 2), "int64"), group=g)
        return [out]
    check("all_gather_into_tensor", f)

    # reduce_scatter (list and tensor)
    for op in GLOO_OPS:
        def f(g, op=op):
            y = torch.zeros(4, dtype=torch.int32)
            dist.reduce_scatter(y, [inp((4,), "int32", op) + r for r in range(n)], op=getattr(R, op), group=g)
            return [y]
        check(f"reduce_scatter {op}", f)

        def f(g, op=op):
            y = torch.zeros(3, 2)
            dist.reduce_scatter_tensor(y, inp((n * 3, 2), "float32", op), op=getattr(R, op), group=g)
            return [y]
        check(f"reduce_scatter_tensor {op}", f)

    # all_to_all: equal splits, uneven splits, lists of different sizes
    def f(g):
        out = torch.zeros(n * 2, 3, dtype=torch.int64)
        dist.all_to_all_single(out, inp((n * 2, 3), "int64"), group=g)
        return [out]
    check("all_to_all_single", f)

    # rank i sends (i + j) % 3 + 1 rows to rank j
    in_splits = [(rank + j) % 3 + 1 for j in range(n)]
    out_splits = [(j + rank) % 3 + 1 for j in range(n)]

    def f(g):
        out = torch.zeros(sum(out_splits), 2)
        dist.all_to_all_single(out, inp((sum(in_splits), 2)), out_splits, in_splits, group=g)
        return [out]
    check("all_to_all_single uneven splits", f)

    def f(g):
        outs = [torch.zeros(3, dtype=torch.int32) for j in range(n)]
        ins = [inp((3,), "int32") + j for j in range(n)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    # against the values themselves: gloo in torch 2.11 has no list all_to_all
    check("all_to_all lists", f,
          expected=lambda: [_values((3,), "int32", "SUM", j, seed[0], rank) + rank for j in range(n)])

    def f(g):  # tensors of different sizes (gloo refuses them): rank i sends i + j + 1 elements to rank j
        outs = [torch.zeros(j + rank + 1, dtype=torch.int32) for j in range(n)]
        ins = [inp((rank + j + 1,), "int32") for j in range(n)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    check("all_to_all lists of different sizes", f,
          expected=lambda: [_values((j + rank + 1,), "int32", "SUM", j, seed[0], rank) for j in range(n)])

    # the method names torch <= 2.12 calls (torch 2.11 is on the GPU machines), against gloo through dist.*
    def f(g):
        x = inp((3,), "int64")
        ag, rs, a2a = torch.zeros(n * 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(n * 2)
        ag2, rs2 = torch.zeros(n * 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
        xin, ain = inp((n * 3,), "int64"), inp((n * 2,))
        if g is gc:
            g._allgather_base(ag, x, dist.distributed_c10d.AllgatherOptions()).wait()
            g._reduce_scatter_base(rs, xin, _opts(dist.ReduceScatterOptions, R.SUM)).wait()
            g.alltoall_base(a2a, ain, [], [], dist.AllToAllOptions()).wait()
            g.allgather_into_tensor_coalesced([ag2], [x], dist.distributed_c10d.AllgatherOptions()).wait()
            g.reduce_scatter_tensor_coalesced([rs2], [xin], _opts(dist.ReduceScatterOptions, R.SUM)).wait()
        else:
            dist.all_gather_into_tensor(ag, x, group=g)
            dist.reduce_scatter_tensor(rs, xin, group=g)
            dist.all_to_all_single(a2a, ain, group=g)
            dist.all_gather_into_tensor(ag2, x, group=g)
            dist.reduce_scatter_tensor(rs2, xin, group=g)
        return [ag, rs, a2a, ag2, rs2]
    check("torch <= 2.12 method names", f)

    # gather / scatter for every root
    for root in range(n):
        def f(g, root=root):
            outs = [torch.zeros(3, dtype=torch.float16) for _ in range(n)] if rank == root else None
            dist.gather(inp((3,), "float16"), outs, dst=root, group=g)
            return outs or []
        check(f"gather root={root}", f)

        def f(g, root=root):
            y = torch.zeros(2, 2, dtype=torch.int64)
            ins = [inp((2, 2), "int64") + 10 * j for j in range(n)] if rank == root else None
            dist.scatter(y, ins, src=root, group=g)
            return [y]
        check(f"scatter root={root}", f)

    # point to point: a ring with isend + blocking recv, a batch, and send/recv pairs in both orders
    def f(g):
        r = torch.zeros(4)
        req = dist.isend(inp((4,)), (rank + 1) % n, group=g)
        dist.recv(r, (rank - 1) % n, group=g)
        req.wait()
        return [r]
    check("isend + recv ring", f)

    def f(g):
        r1, r2 = torch.zeros(3, dtype=torch.int64), torch.zeros(1000, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, inp((3,), "int64"), (rank + 1) % n, g),
               dist.P2POp(dist.irecv, r1, (rank - 1) % n, g),
               dist.P2POp(dist.irecv, r2, (rank + 1) % n, g),
               dist.P2POp(dist.isend, inp((1000,), "int64"), (rank - 1) % n, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [r1, r2]
    check("batch_isend_irecv", f)

    def f(g):
        x = torch.zeros(300000)  # more than the host backend's p2p slots hold: needs the peer
        if rank == 0:
            dist.send(inp((300000,)), 1, group=g)
        elif rank == 1:
            dist.recv(x, 0, group=g)
        return [x]
    check("send/recv large", f)

    # tags (torch's rule, gloo's behaviour): a recv takes the earliest message with its tag; others wait for theirs
    def f(g):
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        reqs = [dist.isend(inp((3,), "int64"), nxt, group=g, tag=7), dist.isend(inp((5,), "int64"), nxt, group=g,
                                                                                  tag=9),
                dist.isend(inp((2,), "int64"), nxt, group=g, tag=7)]
        a, b, c = torch.zeros(5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        dist.recv(a, prv, group=g, tag=9)  # the second message first
        dist.recv(b, prv, group=g, tag=7)
        dist.recv(c, prv, group=g, tag=7)
        for req in reqs:
            req.wait()
        return [a, b, c]
    check("send/recv with tags, out of order", f)

    # recv from any source: rank 0 hears every other rank (tagged and not) and learns who sent each message
    def f(g):
        if rank == 0:
            got = []
            for _ in range(2 * (n - 1)):
                x = torch.zeros(4, dtype=torch.int64)
                got.append((dist.recv(x, group=g), x))
            y = torch.zeros(4, dtype=torch.int64)
            w = dist.irecv(y, group=g, tag=5)
            w.wait()
            got.sort(key=lambda p: (p[0], p[1].tolist()))
            return [torch.tensor([p[0] for p in got] + [w._source_rank()]), *(p[1] for p in got), y]
        x = torch.full((4,), rank, dtype=torch.int64)
        # posted first, taken last: only the tag-5 recv matches it (an isend: gloo's send waits for its recv)
        req = dist.isend(x * 100, 0, group=g, tag=5) if rank == n - 1 else None
        dist.send(x, 0, group=g)
        dist.send(x * 10, 0, group=g)
        if req is not None:
            req.wait()
        return []
    check("recv from any source", f)

    # async: every kind of Work answers wait, is_completed and get_future
    def f(g):
        ours = g is gc  # gloo's Works differ (a send has no future there): only gpucoll's are inspected
        x = inp((8,), "int64")
        w = dist.all_reduce(x, group=g, async_op=True)
        vals = w.get_future().wait()
        assert isinstance(vals, list) and torch.equal(vals[0], x) and (vals[0] is x or not ours), vals
        assert w.wait() and (w.is_completed() or not ours), "all_reduce Work"
        out = torch.zeros(n * 8, dtype=torch.int64)
        dist.all_gather_into_tensor(out, x, group=g, async_op=True).wait()
        r = torch.zeros(8, dtype=torch.int64)
        req = dist.isend(x, (rank + 1) % n, group=g)
        req2 = dist.irecv(r, (rank - 1) % n, group=g)
        if ours:
            assert req2.is_completed(), "irecv Work: is_completed() runs the queued pair"
            assert req.get_future().wait()[0] is x, "isend future"
        else:
            req.wait()
            req2.wait()
        return [x, out, r]
    check("async works", f)

    def f(g):
        dist.barrier(group=g)
        return []
    check("barrier", f)

    # subsets: every rank but 0, and the even ranks; compared with gloo groups of the same ranks
    subsets = [list(range(1, n)), list(range(0, n, 2))]
    for ranks in subsets:
        sub_gc = dist.new_group(ranks, backend="gpucoll")
        sub_gl = dist.new_group(ranks, backend="gloo")
        if rank not in ranks:
            continue
        if len(ranks) < 2:
            continue
        me = ranks.index(rank)

        def f(g, ranks=ranks, sub_gc=sub_gc, sub_gl=sub_gl):
            g = sub_gc if g is gc else sub_gl
            x = inp((10,), "int64")
            dist.all_reduce(x, group=g)
            outs = [torch.zeros(10, dtype=torch.int64) for _ in ranks]
            dist.all_gather(outs, x + rank, group=g)
            b = inp((3,), "float32")
            dist.broadcast(b, ranks[-1], group=g)  # a global rank
            return [x, *outs, b]
        check(f"subset {ranks} (group rank {me})", f)

    # the group stays usable after a failed call: each bad input raises gpucoll's typed error on every rank
    bad = [
        ("bool all_reduce", Unsupported, lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), group=gc)),
        ("int16 all_reduce", Unsupported, lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16), group=gc)),
        ("BAND", Unsupported, lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BAND, group=gc)),
        ("BXOR", Unsupported, lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BXOR, group=gc)),
        ("complex MAX (through the group)", Unsupported,
         lambda: gc.allreduce([torch.ones(3, dtype=torch.complex64)], _opts(dist.AllreduceOptions, R.MAX))),
        ("PREMUL_SUM on ints", Unsupported,
         lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0), group=gc)),
        ("all_gather_into_tensor sizes", InvalidArgument,
         lambda: dist.all_gather_into_tensor(torch.zeros(n * 3 + 1), torch.ones(3), group=gc)),
        ("reduce_scatter_tensor sizes", InvalidArgument,
         lambda: dist.reduce_scatter_tensor(torch.zeros(3), torch.ones(n * 3 - 1), group=gc)),
        ("all_gather list sizes", InvalidArgument,
         lambda: dist.all_gather([torch.zeros(4) for _ in range(n)], torch.ones(3), group=gc)),
        ("reduce_scatter list sizes", InvalidArgument,
         lambda: dist.reduce_scatter(torch.zeros(3), [torch.ones(2) for _ in range(n)], group=gc)),
        ("all_to_all_single splits", InvalidArgument,
         lambda: dist.all_to_all_single(torch.zeros(n), torch.ones(n), [1] * n, [2] * n, group=gc)),
        ("all_to_all_single rows", InvalidArgument,
         lambda: dist.all_to_all_single(torch.zeros(n * 2 + 1), torch.ones(n * 2 + 1), group=gc)),
        ("recv size", InvalidArgument, lambda: _ring_with_short_recv(dist, torch, rank, n, gc)),
    ]
    for name, exc, call in bad:
        try:
            call()
            failures.append(f"bad input {name}: no error")
        except exc:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"bad input {name}: {type(e).__name__} instead of {exc.__name__}: {e}")
        x = torch.ones(4, dtype=torch.int64)
        dist.all_reduce(x, group=gc)
        if not torch.equal(x, torch.full((4,), n, dtype=torch.int64)):
            failures.append(f"after bad input {name}: all_reduce gave {x.tolist()}")
    return failures


def _ring_with_short_recv(dist, torch, rank, n, group):
    """Each rank sends 4 elements to the next and receives into 3: the receiver raises; the channel stays in step."""
    req = dist.isend(torch.ones(4), (rank + 1) % n, group=group)
    try:
        dist.recv(torch.zeros(3), (rank - 1) % n, group=group)
    finally:
        req.wait()


def _opts(cls, op):
    o = cls()
    o.reduceOp = op
    return o


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def ops_report(request):
    return torch_ranks.run(_ops_worker, request.param)


def test_ops_match_gloo(ops_report):
    failures = helpers.merge_rank_failures([{"f": f} for f in ops_report], "f")
    assert not failures, helpers.format_failures(failures)


def _disagree_worker(rank, n):
    import torch
    import torch.distributed as dist

    from gpucoll.errors import GpucollError

    gc = dist.new_group(backend="gpucoll")
    seen = []
    for name, call in [
        ("size", lambda: dist.all_reduce(torch.ones(4 + rank), group=gc)),
        ("dtype", lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank else torch.float64), group=gc)),
        ("op", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM,
                                       group=gc)),
        ("gather size", lambda: dist.all_gather_into_tensor(torch.zeros(n * (2 + rank)), torch.ones(2 + rank),
                                                            group=gc)),
    ]:
        try:
            call()
            seen.append((name, "no error"))
        except GpucollError as e:
            seen.append((name, type(e).__name__))
    x = torch.ones(3)
    dist.all_reduce(x, group=gc)
    seen.append(("after", x.tolist()))
    return seen


def test_ranks_that_disagree_get_a_typed_error():
    """Sizes, dtypes or ops that differ between ranks are invisible to any one rank; the host backend compares
    every call across ranks (always) and raises InvalidArgument on every rank instead of a wrong answer."""
    n = 2
    res = torch_ranks.run(_disagree_worker, n)
    for seen in res:
        assert seen[:-1] == [(k, "InvalidArgument") for k in ("size", "dtype", "op", "gather size")], seen
        assert seen[-1] == ("after", [float(n)] * 3), seen


# -- gpucoll as the default group; "cpu:gloo,cuda:gpucoll" --------------------------------------------------------

def _default_worker(rank, n, backend):
    import torch
    import torch.distributed as dist

    import gpucoll.torch

    dist.init_process_group(backend)
    pg = dist.distributed_c10d._get_default_group()
    out = {"type": type(pg).__name__, "name": pg.name(), "backend": str(dist.get_backend())}
    x = torch.arange(4, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(x)
    out["all_reduce"] = x.tolist()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})  # pickles through all_gather on CPU tensors
    out["objects"] = objs
    dist.barrier()
    sub = dist.new_group([n - 1, 0], backend="gpucoll") if n > 1 else None
    if rank in (0, n - 1):
        y = torch.ones(2) * rank
        dist.all_reduce(y, group=sub)
        out["sub"] = y.tolist()
    assert isinstance(pg, gpucoll.torch.ProcessGroupGpucoll), type(pg)
    out["cpu_backend"] = type(pg._cpu_backend).__name__ if pg._cpu_backend is not None else ""
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("backend", ["gpucoll", "cpu:gloo,cuda:gpucoll", "cuda:gpucoll,cpu:gloo"])
def test_default_group(backend):
    n = 3
    res = torch_ranks.run(_default_worker, n, backend, backend=None)
    want = [sum(r + 1 for r in range(n)) * i for i in range(4)]
    for rank, out in enumerate(res):
        assert out["type"] == "ProcessGroupGpucoll" and out["name"] == "gpucoll", out
        assert out["all_reduce"] == want, out
        assert out["objects"] == [{"rank": r} for r in range(n)], out
        if rank in (0, n - 1):
            assert out["sub"] == [float(n - 1)] * 2, out
        # CPU tensors go where the user said: gloo when named for "cpu", else gpucoll's host backend
        assert out["cpu_backend"] == ("" if backend == "gpucoll" else "ProcessGroupGloo"), out


def test_init_from_store():
    """The communicator the backend builds: from a torch Store, rank and size (one rank here, in this process)."""
    import numpy as np

    from gpucoll._make import init_from_store
    from gpucoll.errors import InvalidArgument

    store = dist.HashStore()
    with init_from_store(store, 0, 1, backend="host", timeout=10.0) as comm:
        x = np.arange(5, dtype=np.int64)
        comm.all_reduce(x)
        assert x.tolist() == list(range(5)) and comm.rank == 0 and comm.world_size == 1
    with init_from_store(dist.PrefixStore("again/", store), 0, 1, backend="host", timeout=10.0) as comm:
        comm.barrier()
    for rank, world_size in [(1, 1), (-1, 2), (True, 2)]:
        with pytest.raises(InvalidArgument):
            init_from_store(store, rank, world_size, backend="host")
    with pytest.raises(InvalidArgument, match="timeout"):
        init_from_store(store, 0, 1, backend="host", timeout=0)


def test_import_gpucoll_does_not_import_torch():
    code = "import sys, gpucoll; gpucoll.errors; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_old_torch_refused():
    import gpucoll.torch

    assert gpucoll.torch._torch_version("2.3.1+cu121") < gpucoll.torch.MIN_TORCH
    assert gpucoll.torch._torch_version("2.11.0a0+git1234") >= gpucoll.torch.MIN_TORCH
    code = textwrap.dedent("""
        import torch
        torch.__version__ = "2.3.1"
        try:
            import gpucoll.torch
        except ImportError as e:
            assert "needs torch >= 2.4" in str(e), e
        else:
            raise SystemExit("imported")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_premul_factor_without_the_factor_property():
    """torch 2.11 (the GPU machines') has no ReduceOp.factor: the factor comes from the op's pickled state."""
    from gpucoll.torch._convert import premul_factor

    class Torch211Op:  # what 2.11's ReduceOp offers: op and __getstate__ (op, factor)
        def __init__(self, op):
            self.op, self._state = op.op, op.__getstate__()

        def __getstate__(self):
            return self._state

    for factor, want in ((0.5, 0.5), (torch.tensor([0.25]), 0.25)):
        op = dist._make_nccl_premul_sum(factor)
        assert premul_factor(op) == want and premul_factor(Torch211Op(op)) == want


def test_group_answers_torchs_backend_lookup():
    """init_process_group(device_id=cuda:i) reads pg._get_backend(device_id).supports_splitting and new_group and
    split_group look for a split source: the gpucoll group answers for cpu and cuda itself and splits into a new
    gpucoll group (torch's split_group needs a CUDA device bound to the default group, so it is called directly
    here, as torch calls it)."""
    from torch.distributed.distributed_c10d import _get_split_source

    from gpucoll.errors import InvalidArgument
    from gpucoll.torch.process_group import ProcessGroupGpucoll

    pg = ProcessGroupGpucoll(dist.HashStore(), 0, 1, timeout=10.0)
    try:
        for device in (torch.device("cuda", 0), torch.device("cuda"), torch.device("cpu"), "cuda:1"):
            assert pg._get_backend(device) is pg
        assert pg._get_backend(torch.device("cuda", 0)).supports_splitting is True
        child = pg.split_group([0], timeout=None, opts=None, group_name="child-0", group_desc="split")
        assert isinstance(child, ProcessGroupGpucoll) and child.group_name == "child-0" and child.size() == 1
        assert child.group_desc == "split"
        x = torch.arange(3)
        child.allreduce([x]).wait()
        assert x.tolist() == [0, 1, 2]
        child.shutdown()
        with pytest.raises(InvalidArgument, match="split_group"):
            pg.split_group([0, 3], group_name="bad")
        # what inductor's comm estimate, FSDP2's allocator and _time_estimator read off the answer
        backend = pg._get_backend(torch.device("cuda"))
        assert backend.supports_time_estimate is False and backend.supports_tensor_alloc(torch.device("cuda")) is False
        estimate = dist.distributed_c10d._time_estimator(group=pg, device=torch.device("cuda"))
        with pytest.raises(NotImplementedError, match="time estimator is not supported"), estimate:
            pass
        with pytest.raises(RuntimeError, match="No backend type associated with device type meta"):
            pg._get_backend(torch.device("meta"))
        pg.bound_device_id = torch.device("cuda", 0)
        assert _get_split_source(pg) is pg
    finally:
        pg.shutdown()


# -- torchrun --------------------------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import gpucoll.torch
dist.init_process_group(sys.argv[1])
rank, n = dist.get_rank(), dist.get_world_size()
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((1000,), float(n * (n + 1) // 2))), x[:4]
out = torch.zeros(2 * n, dtype=torch.int64)
dist.all_gather_into_tensor(out, torch.tensor([rank, rank * 10]))
assert out.tolist() == [v for r in range(n) for v in (r, r * 10)], out
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
dist.barrier()
print(f"OK rank {rank} of {n} backend {dist.get_backend()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["gpucoll", "cpu:gloo,cuda:gpucoll"])
def test_torchrun_end_to_end(tmp_path, backend):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: the agent binds a free port itself. A port picked here and bound later by torchrun (the old
    # --master-port free_port()) can be taken in between by anything else on the machine.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           backend]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK rank 0 of 2" in proc.stdout and "OK rank 1 of 2" in proc.stdout, proc.stdout
