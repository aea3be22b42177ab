"""DistributedDataParallel training on gpucoll (CPU ranks): the same 50 steps as with gloo, the same parameters.

A small MLP on synthetic data (each rank its own batches, one seed), small buckets so that every step all-reduces
several of them. Trained with:

* gloo, DDP's own all-reduce (the reference);
* the process group "gpucoll": a ``new_group(backend="gpucoll")`` handed to DDP, and (in another spawn)
  ``init_process_group("gpucoll")`` as the default group;
* a gloo group with each gpucoll hook registered (allreduce_hook, fp16/bf16_compress_hook), compared with the same
  model trained on gloo with torch's built-in hook of the same name.

Final parameters must be allclose (atol 1e-6) to the reference's and identical across ranks. At 2 ranks every
sum is exact, so the match is exact; at 3 ranks gpucoll and gloo add in different orders (float32 rounding), which
the tolerance covers. The compress hooks are checked at 2 ranks, where a float16/bfloat16 sum of two values rounds
once whatever the order.
"""

from __future__ import annotations

import helpers
import pytest
import torch_ranks

torch = helpers.require("torch")
helpers.require("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

STEPS = 50


def _train(rank, group=None, hook=None, hook_state=None, steps=STEPS):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)  # ~2,600 floats a bucket: several per step
    if hook is not None:
        ddp.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _gloo_default_worker(rank, n, with_hooks):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import gpucoll.torch

    out = {"gloo": _train(rank), "gpucoll_group": _train(rank, group=dist.new_group(backend="gpucoll"))}
    if with_hooks:
        out["allreduce_hook"] = _train(rank, hook=gpucoll.torch.allreduce_hook)
        out["fp16_gloo"] = _train(rank, hook=default_hooks.fp16_compress_hook)
        out["fp16_hook"] = _train(rank, hook=gpucoll.torch.fp16_compress_hook)
        out["bf16_gloo"] = _train(rank, hook=_torch_bf16_hook)
        out["bf16_hook"] = _train(rank, hook=gpucoll.torch.bf16_compress_hook)
        # the state may also be a gpucoll Communicator the caller built
        comm = gpucoll.init(from_torch=True, backend="host")
        out["hook_with_communicator"] = _train(rank, hook=gpucoll.torch.allreduce_hook, hook_state=comm)
        comm.close()
    return out


def _torch_bf16_hook(state, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses that name without CUDA and NCCL, though gloo
    reduces bfloat16 on CPU."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _gpucoll_default_worker(rank, n):
    import torch.distributed as dist

    assert dist.get_backend() == "gpucoll"
    return {"gpucoll_default": _train(rank)}


def _assert_same(name, got, want, atol=1e-6):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        diff = (a - b).abs().max().item()
        assert torch.allclose(a, b, rtol=0, atol=atol), f"{name}: parameter {i} differs by up to {diff:.3g}"


def _assert_ranks_identical(name, per_rank):
    for r, params in enumerate(per_rank[1:], start=1):
        for i, (a, b) in enumerate(zip(params, per_rank[0])):
            assert torch.equal(a, b), f"{name}: rank {r} parameter {i} differs from rank 0's"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_gpucoll_matches_gloo(world_size):
    with_hooks = world_size == 2
    res = torch_ranks.run(_gloo_default_worker, world_size, with_hooks, backend="gloo")
    default = torch_ranks.run(_gpucoll_default_worker, world_size, backend="gpucoll")
    for r in range(world_size):
        res[r].update(default[r])
    moved = [(a - b).abs().max().item() for a, b in zip(res[0]["gloo"], _initial_params())]
    assert max(moved) > 1e-3, "training did not move the parameters"
    pairs = [("gpucoll_group", "gloo"), ("gpucoll_default", "gloo")]
    if with_hooks:
        pairs += [("allreduce_hook", "gloo"), ("hook_with_communicator", "gloo"), ("fp16_hook", "fp16_gloo"),
                  ("bf16_hook", "bf16_gloo")]
    for name, ref in pairs:
        for r in range(world_size):
            _assert_same(f"{name} vs {ref} (rank {r})", res[r][name], res[r][ref])
        _assert_ranks_identical(name, [res[r][name] for r in range(world_size)])


def _initial_params():
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    return [p.detach().clone() for p in model.parameters()]
