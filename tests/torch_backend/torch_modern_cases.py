"""The cases of tests/torch_backend/test_torch_modern.py: what a 2025-2026 torch.distributed job does, run on ranks
whose default group is `backend`, each returning plain values (tensors, floats) that the test compares with the same
case run on gloo.

Every case builds its inputs from its own seeds and the rank, so the same case gives the same inputs whatever the
backend. Integer-valued inputs where the arithmetic allows it (the collectives, DTensor redistribution), so results
compare bit for bit; training runs return their losses and final parameters.

``run_cases(rank, n, backend, names, device, workdir)`` is the spawned ranks' entry point (tests/support/torch_ranks.py calls
it after ``init_process_group(backend)``); it returns {case: result or "ERROR: traceback"} and, for gpucoll default
groups, how many calls reached gpucoll's process groups in each case.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import traceback

STEPS = 20


# -- counting what reaches gpucoll --------------------------------------------------------------------------------

_COUNTS = collections.Counter()
_COUNTED = ("allreduce", "allreduce_coalesced", "allgather", "all_gather_single", "_allgather_base",
            "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
            "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
            "all_to_all_single", "alltoall_base", "alltoall", "broadcast", "reduce", "gather", "scatter", "send",
            "recv", "recv_anysource", "barrier", "allgather_coalesced")


def _count_gpucoll_calls() -> None:
    """Wraps the methods of gpucoll's ProcessGroup (torch calls them from Python and through its C++ trampoline)."""
    from gpucoll.torch.process_group import ProcessGroupGpucoll as PG

    if getattr(PG, "_counting", False):
        return
    PG._counting = True
    depth = threading.local()  # only calls from outside count (a coalesced method calls the single one per tensor)
    for name in _COUNTED:
        fn = getattr(PG, name)

        def wrapper(self, *args, _fn=fn, _name=name, **kwargs):
            level = getattr(depth, "n", 0)
            if level == 0:
                _COUNTS[_name] += 1
            depth.n = level + 1
            try:
                return _fn(self, *args, **kwargs)
            finally:
                depth.n = level

        setattr(PG, name, functools.wraps(fn)(wrapper))


# -- models --------------------------------------------------------------------------------------------------------

def _mlp(torch, seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 4))


class _FeedForward:
    """A TP-style MLP block: in_proj (colwise) -> relu -> out_proj (rowwise)."""

    @staticmethod
    def make(torch, seed=0):
        class FF(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.in_proj = torch.nn.Linear(8, 32)
                self.out_proj = torch.nn.Linear(32, 8)

            def forward(self, x):
                return self.out_proj(torch.relu(self.in_proj(x)))

        torch.manual_seed(seed)
        return torch.nn.Sequential(FF(), FF())


def _batch(torch, rank, step, rows=8, cols=8, out=4, same=False):
    g = torch.Generator().manual_seed(1000 * step + (0 if same else rank))
    return torch.randn(rows, cols, generator=g), torch.randn(rows, out, generator=g)


def _ints(torch, shape, seed, rank, dtype=None):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype or torch.float32)


