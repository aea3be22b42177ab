"""GPU twins of tests/torch_backend/test_torch_modern.py's FSDP2 and DTensor cases: the same model, data and steps on
CUDA tensors with default group "gpucoll", against gloo on CPU tensors (the CPU reference run of the same case).
DTensor redistribution uses integer values (exact); FSDP2 losses are compared with a tolerance of 1e-4, since CUDA
and CPU matmuls round differently. Two ranks: on two GPUs, or sharing one with NCCL's multi-rank mode (skipped with
the reason otherwise, as tests/torch_backend/test_torch_backend_gpu.py does). Every test is @pytest.mark.gpu.
"""

from __future__ import annotations

import pytest
import torch_ranks
from test_torch_backend_gpu import N_RANKS, _env, _skip_unless_ranks

from gpucoll import _C

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_C.build_info().get("cuda_emulated")),
                       reason="torch CUDA tensors need a real GPU (torch cannot allocate on gpucoll's emulated CUDA "
                              "device)"),
]


def _worker(rank, n, device_type):
    import torch
    import torch_modern_cases as cases
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (n,))
    out = {}
    full = cases._ints(torch, (n * 3, 4), 5, 0).to(dev)
    d = distribute_tensor(full, mesh, [Shard(0)])
    part = DTensor.from_local(cases._ints(torch, (3, 4), 6, rank).to(dev), mesh, [Partial()])
    out["dtensor"] = [d.redistribute(mesh, [Replicate()]).to_local().cpu(), d.redistribute(mesh, [Shard(1)])
                      .to_local().cpu(), part.redistribute(mesh, [Replicate()]).to_local().cpu(),
                      part.redistribute(mesh, [Shard(0)]).to_local().cpu()]
    for name, mp in (("fp32", None), ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))):
        model = cases._mlp(torch).to(dev)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(cases.STEPS):
            x, y = cases._batch(torch, rank, step)
            loss = torch.nn.functional.mse_loss(model(x.to(dev)).float(), y.to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = losses
    return out


def test_fsdp2_and_dtensor_on_cuda_match_gloo_on_cpu():
    _skip_unless_ranks()
    ours = torch_ranks.run(_worker, N_RANKS, "cuda", backend="gpucoll", env=_env(), timeout=600.0)
    ref = torch_ranks.run(_worker, N_RANKS, "cpu", backend="gloo", timeout=600.0)
    import torch

    for rank in range(N_RANKS):
        for a, b in zip(ours[rank]["dtensor"], ref[rank]["dtensor"]):
            assert torch.equal(a, b), (rank, a, b)
        for name, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
            diff = max(abs(a - b) for a, b in zip(ours[rank][name], ref[rank][name]))
            assert diff <= tol, f"rank {rank} {name}: losses differ from gloo's by up to {diff:.3g}"


def _split_worker(rank, n):
    import torch
    import torch.distributed as dist

    import gpucoll.torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gpucoll", device_id=dev)  # split_group needs the default group bound to a device
    sub = dist.split_group(split_ranks=[list(range(n))])
    x = torch.arange(4, device=dev) * (rank + 1)
    dist.all_reduce(x, group=sub)
    return {"type": type(sub).__name__, "is_gpucoll": isinstance(sub, gpucoll.torch.ProcessGroupGpucoll),
            "name_resolves": dist.distributed_c10d._resolve_process_group(sub.group_name) is sub,
            "sum": x.cpu().tolist()}


def test_split_group_on_cuda():
    """torch's split_group (CUDA groups bound to a device, as torch requires): a named gpucoll group that works."""
    _skip_unless_ranks()
    res = torch_ranks.run(_split_worker, N_RANKS, backend=None, env=_env(), timeout=300.0)
    want = [i * sum(r + 1 for r in range(N_RANKS)) for i in range(4)]
    for out in res:
        assert out["is_gpucoll"] and out["name_resolves"] and out["sum"] == want, out
