"""gpucoll's emulated CUDA device as seen through gpucoll (a GPUCOLL_CUDA=emulate build; on a real GPU these skip):
it says plainly that it is emulated, DeviceArray exports what CUDA consumers expect, and its shape (SMs, resident
blocks per SM, devices, P2P) set through the GPUCOLL_EMU_* variables drives the decisions gpucoll makes from a
GPU's shape: the residency limit of virtual ranks, launch shapes, and the P2P eligibility of the custom kernels.
The emulator's own CUDA semantics are checked natively in tests/emulation/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gpu_arrays
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import GpucollError

pytestmark = [pytest.mark.spawns, pytest.mark.gpu,
              pytest.mark.skipif(not _C.build_info().get("cuda_emulated"),
                                 reason="checks gpucoll's emulated CUDA device (a GPUCOLL_CUDA=emulate build)")]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with GPUCOLL_EMU_* (and other) variables set before gpucoll is imported."""
    full = dict(os.environ, **{k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env=full, check=False)


def test_info_and_probe_say_emulated():
    res = subprocess.run([sys.executable, "-m", "gpucoll", "info"], capture_output=True, text=True, timeout=120,
                         check=True)
    assert "CUDA EMULATED" in res.stdout and "Its timings are not GPU timings" in res.stdout
    assert "emulated: not GPUs" in res.stdout
    probe = _C.cuda_probe()
    assert probe["emulated"] and probe["device_count"] >= 1
    assert "not a GPU" in probe["devices"][0]["name"]
    doc = json.loads(subprocess.run([sys.executable, "-m", "gpucoll", "info", "--json"], capture_output=True,
                                    text=True, timeout=120, check=True).stdout)
    assert doc["build"]["cuda_emulated"] is True
    assert any(v["name"] == "GPUCOLL_EMU_SMS" for v in doc["config"])


def test_device_array_exports():
    from gpucoll import _buffers
    from gpucoll.testing import DeviceArray

    a = np.arange(12, dtype=np.int32)
    x = DeviceArray.from_host(a)
    cai = x.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (12,) and cai["typestr"] == "<i4" and cai["data"] == (x.ptr, False)
    assert x.__dlpack_device__() == (2, 0)
    assert _C.cuda_pointer_info(x.ptr)["device_memory"]
    buf = _buffers.resolve(x, "x", writable=True)
    assert (buf.kind, buf.ptr, buf.count, buf.dtype_name) == ("cai", x.ptr, 12, "int32")
    b = DeviceArray.from_host(np.array([1.0, -2.5, 3.0], np.float32), dtype="bfloat16")
    assert not hasattr(b, "__cuda_array_interface__")  # no bfloat16 type string: consumers come through DLPack
    bbuf = _buffers.resolve(b, "x", writable=True)
    assert (bbuf.kind, bbuf.dtype_name, bbuf.device) == ("dlpack", "bfloat16", "cuda:0")
    np.testing.assert_array_equal(b.to_host(), [1.0, -2.5, 3.0])
    view = x[3:7]
    assert view.ptr == x.ptr + 12 and np.array_equal(view.to_host(), a[3:7])
    with pytest.raises(gpucoll.errors.InvalidArgument, match="host array has 3 elements"):
        x.copy_from_host(np.zeros(3, np.int32))


def test_residency_limit_follows_the_device_shape():
    # 2 SMs x 1 resident block: two virtual ranks of one block each fit, three do not; the grid is capped at 1.
    res = run_python("""
        import numpy as np
        from gpucoll import testing, _C
        from gpucoll.errors import InvalidArgument
        from gpucoll.testing import DeviceArray
        print("sms", _C.emulator_config()["sms"], _C.emulator_config()["blocks_per_sm"])
        try:
            testing.virtual_ranks(3)
        except InvalidArgument as e:
            print("refused", e)
        with testing.virtual_ranks(2, buffer_bytes=1 << 20) as vr:
            print("shape", vr.launch_shape("oneshot", 1 << 20))
            xs = [DeviceArray.from_host(np.arange(100000, dtype=np.float32) + r) for r in range(2)]
            vr.all_reduce(xs, algo="oneshot")
            vr.synchronize()
            print("ok", bool(np.array_equal(xs[0].to_host(), 2 * np.arange(100000, dtype=np.float32) + 1)))
    """, GPUCOLL_EMU_SMS=2, GPUCOLL_EMU_BLOCKS_PER_SM=1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "sms 2 1" in res.stdout
    assert "refused 3 virtual ranks x 1 blocks = 3 blocks must all be resident" in res.stdout, res.stdout
    assert "shape (1, 512)" in res.stdout and "ok True" in res.stdout
    # A bigger device: more blocks per rank.
    res = run_python("""
        from gpucoll import testing
        with testing.virtual_ranks(8) as vr:
            print("shape", vr.launch_shape("oneshot", 1 << 20))
    """, GPUCOLL_EMU_SMS=16, GPUCOLL_EMU_BLOCKS_PER_SM=4)
    assert res.returncode == 0 and "shape (8, 512)" in res.stdout, res.stdout + res.stderr
    # No cap (sm_90's own 32 blocks per SM): the occupancy model alone says how many 512-thread blocks an SM holds,
    # 2048 / 512 = 4 (the default cap of 2 would refuse a third rank), so 1 SM takes 4 ranks and refuses a fifth.
    res = run_python("""
        from gpucoll import testing
        from gpucoll.errors import InvalidArgument
        with testing.virtual_ranks(4) as vr:
            print("shape", vr.launch_shape("oneshot", 1 << 20))
        try:
            testing.virtual_ranks(5)
        except InvalidArgument as e:
            print("refused", e)
    """, GPUCOLL_EMU_SMS=1, GPUCOLL_EMU_BLOCKS_PER_SM=32)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "shape (1, 512)" in res.stdout, res.stdout
    assert "refused 5 virtual ranks x 1 blocks = 5 blocks must all be resident" in res.stdout, res.stdout
    # (That blocks beyond the slots really wait, so that ranks over the limit would deadlock as on a GPU, is
    # checked natively: tests/emulation/native/runtime_checks.cc, residency_is_enforced.)


def _two_devices(comm):
    x = gpu_arrays.DeviceArrays().upload(np.full(1000, comm.rank + 1.0, np.float32), "float32", comm.rank)
    out = {"p2p": list(comm._ops.native.p2p_row), "reason": comm._ops.static_reason}
    try:
        comm.all_reduce(x)
        out["result"] = float(x.to_host()[0])
    except GpucollError as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("p2p", (1, 0))
def test_p2p_between_emulated_devices_decides_eligibility(p2p, monkeypatch):
    # Two devices, one rank each. With P2P the kernels run across them; without it CUDA IPC between the devices
    # fails, every rank sees the same P2P matrix, the kernels are declined, and backend="custom" (kernels only) refuses
    # the call on every rank with the P2P reason. The communicator itself is made: its NCCL (the stand-in) connects
    # devices without P2P, as NCCL's SHM transport does.
    monkeypatch.setenv("GPUCOLL_EMU_DEVICES", "2")
    monkeypatch.setenv("GPUCOLL_EMU_P2P", str(p2p))
    results = gpucoll.spawn(_two_devices, 2, backend="custom", timeout=120.0)
    if p2p:
        assert [r["p2p"] for r in results] == [[1, 1], [1, 1]] and [r["result"] for r in results] == [3.0, 3.0]
    else:
        assert [r["p2p"] for r in results] == [[1, 0], [0, 1]], results
        assert all("cannot read" in r["reason"] for r in results), results
        assert all("P2P" in r.get("refused", "") for r in results), results


def _mappings(comm):
    from gpucoll.testing import DeviceArray

    x = DeviceArray.from_host(np.ones(1 << 16, np.float32))
    comm.register(x)  # maps the peer's allocation through CUDA IPC
    comm.all_reduce(x)
    with open("/proc/self/maps") as f:
        maps = f.read()
    # (multiprocessing's own semaphores, /dev/shm/sem.mp-*, belong to gpucoll.spawn's result queue.)
    return maps.count("gpucoll-emu-device-memory"), [line for line in maps.splitlines()
                                                     if "/dev/shm" in line and "/dev/shm/sem.mp-" not in line]


def test_device_memory_is_never_a_dev_shm_file():
    # Device memory is memfd: a process killed at any point leaves nothing in /dev/shm. Every mapping of device
    # memory in a rank, its own and its peer's (CUDA IPC), is an anonymous memfd; none is a /dev/shm file.
    results = gpucoll.spawn(_mappings, 2, backend="custom", timeout=120.0)
    assert all(n >= 4 and shm == [] for n, shm in results), results


def test_bad_shape_is_refused_at_import():
    res = run_python("import gpucoll._C", GPUCOLL_EMU_COMPUTE_CAPABILITY="nine")
    assert res.returncode != 0 and "GPUCOLL_EMU_COMPUTE_CAPABILITY must be major.minor" in res.stderr



def test_stream_jitter_delays_each_operation_by_its_seed():
    """GPUCOLL_EMU_JITTER_US: each stream operation starts after a delay drawn from GPUCOLL_EMU_SEED (the suite turns
    it on; tests/conftest.py); 0 turns it off, and a value out of range is refused naming the variable."""
    code = """
        import time
        import numpy as np
        from gpucoll import _C
        from gpucoll.testing import DeviceArray
        x, y = DeviceArray.from_host(np.zeros(4, np.float32)), DeviceArray.from_host(np.ones(4, np.float32))
        s = _C.CudaStream(0)
        t0 = time.perf_counter()
        for _ in range(40):
            _C.cuda_copy(x.ptr, y.ptr, 16, 0, s.handle)
        s.synchronize()
        c = _C.emulator_config()
        print("took", time.perf_counter() - t0, c["jitter_us"], c["seed"], x.to_host().tolist())
    """
    times = {}
    for jitter in (0, 5000):
        res = run_python(code, GPUCOLL_EMU_JITTER_US=jitter, GPUCOLL_EMU_SEED=11)
        assert res.returncode == 0, res.stdout + res.stderr
        took, us, seed, data = res.stdout.split(" ", 4)[1:]
        assert (int(us), int(seed), data.strip()) == (jitter, 11, "[1.0, 1.0, 1.0, 1.0]"), res.stdout
        times[jitter] = float(took)
    # 40 delays drawn uniformly from 0-5 ms: about 100 ms; below 20 ms only if the draws were not made at all.
    assert times[5000] > 0.02 and times[5000] > 3 * times[0], times
    bad = run_python("from gpucoll._native import _C; _C.build_info()", GPUCOLL_EMU_JITTER_US=-1)
    assert bad.returncode != 0 and "GPUCOLL_EMU_JITTER_US" in bad.stderr, bad.stderr[-2000:]