def _full(t):
    """A DTensor's (or a tensor's) full value, detached, on CPU."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().clone().cpu()


# -- cases -----------------------------------------------------------------------------------------------------------

def case_functional(ctx):
    """torch.distributed._functional_collectives, eager, on the default group and on a DeviceMesh."""
    torch, fc, n, rank = ctx.torch, ctx.fc, ctx.n, ctx.rank
    g = ctx.dist.group.WORLD
    x = _ints(torch, (n * 2, 3), 1, rank)
    ins = [(rank + j) % 3 + 1 for j in range(n)]
    outs = [(j + rank) % 3 + 1 for j in range(n)]
    out = {
        "all_reduce": fc.all_reduce(x, "sum", g),
        "all_reduce_max": fc.all_reduce(x, "max", g),
        "all_reduce_avg": fc.all_reduce(x * n, "avg", g),
        "all_gather_tensor": fc.all_gather_tensor(x, 0, g),
        "all_gather_tensor_dim1": fc.all_gather_tensor(x, 1, g),
        "reduce_scatter_tensor": fc.reduce_scatter_tensor(x, "sum", 0, g),
        "all_to_all_single": fc.all_to_all_single(x, None, None, g),
        "all_to_all_single_uneven": fc.all_to_all_single(_ints(torch, (sum(ins), 2), 2, rank), outs, ins, g),
        "broadcast": fc.broadcast(x, n - 1, g),
        "all_reduce_coalesced": fc.all_reduce_coalesced([x, x[:1] * 3], "sum", g),
        "all_gather_into_tensor_coalesced": fc.all_gather_into_tensor_coalesced([x, x[1:] + 5], g),
        "reduce_scatter_tensor_coalesced": fc.reduce_scatter_tensor_coalesced([x, x + 1], "sum", [0, 0], g),
        "mesh_all_reduce": fc.all_reduce(x, "sum", ctx.mesh1d),
    }
    y = torch.ops._c10d_functional.all_reduce(x, "sum", g.group_name)
    out["ops_all_reduce_wait_tensor"] = torch.ops._c10d_functional.wait_tensor(y)
    return {k: [fc.wait_tensor(t) if isinstance(t, torch.Tensor) else t for t in (v if isinstance(v, list) else [v])]
            for k, v in out.items()}


def case_compiled(ctx):
    """A function with functional collectives under torch.compile (inductor, fullgraph: no graph break, so the
    collectives are in the compiled graph); returns its results and how many calls reached gpucoll meanwhile."""
    torch, fc, rank = ctx.torch, ctx.fc, ctx.rank
    g = ctx.dist.group.WORLD

    def step(x):
        y = fc.all_reduce(x * 2 + 1, "sum", g)
        z = fc.all_gather_tensor(y - 1, 0, g)
        return fc.reduce_scatter_tensor(z, "sum", 0, g) + 3

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    x = _ints(torch, (4, 3), 3, rank)
    compiled(x)  # compiles
    before = sum(_COUNTS.values())
    got = [compiled(x), compiled(x + 1)]
    calls = sum(_COUNTS.values()) - before
    return {"values": got, "eager": [step(x), step(x + 1)], "gpucoll_calls": calls}


def case_mesh(ctx):
    """init_device_mesh 1-D and (on 4 ranks) 2-D with named dims; the groups torch made, and a collective on each."""
    torch, dist, rank = ctx.torch, ctx.dist, ctx.rank
    res = {"dim0_size": [ctx.mesh1d.get_group(0).size()]}
    x = _ints(torch, (5,), 4, rank)
    y = x.clone()
    dist.all_reduce(y, group=ctx.mesh1d.get_group(0))
    res["1d"] = [y]
    res["backend"] = [type(ctx.mesh1d.get_group(0)).__name__]
    if ctx.mesh2d is not None:
        m = ctx.mesh2d
        for dim in ("dp", "tp"):
            pg = m.get_group(dim)
            z = x.clone()
            dist.all_reduce(z, group=pg)
            res[dim] = [z, ctx.fc.all_reduce(x, "sum", (m, m.mesh_dim_names.index(dim))).wait()]
            res[f"{dim}_ranks"] = [dist.get_process_group_ranks(pg)]
    return res


def case_dtensor(ctx):
    """distribute_tensor, redistribution between Shard, Replicate and Partial (integer values: exact)."""
    torch, rank = ctx.torch, ctx.rank
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = ctx.mesh1d
    full = _ints(torch, (ctx.n * 3, 4), 5, 0)  # the same on every rank
    d = distribute_tensor(full, mesh, [Shard(0)])
    res = {"local": [d.to_local().clone()], "replicate": [d.redistribute(mesh, [Replicate()]).to_local()],
           "shard1": [d.redistribute(mesh, [Shard(1)]).to_local()]}
    from torch.distributed.tensor import DTensor

    part = DTensor.from_local(_ints(torch, (3, 4), 6, rank), mesh, [Partial()])
    res["partial_to_replicate"] = [part.redistribute(mesh, [Replicate()]).to_local()]
    res["partial_to_shard"] = [part.redistribute(mesh, [Shard(0)]).to_local()]
    res["matmul"] = [_full(d @ distribute_tensor(full.t().contiguous(), mesh, [Replicate()]))]
    return res


def _train(torch, model, steps, rank, lr=0.05, same_batch=False, dtype=None, rows=8, cols=8, out=4):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(torch, rank, step % 2, rows, cols, out, same=same_batch)  # two batches per rank, again and again
        if dtype is not None:
            x = x.to(dtype)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().float().item())
    return losses


def case_fsdp2(ctx):
    """FSDP2 training (20 steps): per-layer and root fully_shard, reshard_after_forward both ways, and mixed precision
    (bfloat16 parameters, float32 gradient reduction)."""
    torch = ctx.torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    res = {}
    for name, reshard, mp in (("reshard", True, None), ("no_reshard", False, None),
                              ("bf16", True, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))):
        model = _mlp(torch)
        kw = {"mesh": ctx.mesh1d, "reshard_after_forward": reshard}
        if mp is not None:
            kw["mp_policy"] = mp
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
        losses = _train(torch, model, STEPS, ctx.rank)
        res[name] = {"losses": losses, "params": [_full(p) for p in model.parameters()]}
    return res


def _tp_plan():
    """Megatron-style: each block's in_proj split by columns, out_proj by rows (one all-reduce per block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"{i}.{name}": style() for i in range(2)
            for name, style in (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))}


