"""A DDP job that loses a rank carries on without a restart (gpucoll.torch.elastic): torch's default group is made
over a gpucoll communicator's ranks; a rank is SIGKILLed between training steps; the survivors' next backward fails
(DDP raises RuntimeError naming the dead rank), they shrink the communicator, rebuild the default group over the
survivors, wrap the model in DDP again (which broadcasts rank 0's parameters) and train on. Every survivor ends with
the same parameters."""

from __future__ import annotations

import os
import signal

import helpers
import pytest

import gpucoll
from gpucoll.errors import RemoteError

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]
helpers.require("torch")


def _train(ddp, opt, comm, start: int, n: int) -> None:
    import torch

    for i in range(start, start + n):
        x = torch.full((4, 8), float(comm.rank + i)) / 8
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()


def _ddp_rank(comm, dead: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpucoll.torch import elastic

    torch.set_num_threads(1)
    torch.manual_seed(comm.rank)  # different on purpose: DDP must make them equal
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    elastic.init_process_group(comm)
    ddp = DDP(model)
    _train(ddp, opt, comm, 0, 3)
    if comm.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    error = None
    try:
        # The survivors meet the failure inside DDP's backward (its bucket all-reduce, on the group's worker thread):
        # torch raises it from backward() as RuntimeError, as on gloo. (It crashed the survivors in torch's reducer
        # while a failed future held the exception as its value.)
        _train(ddp, opt, comm, 3, 1)
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"[:300]
    new = comm.shrink()
    comm.abort()
    comm = new
    elastic.init_process_group(comm)
    ddp = DDP(model)  # rank 0's parameters to every survivor
    _train(ddp, opt, comm, 6, 5)
    out = {"error": error, "rank": dist.get_rank(), "size": dist.get_world_size(),
           "params": [p.detach().tolist() for p in model.parameters()]}
    dist.destroy_process_group()
    comm.close()
    return out


@pytest.mark.slow
def test_ddp_survives_a_killed_rank():
    with pytest.raises(RemoteError) as info:
        gpucoll.spawn(_ddp_rank, 3, args=(1,), backend="host", timeout=10.0, elastic=True)
    results = info.value.results
    assert results[1] is None
    for q, want_rank in ((0, 0), (2, 1)):
        res = results[q]
        assert res is not None, results
        assert res["error"] is not None and "CollectiveTimeout" in res["error"] and "rank 1" in res["error"], res
        assert (res["rank"], res["size"]) == (want_rank, 2), res
    assert results[0]["params"] == results[2]["params"]
