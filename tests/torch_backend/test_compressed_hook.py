"""gpucoll.torch.compressed_hook under DDP (CPU ranks, gloo as the default group).

* Error feedback keeps, per bucket, exactly what the wire dropped of the corrected gradient: after each step the
  residual equals (bucket + previous residual) - roundtrip(bucket + previous residual), bit for bit, with the
  NumPy reference of the format.
* Every rank ends with the same parameters (every rank gets the same bits), and a short training run ends close to
  the uncompressed hook's loss.
* A wrong state is a typed error.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest
import torch_ranks

torch = helpers.require("torch")
helpers.require("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]


def _model():
    import torch

    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _train(rank, world_size, variant, steps):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpucoll.torch
    from gpucoll import compression

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.005)  # ~1,300 floats a bucket: several buckets, several blocks each
    fails = []
    if variant == "none":
        ddp.register_comm_hook(None, gpucoll.torch.allreduce_hook)
    else:
        fmt, _, ef = variant.partition("+")
        state = gpucoll.torch.CompressionState(fmt, error_feedback=ef == "ef")

        def checked(state, bucket):
            before = bucket.buffer().detach().clone().numpy()
            previous = state.residuals.get(bucket.index())
            previous = previous.clone().numpy() if previous is not None else np.zeros_like(before)
            fut = gpucoll.torch.compressed_hook(state, bucket)
            if state.error_feedback:
                corrected = (before + previous).astype(np.float32)
                want = corrected - compression.roundtrip(corrected, fmt)
                got = state.residuals[bucket.index()].numpy()
                if not np.array_equal(got, want):
                    fails.append(f"bucket {bucket.index()}: the residual is not what the wire dropped")
            elif state.residuals:
                fails.append("residuals kept without error feedback")
            return fut

        ddp.register_comm_hook(state, checked)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 8, generator=teacher)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w).argmax(dim=1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"fails": fails, "params": params, "last": float(np.mean(losses[-10:]))}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_error_feedback_and_training(fmt):
    P = 3
    base = torch_ranks.run(_train, P, "none", 60)
    for variant in (f"{fmt}+ef", fmt):
        res = torch_ranks.run(_train, P, variant, 60)
        fails = [f for r in res for f in r["fails"]]
        assert not fails, fails[:5]
        for r in res[1:]:
            assert np.array_equal(r["params"], res[0]["params"]), f"{variant}: ranks ended with different models"
        assert abs(res[0]["last"] - base[0]["last"]) <= 0.03 * base[0]["last"], (variant, res[0]["last"],
                                                                                 base[0]["last"])


def test_bad_state_and_format():
    import gpucoll.torch
    from gpucoll.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="CompressionState"):
        gpucoll.torch.compressed_hook(None, object())
    with pytest.raises(InvalidArgument, match="int4"):
        gpucoll.torch.CompressionState("int4")
