"""gpucoll.init(from_torch=...) and gpucoll.init(mpi_comm=...) (gpucoll/bootstrap/external.py), run with the host
backend so that they are checked on any machine: the NCCL backend takes the same LaunchInfo and store."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll._spawn import free_port
from gpucoll.errors import InvalidArgument


def _torch_worker(rank, world, port, results):
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        comm = gpucoll.init(from_torch=True, backend="host", timeout=30.0)
        x = np.full(4, rank + 1, dtype=np.float32)
        comm.all_reduce(x)
        sub = dist.new_group([0, 1])
        comm2 = gpucoll.init(from_torch=sub, backend="host", timeout=30.0) if rank < 2 else None
        y = np.full(2, 10 * (rank + 1) + 1, dtype=np.int64)
        if comm2 is not None:
            comm2.all_reduce(y)
            comm2.close()
        results.put((rank, comm.rank, comm.world_size, x.tolist(), y.tolist()))
        comm.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        results.put((rank, "error", repr(e)))


@pytest.mark.spawns
@pytest.mark.timeout(120) if "pytest_timeout" in sys.modules else (lambda f: f)
def test_init_from_torch_process_group():
    helpers.require("torch.distributed")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_worker, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r, item in enumerate(got):
        assert item[1] != "error", item
        assert item[:3] == (r, r, 3) and item[3] == [6.0] * 4
        assert item[4] == ([32, 32] if r < 2 else [31, 31])  # rank 2 is not in the subgroup


def test_init_from_torch_argument_errors():
    helpers.require("torch.distributed")
    with pytest.raises(InvalidArgument, match="cannot be combined with from_torch"):
        gpucoll.init(0, backend="host", from_torch=True)
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(InvalidArgument, match="not initialised"):
            gpucoll.init(backend="host", from_torch=True)


MPI_SCRIPT = """
import json, numpy as np, gpucoll
from mpi4py import MPI
comm = gpucoll.init(mpi_comm=MPI.COMM_WORLD, backend="host", timeout=30.0)
x = np.full(3, comm.rank + 1, dtype=np.int32)
comm.all_reduce(x)
print(json.dumps({"rank": comm.rank, "size": comm.world_size, "x": x.tolist()}), flush=True)
comm.close()
"""


@pytest.mark.spawns
def test_init_from_mpi_comm(tmp_path):
    helpers.require("mpi4py")
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        pytest.skip(helpers.missing_reason("mpich", "no mpiexec on PATH"))
    script = tmp_path / "mpi_init.py"
    script.write_text(MPI_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOLL_", "OMPI_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The ranks share stdout, so their lines may interleave without a newline between them: parse objects.
    rows = sorted((json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)), key=lambda d: d["rank"])
    assert [(d["rank"], d["size"], d["x"]) for d in rows] == [(0, 2, [3, 3, 3]), (1, 2, [3, 3, 3])]


def test_mpi_comm_must_look_like_mpi4py():
    with pytest.raises(InvalidArgument, match="mpi_comm must be an mpi4py communicator"):
        gpucoll.init(backend="host", mpi_comm=object())


def test_torch_store_has_what_the_gpu_backends_use():
    """The custom backend exchanges JSON and meets at barriers through whatever store it was given: torch's too."""
    import threading

    dist = helpers.require("torch.distributed")
    from gpucoll.bootstrap.external import TorchStore
    from gpucoll.errors import CollectiveTimeout

    store = TorchStore(dist.HashStore(), timeout=5.0)
    store.set_json("k", {"a": [1, 2]})
    assert store.get_json("k") == {"a": [1, 2]}
    seen = []

    def rank(r):
        for _ in range(3):  # reusable: three generations
            store.barrier("b", 3, rank=r)
            seen.append(r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(seen) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(CollectiveTimeout, match=r"1 of 2 ranks arrived; missing ranks: \[1\]") as info:
        store.barrier("lonely", 2, timeout=0.2, rank=0)
    assert list(info.value.ranks) == [1]
