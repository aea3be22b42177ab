"""backend='auto' on a GPU (or gpucoll's emulated device): CUDA buffers on the GPU backend, CPU buffers on a host
communicator built on first use (gpucoll/backends/router.py), as torch's default group pairs NCCL with gloo.

3 ranks share the device (NCCL's multi-rank mode, set by spawn): every collective exact on NumPy arrays and on
DeviceArrays of the same communicator, a group mixing both, the same on a split child, x and out in different
memories refused on every rank, the host communicator built only when a CPU buffer comes, all_reduce(x) taking the
one-call path of the backend x belongs to, and backend='nccl' still refusing NumPy arrays."""

from __future__ import annotations

import importlib.util

import gpu_arrays
import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import InvalidArgument
from gpucoll.testing import DeviceArray

pytestmark = [pytest.mark.spawns, pytest.mark.gpu, *helpers.timeout_mark(300)]
PUT, GET = DeviceArray.from_host, (lambda a: a.to_host())


def _mixed(comm) -> list:
    P, r = comm.world_size, comm.rank
    fails = []
    if comm._ops.host is not None:
        fails.append(f"rank {r}: the host communicator was built before any CPU buffer came")
    members = list(range(P))
    fails += helpers.every_collective(comm, members, "cuda", n=257, put=PUT, get=GET)
    if comm._ops.host is not None:
        fails.append(f"rank {r}: CUDA buffers alone built the host communicator")
    fails += helpers.every_collective(comm, members, "numpy", n=257)
    fails += helpers.every_collective(comm, members, "cuda after numpy", n=257, put=PUT, get=GET)
    # One group holding a CPU ring and a CUDA ring: each backend's sends and receives progress together.
    right, left = (r + 1) % P, (r - 1) % P
    cpu_got, dev_got = np.zeros(8, np.float32), PUT(np.zeros(8, np.float32))
    with comm.group():
        comm.send(np.full(8, r, np.float32), right)
        comm.send(PUT(np.full(8, 10 + r, np.float32)), right)
        comm.recv(cpu_got, left)
        comm.recv(dev_got, left)
    if not (np.array_equal(cpu_got, np.full(8, left)) and np.array_equal(GET(dev_got), np.full(8, 10 + left))):
        fails.append(f"rank {r}: mixed group got {cpu_got[:2]} and {GET(dev_got)[:2]}")
    try:
        comm.all_reduce(np.ones(4, np.float32), out=PUT(np.zeros(4, np.float32)))
        fails.append(f"rank {r}: x on the host with out on the device was accepted")
    except InvalidArgument as e:
        if "same memory" not in str(e):
            fails.append(f"rank {r}: unexpected error text: {e}")
    sub = comm.split(r % 2)
    fails += helpers.every_collective(sub, [q for q in range(P) if q % 2 == r % 2], "numpy split", n=65)
    sub.close()
    return fails


def _noted(taken: list, name: str, result: bool) -> bool:
    taken.append((name, result))
    return result


def _one_call(comm) -> list:
    """all_reduce(x) in place takes the one-call path of the backend x belongs to, under 'auto' too: NumPy arrays the
    host backend's (once a CPU buffer built it), DeviceArrays the GPU backend's; exact either way."""
    P, r, ops = comm.world_size, comm.rank, comm._ops
    x = np.full(5, r + 1, np.float32)
    comm.all_reduce(x)  # the first CPU buffer builds the host communicator, on the general path
    taken = []
    gpu_cls, host_cls = type(ops.gpu), type(ops.host)
    gpu_real, host_real = gpu_cls.fast_all_reduce, host_cls.fast_all_reduce
    gpu_cls.fast_all_reduce = lambda self, *a: _noted(taken, "gpu", gpu_real(self, *a))
    host_cls.fast_all_reduce = lambda self, *a: _noted(taken, "host", host_real(self, *a))
    try:
        y = np.full(5, r + 1, np.float32)
        comm.all_reduce(y)
        d = PUT(np.full(5, r + 1, np.float32))
        comm.all_reduce(d)
        t = None
        if importlib.util.find_spec("torch") is not None:  # a CPU tensor is the host backend's too
            import torch

            t = torch.full((5,), float(r + 1))
            comm.all_reduce(t)
    finally:
        gpu_cls.fast_all_reduce, host_cls.fast_all_reduce = gpu_real, host_real
    want = [P * (P + 1) / 2] * 5
    return [taken, x.tolist() == want and y.tolist() == want and GET(d).tolist() == want
            and (t is None or t.tolist() == want)]


def test_auto_takes_each_backends_one_call_path():
    gpu_arrays.require_nccl_ranks(3)
    for taken, exact in gpucoll.spawn(_one_call, 3, backend="auto", timeout=120.0):
        torch = [("host", True)] if importlib.util.find_spec("torch") is not None else []
        assert exact and taken == [("host", True), ("gpu", True)] + torch, taken


def test_auto_runs_cpu_and_cuda_buffers_on_one_communicator():
    gpu_arrays.require_nccl_ranks(3)  # else 'auto' is the host backend alone (the last test here)
    results = gpucoll.spawn(_mixed, 3, backend="auto", timeout=120.0)
    fails = [f for res in results for f in res]
    assert not fails, helpers.format_failures(fails)


def _named_nccl(comm):
    try:
        comm.all_reduce(np.ones(4, np.float32))
    except InvalidArgument as e:
        return str(e)
    return None


def test_a_named_gpu_backend_still_refuses_cpu_buffers():
    gpu_arrays.require_nccl_ranks(2)
    for text in gpucoll.spawn(_named_nccl, 2, backend="nccl", timeout=60.0):
        assert text is not None and "NumPy array" in text, text


def test_auto_is_the_host_backend_where_ranks_would_need_to_share_a_gpu_they_may_not(monkeypatch):
    """More local ranks than GPUs, no device= and no NCCL multi-rank mode: 'auto' builds the host backend (init
    would otherwise fail on the rank left without a GPU); with the mode on, or device= given, NCCL."""
    from gpucoll import _C, _nccl
    from gpucoll.backends.usable import MULTI_RANK_ENV, auto_placement_problem

    count = int(_C.cuda_probe()["device_count"])
    monkeypatch.delenv(MULTI_RANK_ENV, raising=False)
    assert auto_placement_problem(count, None) == ""
    why = auto_placement_problem(count + 1, None)
    assert f"{count + 1} ranks on this node and {count} GPU(s)" in why and MULTI_RANK_ENV in why, why
    assert auto_placement_problem(count + 1, 0) == ""
    monkeypatch.setenv(MULTI_RANK_ENV, "1")
    if _C.nccl_multi_rank_gpu_supported(int(_nccl.load()["version"])):
        assert auto_placement_problem(count + 1, None) == ""