def case_tp(ctx):
    """Tensor parallel MLP (ColwiseParallel in, RowwiseParallel out), 20 steps on the same batch on every rank."""
    torch = ctx.torch
    from torch.distributed.tensor.parallel import parallelize_module

    model = _FeedForward.make(torch)
    parallelize_module(model, ctx.mesh1d, _tp_plan())
    losses = _train(torch, model, STEPS, ctx.rank, same_batch=True, out=8)
    return {"losses": losses, "params": [_full(p) for p in model.parameters()]}


def case_fsdp2_tp(ctx):
    """2-D: FSDP2 over "dp" and tensor parallel over "tp" on a (2, 2) mesh (4 ranks)."""
    torch = ctx.torch
    if ctx.mesh2d is None:
        return "needs 4 ranks"
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    m = ctx.mesh2d
    model = _FeedForward.make(torch)
    parallelize_module(model, m["tp"], _tp_plan())
    for block in model:
        fully_shard(block, mesh=m["dp"])
    fully_shard(model, mesh=m["dp"])
    dp_rank = m.get_local_rank("dp")
    losses = _train(torch, model, STEPS, dp_rank, out=8)
    return {"losses": losses, "params": [_full(p) for p in model.parameters()]}


def case_dcp(ctx):
    """torch.distributed.checkpoint: save an FSDP2 model's sharded state dict, load it into a fresh model."""
    torch = ctx.torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def make(seed):
        model = _mlp(torch, seed=seed)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=ctx.mesh1d)
        fully_shard(model, mesh=ctx.mesh1d)
        return model

    model = make(1)
    _train(torch, model, 3, ctx.rank)
    path = os.path.join(ctx.workdir, "dcp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    fresh = make(2)
    before = [_full(p) for p in fresh.parameters()]
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    saved = [_full(p) for p in model.parameters()]
    loaded = [_full(p) for p in fresh.parameters()]
    return {"saved": saved, "loaded": loaded, "changed": [not torch.equal(a, b) for a, b in zip(before, loaded)]}


def case_ddp(ctx):
    """Classic DDP: static_graph, find_unused_parameters, no_sync, and uneven inputs through join()."""
    torch = ctx.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = {}

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    for name, kw, make in (("static_graph", {"static_graph": True}, lambda: _mlp(torch)),
                           ("find_unused", {"find_unused_parameters": True}, lambda: (torch.manual_seed(0),
                                                                                      Branchy())[1])):
        model = DDP(make(), **kw)
        res[name] = {"losses": _train(torch, model, 6, ctx.rank), "params": [_full(p) for p in model.parameters()]}

    model = DDP(_mlp(torch))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        x, y = _batch(torch, ctx.rank, step)
        if step % 2 == 0:
            with model.no_sync():  # accumulate locally, sync on the next step
                torch.nn.functional.mse_loss(model(x), y).backward()
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    res["no_sync"] = {"params": [_full(p) for p in model.parameters()]}

    model = DDP(_mlp(torch))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join():
        for step in range(3 + ctx.rank):  # uneven inputs: rank r has 3 + r batches
            x, y = _batch(torch, ctx.rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    res["join"] = {"params": [_full(p) for p in model.parameters()]}
    return res


def case_p2p_and_objects(ctx):
    """batch_isend_irecv, uneven all_to_all_single, recv from any source, and the object collectives."""
    torch, dist, n, rank = ctx.torch, ctx.dist, ctx.n, ctx.rank
    res = {}
    a, b = torch.zeros(3, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, _ints(torch, (3,), 7, rank, torch.int64), (rank + 1) % n),
           dist.P2POp(dist.irecv, a, (rank - 1) % n),
           dist.P2POp(dist.isend, _ints(torch, (7,), 8, rank, torch.int64), (rank - 1) % n),
           dist.P2POp(dist.irecv, b, (rank + 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    res["batch_isend_irecv"] = [a, b]
    ins = [(rank + j) % 3 for j in range(n)]  # zero-row splits included
    outs = [(j + rank) % 3 for j in range(n)]
    out = torch.full((sum(outs), 2), -1.0)
    dist.all_to_all_single(out, _ints(torch, (sum(ins), 2), 9, rank), outs, ins)
    res["all_to_all_single_uneven"] = [out]
    if rank == 0:
        got = []
        for _ in range(n - 1):
            t = torch.zeros(2)
            got.append((dist.recv(t), t.tolist()))
        res["recv_any_source"] = sorted(got)
    else:
        dist.send(torch.full((2,), float(rank)), 0)
        res["recv_any_source"] = []
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    res["all_gather_object"] = objs
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    res["gather_object"] = gathered
    lst = [{"k": 1}, "two", 3] if rank == n - 1 else [None, None, None]
    dist.broadcast_object_list(lst, src=n - 1)
    res["broadcast_object_list"] = lst
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(n)] if rank == 0 else None, src=0)
    res["scatter_object_list"] = out
    return res


def case_groups(ctx):
    """Groups torch can name and look up: new_group, new_subgroups, get_backend, destroy_process_group(subgroup)."""
    torch, dist, n, rank = ctx.torch, ctx.dist, ctx.n, ctx.rank
    from torch._C._distributed_c10d import _resolve_process_group

    res = {"default_backend": str(dist.get_backend())}
    sub = dist.new_group(list(range(n - 1, -1, -1)))
    res["new_group_resolves"] = _resolve_process_group(sub.group_name) is sub
    res["new_group_backend"] = str(dist.get_backend(sub))
    x = _ints(torch, (4,), 10, rank)
    dist.all_reduce(x, group=sub)
    res["new_group_all_reduce"] = [x]
    cur, subgroups = dist.new_subgroups(group_size=2)
    y = _ints(torch, (4,), 11, rank)
    dist.all_reduce(y, group=cur)
    res["new_subgroups_all_reduce"] = [y]
    res["subgroup_names"] = sorted(type(g).__name__ for g in subgroups)
    name = sub.group_name
    dist.destroy_process_group(sub)
    try:
        _resolve_process_group(name)
        res["destroyed_unregistered"] = False
    except (RuntimeError, ValueError):
        res["destroyed_unregistered"] = True
    for g in subgroups:
        dist.destroy_process_group(g)
    z = _ints(torch, (3,), 12, rank)
    dist.all_reduce(z)  # the default group still works
    res["after_destroy"] = [z]
    return res


CASES = {f.__name__[len("case_"):]: f for f in (case_functional, case_compiled, case_mesh, case_dtensor, case_fsdp2,
                                                 case_tp, case_fsdp2_tp, case_dcp, case_ddp, case_p2p_and_objects,
                                                 case_groups)}


class _Ctx:
    pass


def run_cases(rank, n, backend, names, workdir):
    """The spawned ranks' entry point (tests/support/torch_ranks.py has made the default group with `backend`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    _count_gpucoll_calls()
    ctx = _Ctx()
    ctx.torch, ctx.dist, ctx.fc, ctx.rank, ctx.n, ctx.workdir = torch, dist, fc, rank, n, workdir
    ctx.mesh1d = init_device_mesh("cpu", (n,))
    ctx.mesh2d = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp")) if n == 4 else None
    out, counts, seconds = {}, {}, {}
    for name in names:
        t0 = time.monotonic()
        before = sum(_COUNTS.values())
        try:
            out[name] = CASES[name](ctx)
        except Exception:  # noqa: BLE001 - the parent reports it
            out[name] = "ERROR: " + traceback.format_exc()
        counts[name] = sum(_COUNTS.values()) - before
        dist.barrier()
        seconds[name] = time.monotonic() - t0
    return {"results": out, "gpucoll_calls": counts, "seconds": seconds, "torch": torch.__version__}
