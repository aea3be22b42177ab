"""How torch finds the backend "gpucoll", and where a group's CPU tensors go.

* torch loads gpucoll's "torch.backends" entry point at ``import torch``: init_process_group("gpucoll") works without
  ``import gpucoll.torch``, which loads only then (``import torch`` gets gpucoll's errors module, not its native core).
* Ranks on several machines: gpucoll's host backend works on one machine, so a group whose ranks span machines sends
  CPU tensors to gloo, as "cpu:gloo,cuda:gpucoll" does, and says so once. Machines are faked by host name (each
  rank's ``socket.gethostname``, which is how gpucoll tells machines apart); the processes still share this one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import helpers
import pytest
import torch_ranks

helpers.require("torch")
helpers.require("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WITHOUT_IMPORT = """
import sys
import torch
import torch.distributed as dist

loaded = sorted(m for m in sys.modules if m.startswith("gpucoll"))  # what `import torch` loaded of gpucoll
for backend, cpu in (("gpucoll", "NoneType"), ("cpu:gloo,cuda:gpucoll", "ProcessGroupGloo")):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.distributed_c10d._get_default_group()
    x = torch.arange(3.0)
    dist.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0], x
    assert type(pg).__name__ == "ProcessGroupGpucoll" and type(pg._cpu_backend).__name__ == cpu, (backend, pg)
    dist.destroy_process_group()
assert loaded == ["gpucoll", "gpucoll._timeout", "gpucoll._torch_plugin", "gpucoll._version", "gpucoll.errors"], loaded
print("OK", flush=True)
# Leave without the interpreter's teardown: this checks how torch finds the backend, and twice (CI, 2026-11-27 and
# 2026-11-28) the teardown after "OK" aborted ("terminate called without an active exception", a std::thread left
# joinable in some static destructor: gpucoll's C++ has none; not reproduced in 130 runs here, cause unknown, open).
import os
os._exit(0)
"""


def test_init_process_group_without_importing_gpucoll_torch(tmp_path):
    """Without the entry point: "AssertionError: Unknown backend type gpucoll". The creator it registers reaches
    torch's frame through its own (the "cpu:gloo" case finds the gloo backend torch made there). Run outside the
    checkout: a gpucoll.egg-info left there by an old build would stand for the installed metadata."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(WITHOUT_IMPORT)], capture_output=True, text=True,
                         timeout=120, check=False, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "OK", (
        "(an install older than the entry point needs `pip install -e .` again)\n" + res.stdout + res.stderr[-3000:])


def test_the_entry_point_names_the_backend_of_gpucoll_torch():
    from gpucoll import _torch_plugin
    from gpucoll.torch import BACKEND_NAME

    assert _torch_plugin.BACKEND_NAME == BACKEND_NAME


def _machines_worker(rank, n):
    import socket

    import torch
    import torch.distributed as dist

    # Ranks 0 and 1 on one machine, rank 2 on another, as far as every Python caller is concerned.
    socket.gethostname = lambda: "node-a" if rank < 2 else "node-b"
    dist.init_process_group("gpucoll")
    world = dist.distributed_c10d._get_default_group()
    out = {}
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    out["all_reduce"] = x.tolist()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})  # pickles through all_gather on CPU tensors
    out["objects"] = objs
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=2)
    out["broadcast"] = box[0]
    dist.barrier()
    if rank in (0, 2):
        t = torch.tensor([7.0]) if rank == 2 else torch.zeros(1)
        (dist.send if rank == 2 else dist.recv)(t, 2 if rank == 0 else 0)
        out["recv"] = t.tolist()
    out["world_cpu"] = type(world._cpu_backend).__name__
    one_machine = dist.new_group([0, 1], backend="gpucoll")  # on node-a alone: the host backend
    across = dist.new_group([0, 2], backend="gpucoll")  # another group across machines: gloo, no second log line
    if rank < 2:
        y = torch.ones(2)
        dist.all_reduce(y, group=one_machine)
        out["one_machine"] = (y.tolist(), type(one_machine._cpu_backend).__name__)
    if rank in (0, 2):
        z = torch.ones(2)
        dist.all_reduce(z, group=across)
        out["across"] = (z.tolist(), type(across._cpu_backend).__name__)
    dist.destroy_process_group()
    return out


def test_cpu_tensors_of_ranks_on_several_machines_go_to_gloo(capfd):
    """Without the fix every CPU collective raised Unsupported ("the host backend needs every rank on one machine;
    rank 2 runs on 'node-b', rank 0 on 'node-a'"): object collectives, barrier, send/recv."""
    res = torch_ranks.run(_machines_worker, 3, backend=None, env={"GPUCOLL_LOG_LEVEL": "INFO"})
    for rank, out in enumerate(res):
        assert out["all_reduce"] == [6.0] * 5, out
        assert out["objects"] == [{"rank": r} for r in range(3)] and out["broadcast"] == "from 2", out
        assert out["world_cpu"] == "ProcessGroupGloo", out
        if rank in (0, 2):
            assert out["recv"] == [7.0], out
            assert out["across"] == ([2.0, 2.0], "ProcessGroupGloo"), out
        if rank < 2:
            assert out["one_machine"] == ([2.0, 2.0], "NoneType"), out
    err = capfd.readouterr().err
    line = ("gpucoll torch backend: the group's ranks run on 2 machines (node-a, node-b); CPU tensors go to gloo, as "
            "with init_process_group('cpu:gloo,cuda:gpucoll')")
    assert err.count(line) == 1, err[-3000:]
