"""``gpucoll.init()`` with no arguments under the real launchers: torchrun (--standalone, and --rdzv-backend c10d,
whose agent already serves the store on MASTER_PORT), mpiexec (the mpich wheel), and Slurm's srun by its
environment (no Slurm here: two processes get the variables srun would set). Each run is bounded in time and uses
free ports; every rank checks an exact all_reduce and reports the rank and size it found.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import helpers
import pytest

from gpucoll._spawn import free_port

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(240)]

SCRIPT = """
import json, numpy as np, gpucoll
comm = gpucoll.init(timeout=60)
x = np.arange(6, dtype=np.int64) + comm.rank
comm.all_reduce(x)
print(json.dumps({"rank": comm.rank, "size": comm.world_size, "backend": comm.backend, "x": x.tolist()}), flush=True)
comm.close()
"""

# Variables of an enclosing launcher (a CI job run under srun or torchrun) would describe the wrong processes.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                  "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "HYDRA_", "GPUCOLL_")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    # The host backend: the script reduces NumPy arrays, which backend="auto" would refuse where it picks NCCL (a
    # GPU machine). What is tested is how init() finds rank, size and rendezvous under each launcher.
    env.update(OMP_NUM_THREADS="1", GPUCOLL_BACKEND="host", **extra)
    return env


def _check(out: str, world: int = 2) -> None:
    # The ranks share stdout, so their lines may interleave: parse the JSON objects.
    rows = sorted((json.loads(o) for o in re.findall(r"\{[^{}]*\}", out)), key=lambda d: d["rank"])
    base = [sum(range(world)) + world * i for i in range(6)]
    assert [(d["rank"], d["size"], d["x"]) for d in rows] == [(r, world, base) for r in range(world)], out


def _run(cmd, tmp_path, env, timeout=150) -> str:
    script = tmp_path / "init_script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=timeout, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _torchrun() -> list[str]:
    helpers.require("torch.distributed", "torchrun is part of torch")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def test_init_under_torchrun_standalone(tmp_path):
    """--standalone: the agent picks a free port and serves its store there (TORCHELASTIC_USE_AGENT_STORE=True)."""
    _check(_run([*_torchrun(), "--standalone"], tmp_path, _env()))


def test_init_under_torchrun_c10d_rendezvous(tmp_path):
    """--rdzv-backend c10d: rendezvous at the endpoint, then the workers' store is the agent's, on MASTER_PORT."""
    cmd = [*_torchrun(), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "t"]
    _check(_run(cmd, tmp_path, _env()))


def test_init_under_mpiexec(tmp_path):
    helpers.require("mpi4py", "the mpich wheel comes with it in the test extra")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip(helpers.missing_reason("mpich", "no mpiexec on PATH"))
    # MPICH sets PMI_RANK/PMI_SIZE and MPI_LOCALNRANKS; MASTER_PORT keeps rank 0's store off the default 29500.
    env = _env(MASTER_PORT=str(free_port()), HOME=str(tmp_path))  # no GPUCOLL_STORE_SECRET: the per-user file
    _check(_run([mpiexec, "-n", "2", sys.executable], tmp_path, env))


def _slurm_ranks(tmp_path, world: int, node_env) -> str:
    """`world` processes with the environment srun would give its tasks, node_env(rank) added (and a free
    MASTER_PORT: srun sets none, and the default 29500 may be taken on a shared machine)."""
    script = tmp_path / "init_script.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    procs = []
    for r in range(world):
        env = _env(SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_LOCALID=str(r), SLURM_JOB_ID="4242",
                   SLURM_STEP_ID="0", MASTER_PORT=port, HOME=str(tmp_path))
        env.update(node_env(r))
        procs.append(subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    out = ""
    try:
        for p in procs:
            o, e = p.communicate(timeout=120)
            out += o
            assert p.returncode == 0, o + e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_init_under_srun_environment_one_node(tmp_path):
    """srun on one node (no Slurm here, so the variables are set by hand): rank 0 serves the store on loopback."""
    _check(_slurm_ranks(tmp_path, 2, lambda r: {"SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2",
                                                "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0"}))


def test_init_under_srun_environment_two_nodes_finds_rank0_from_the_nodelist(tmp_path):
    """Two "nodes" (one task each) without MASTER_ADDR: the store's host is the first node of SLURM_STEP_NODELIST.
    Both tasks really run here, so that first node is this machine's loopback name."""
    _check(_slurm_ranks(tmp_path, 2, lambda r: {"SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)",
                                                "SLURM_STEP_NODELIST": "localhost,node-b", "SLURM_NODEID": str(r),
                                                "SLURM_LOCALID": "0"}))
