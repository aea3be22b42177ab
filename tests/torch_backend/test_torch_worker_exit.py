"""An asynchronous CPU operation still running when the interpreter exits (DDP's hook leaves one completing its
future while the main thread leaves backward) is let finish on the host communicator's progress thread, which then
stays away from Python: the process exits 0 instead of aborting ("terminate called without an active exception",
seen in about a third of the README's DDP runs when a Python thread did this), and the peer gets its result."""

from __future__ import annotations

import os
import subprocess
import sys

import helpers
import pytest

from gpucoll._spawn import free_port

SCRIPT = """
import sys, time
import torch, torch.distributed as dist
import gpucoll.torch

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gpucoll", rank=rank, world_size=2)
t = torch.full((1 << 16,), float(rank + 1))
dist.all_reduce(torch.zeros(1))  # the group's host communicator
if rank == 0:
    work = dist.all_reduce(t, async_op=True)  # rank 1 comes 0.5 s later: still running at exit
    work.get_future().then(lambda f: f.value()[0].add_(1))  # a callback the exiting interpreter must not run
else:
    time.sleep(0.5)
    dist.all_reduce(t)
    open(out, "w").write(repr(t[:2].tolist()))
"""


@pytest.mark.spawns
def test_exit_lets_the_running_operation_finish_and_stays_away_from_python(tmp_path):
    helpers.require("torch", "the torch backend's asynchronous all_reduce")
    script, mark = tmp_path / "exit_race.py", tmp_path / "mark"
    script.write_text(SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(mark)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-3000:]}"
    assert mark.read_text() == "[3.0, 3.0]", "the peer did not get the sum of rank 0's exiting all_reduce"


STUCK = """
import datetime, sys, time
import torch, torch.distributed as dist
import gpucoll.torch

rank = int(sys.argv[1])
dist.init_process_group("gpucoll", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
dist.all_reduce(torch.zeros(1))
if rank == 0:
    work = dist.all_reduce(torch.ones(8), async_op=True)  # rank 1 never comes
    print("issued", flush=True)
else:
    time.sleep(600)
"""


@pytest.mark.spawns
def test_exit_gives_up_on_an_operation_stuck_on_a_peer_after_a_bounded_wait(tmp_path):
    """The group's timeout is 300 s; the exiting rank waits for its progress thread 10 s (_EXIT_WAIT_S), then
    leaves it to the process's end, and exits 0."""
    helpers.require("torch", "the torch backend's asynchronous all_reduce")
    script = tmp_path / "exit_stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert "issued" in out and procs[0].returncode == 0, f"rank 0 exited {procs[0].returncode}: {err[-3000:]}"
