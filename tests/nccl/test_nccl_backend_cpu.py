"""The NCCL backend's logic that runs without a GPU.

* init(backend='nccl') / spawn(backend='nccl') explain what is missing (NCCL, a GPU and driver, a CUDA build) and how
  to fix it; backend='auto' stays host here. Cases that depend on what NCCL a process loaded run in fresh
  interpreters, because the loader's result is final for a process.
* Version gates (fp8, multi-rank GPUs) and device choice (premul_sum: test_nccl_premul_cpu.py).
* CUDA buffer and stream resolution (``__cuda_array_interface__`` with bogus pointers, DLPack capsules read from CPU
  torch tensors) and the backends' placement rules.
* Work objects and the watchdog, driven through a fake native communicator: timeouts name the operation, its
  sequence number and the ranks that had not reached it; asynchronous NCCL errors; progress publication.
(Bootstrap from torch.distributed and mpi4py: test_bootstrap_external.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C, _buffers, _cuda_buffers
from gpucoll._spawn import free_port
from gpucoll.backends import nccl as _nccl_backend
from gpucoll.bootstrap.store import TCPStore
from gpucoll.errors import (
    CollectiveTimeout,
    CudaError,
    InvalidArgument,
    InvalidUsage,
    NcclError,
    RemoteError,
    Unsupported,
)

HAVE_GPU = int(_C.cuda_probe()["device_count"]) > 0
no_gpu_only = pytest.mark.skipif(HAVE_GPU, reason="checks the messages shown on machines without a GPU")
BOGUS_PTR = 0xDEAD0000


def run_py(code: str, env_extra=None, timeout: float = 120.0) -> dict:
    """Run `code` in a fresh interpreter; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOLL_")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


INIT_NCCL = """
import json
import gpucoll
from gpucoll._spawn import free_port
try:
    gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=10)
    print(json.dumps({"error": None}))
except gpucoll.GpucollError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def host_comm(**kwargs):
    return gpucoll.init(0, 1, backend="host", address="127.0.0.1", port=free_port(), timeout=10.0, **kwargs)


# -- why backend='nccl' cannot run ---------------------------------------------------------------------------------

@pytest.mark.spawns
@no_gpu_only
def test_init_nccl_without_gpu_says_so():
    out = run_py(INIT_NCCL)
    assert out["error"] == "Unsupported"
    assert "backend='nccl' cannot run here" in out["message"]
    assert "no usable CUDA GPU" in out["message"] and "nvidia-smi" in out["message"]
    assert _C.cuda_probe()["reason"] in out["message"]  # the driver probe's own reason (libcuda.so.1 not found)


@pytest.mark.spawns
def test_init_nccl_without_nccl_says_how_to_install():
    out = run_py(INIT_NCCL, {"GPUCOLL_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert out["error"] == "Unsupported"
    msg = out["message"]
    assert "NCCL is not available" in msg and "GPUCOLL_NCCL_LIBRARY=/nonexistent/libnccl.so.2" in msg
    assert "pip install" in msg and "nvidia-nccl-cu1" in msg  # gpucoll._nccl.install_hint
    if not HAVE_GPU:
        assert "no usable CUDA GPU" in msg  # every missing piece is named at once


def test_problems_name_each_missing_piece():
    built = {"cuda_built": True}
    gpu = {"device_count": 1, "runtime_device_count": 1, "driver_version": 13000, "reason": ""}
    nccl = {"loaded": True, "version": 23203}
    assert _nccl_backend.problems(built, gpu, nccl) == []

    (msg,) = _nccl_backend.problems({"cuda_built": False}, gpu, nccl)
    assert "built without CUDA" in msg and "GPUCOLL_CUDA=on pip install" in msg and "nvcc" in msg

    nogpu = {"device_count": 0, "reason": "cuInit failed: CUDA_ERROR_NO_DEVICE (100)"}
    (msg,) = _nccl_backend.problems(built, nogpu, nccl)
    assert "no usable CUDA GPU" in msg and "CUDA_ERROR_NO_DEVICE" in msg

    old_driver = dict(gpu, runtime_device_count=0, runtime_reason="cudaErrorInsufficientDriver (35)")
    (msg,) = _nccl_backend.problems(built, old_driver, nccl)
    assert "cudaErrorInsufficientDriver" in msg

    (msg,) = _nccl_backend.problems(built, dict(gpu, driver_version=12040), {"loaded": False, "reason": "none found"})
    assert "NCCL is not available: none found" in msg and "nvidia-nccl-cu12" in msg  # CUDA 12 driver: cu12 wheel

    assert len(_nccl_backend.problems({"cuda_built": False}, nogpu, {"loaded": False, "reason": "x"})) == 3


@pytest.mark.skipif(_C.NCCL_BACKEND_BUILT, reason="this build has CUDA; the host-only build is checked elsewhere")
def test_host_only_build_refuses_with_rebuild_hint():
    with pytest.raises(Unsupported, match="rebuild"):
        _C.NcclComm(b"\0" * 128, 1, 0, 0, 1.0)
    with pytest.raises(Unsupported, match="built without CUDA"):
        _nccl_backend.check_usable()


@no_gpu_only
@pytest.mark.skipif(not _C.NCCL_BACKEND_BUILT, reason="needs the CUDA build")
def test_native_comm_without_driver_raises_cuda_error():
    from gpucoll import _nccl

    if not _nccl.load()["loaded"]:
        pytest.skip(helpers.missing_reason("nvidia.nccl", "NCCL not installed"))
    with pytest.raises(CudaError, match="cudaErrorInsufficientDriver") as info:
        _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0, 1.0)
    assert info.value.call.startswith("cudaGetDevice")
    with pytest.raises(CudaError):
        _C.cuda_pointer_info(BOGUS_PTR)
    with pytest.raises(InvalidArgument, match="128 bytes"):
        _C.NcclComm(b"short", 1, 0, 0, 1.0)


@no_gpu_only
def test_auto_is_host_without_gpu_and_env_can_force_nccl(monkeypatch):
    with host_comm() as comm:
        assert comm.backend == "host"
    c = gpucoll.init(0, 1, backend="auto", address="127.0.0.1", port=free_port(), timeout=10.0)
    assert c.backend == "host"
    c.close()
    monkeypatch.setenv("GPUCOLL_BACKEND", "nccl")
    with pytest.raises(Unsupported, match="no usable CUDA GPU"):
        gpucoll.init(0, 1, backend="auto", address="127.0.0.1", port=free_port(), timeout=10.0)


def test_device_argument_needs_the_nccl_backend():
    with pytest.raises(InvalidArgument, match="device= applies to the nccl backend"):
        gpucoll.init(0, 1, backend="host", device=0, address="127.0.0.1", port=free_port(), timeout=5.0)


# -- spawn ----------------------------------------------------------------------------------------------------------

def _never_called(comm):
    raise AssertionError("workers must not start")


@no_gpu_only
def test_spawn_nccl_without_gpu_refuses_before_starting_workers():
    start = time.monotonic()
    with pytest.raises(Unsupported, match=r"spawn\(backend='nccl', nranks=2\) cannot run here") as info:
        gpucoll.spawn(_never_called, 2, backend="nccl", timeout=10.0)
    assert "no usable CUDA GPU" in str(info.value)
    assert time.monotonic() - start < 10.0


def test_spawn_plan_shares_one_gpu_only_with_new_enough_nccl():
    built = {"cuda_built": True}
    one = {"device_count": 1, "runtime_device_count": 1, "driver_version": 13000}
    two = dict(one, device_count=2)
    new = {"loaded": True, "version": 23203, "version_string": "2.32.3"}
    old = {"loaded": True, "version": 22903, "version_string": "2.29.3"}
    plan = _nccl_backend.spawn_plan
    assert plan(2, "nccl", two, new, built, env={}) == ("nccl", {})
    assert plan(2, "nccl", one, new, built, env={}) == ("nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    with pytest.raises(Unsupported) as info:
        plan(2, "nccl", one, old, built, env={})
    msg = str(info.value)
    assert "2 ranks needs 2 GPUs, but 1 is visible" in msg and "NCCL >= 2.30.0" in msg and "2.29.3" in msg
    with pytest.raises(Unsupported, match="NCCL_MULTI_RANK_GPU_ENABLE='0' forbids it"):
        plan(3, "nccl", two, new, built, env={"NCCL_MULTI_RANK_GPU_ENABLE": "0"})
    assert plan(4, "host", one, old, built) == ("host", {})


@no_gpu_only
def test_spawn_plan_auto_is_host_here():
    assert _nccl_backend.spawn_plan(2, "auto") == ("host", {})


# -- version gates and device choice --------------------------------------------------------------------------------

def test_fp8_needs_nccl_2_24():
    fp8 = (_C.DType.float8_e4m3fn, _C.DType.float8_e5m2)
    for t in fp8:
        assert _C.nccl_dtype_min_version(t) == 22400 == _C.NCCL_FP8_VERSION
        _C.nccl_check_dtype(t, 22400)
        _C.nccl_check_dtype(t, 23203)
        with pytest.raises(Unsupported) as info:
            _C.nccl_check_dtype(t, 22305)
        msg = str(info.value)
        assert t.name in msg and "NCCL >= 2.24.0" in msg and "2.23.5" in msg
    for name in _buffers.SUPPORTED:
        t = getattr(_C.DType, name)
        assert _C.nccl_dtype_min_version(t) == 0
        _C.nccl_check_dtype(t, 21800)
    assert _C.dtype_size(fp8[0]) == 1 and _C.dtype_is_floating(fp8[1])
    assert _C.dtype_nccl_name(fp8[0]) == "f8e4m3"


def test_multi_rank_gpu_gate():
    assert not _C.nccl_multi_rank_gpu_supported(22903)
    assert _C.nccl_multi_rank_gpu_supported(23000)
    enabled = _nccl_backend.multi_rank_enabled
    assert enabled(23203, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert not enabled(23203, {})
    assert not enabled(22903, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"})


def test_device_choice():
    pick = _nccl_backend.pick_device
    assert pick(1, None, 2, False) == 1
    assert pick(3, None, 2, True) == 1
    assert pick(0, "cuda:1", 2, False) == 1 and pick(0, 1, 2, False) == 1 and pick(0, "1", 2, False) == 1
    with pytest.raises(InvalidArgument, match="local rank 2 has no GPU of its own: 2 visible"):
        pick(2, None, 2, False)
    with pytest.raises(InvalidArgument, match="not a visible GPU"):
        pick(0, 5, 2, False)
    with pytest.raises(InvalidArgument, match="device must be"):
        pick(0, True, 2, False)
    assert _nccl_backend.device_map(3, 2, False) == [(0, 0), (1, 1), (2, None)]
    assert _nccl_backend.device_map(3, 1, True) == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.spawns
def test_info_shows_the_device_map():
    out = subprocess.run([sys.executable, "-m", "gpucoll", "info"], capture_output=True, text=True, timeout=120,
                         check=False,
                         env=dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", RANK="1", WORLD_SIZE="2"))
    assert out.returncode == 0, out.stderr
    assert "nccl device per local rank (torchrun launcher" in out.stdout
    assert "local rank 1 -> " in out.stdout and "<- this process" in out.stdout


# -- buffers and streams --------------------------------------------------------------------------------------------

class FakeCAI:
    """A CUDA array by __cuda_array_interface__ only; its pointer is never dereferenced by the checks."""

    def __init__(self, shape=(4,), typestr="<f4", ptr=BOGUS_PTR, readonly=False, strides=None, stream=None,
                 mask=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                                         "version": 3, "strides": strides, "stream": stream, "mask": mask}


def test_cuda_array_interface_is_classified_as_cuda():
    buf = _buffers.resolve(FakeCAI(shape=(2, 3), typestr="<i4", stream=7), "x")
    assert buf.kind == "cai" and buf.device == "cuda" and buf.ptr == BOGUS_PTR
    assert buf.count == 6 and buf.itemsize == 4 and buf.dtype == _C.DType.int32 and buf.shape == (2, 3)
    assert buf.stream == 7 and _cuda_buffers.current_stream("cai", 0, buf.stream) == 7
    assert _buffers.resolve(FakeCAI(shape=(2, 3), strides=(12, 4)), "x").count == 6  # explicit C strides
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        _buffers.resolve(FakeCAI(shape=(2, 3), strides=(4, 8)), "x")
    with pytest.raises(Unsupported, match="bfloat16 and fp8 arrays must come as torch tensors or through DLPack"):
        _buffers.resolve(FakeCAI(typestr="<V2"), "x")
    with pytest.raises(Unsupported, match="complex64"):
        _buffers.resolve(FakeCAI(typestr="<c8"), "x")
    for _ in range(2):  # the second time through the typestr cache
        with pytest.raises(InvalidArgument, match="byte order"):
            _buffers.resolve(FakeCAI(typestr=">f4"), "x")
    with pytest.raises(Unsupported, match="masked"):
        _buffers.resolve(FakeCAI(mask=object()), "x")
    with pytest.raises(InvalidArgument, match="out must be writable"):
        _buffers.resolve(FakeCAI(readonly=True), "out", writable=True)
    with pytest.raises(InvalidArgument, match="malformed"):
        _buffers.resolve(type("Bad", (), {"__cuda_array_interface__": {"shape": (1,)}})(), "x")


def test_host_backend_rejects_cuda_buffers_naming_argument_and_backend():
    with host_comm() as comm:
        with pytest.raises(InvalidArgument) as info:
            comm.all_reduce(FakeCAI())
        msg = str(info.value)
        assert msg.startswith("x is a __cuda_array_interface__ array in CUDA memory") and "host backend" in msg
        with pytest.raises(InvalidArgument, match="^out is a __cuda_array_interface__"):
            comm.all_reduce(np.zeros(4, np.float32), out=FakeCAI())
        with pytest.raises(InvalidArgument, match="^x is a __cuda_array_interface__"):
            comm.broadcast(FakeCAI())


class DLPackView:
    """Re-exports a CPU torch tensor's DLPack capsule as if it lived on a CUDA device (for the parser only)."""

    def __init__(self, t, device=(2, 0)):
        self._t, self._device = t, device

    def __dlpack__(self, stream=None):
        return self._t.__dlpack__()

    def __dlpack_device__(self):
        return self._device


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "int64", "uint8"])
def test_dlpack_capsules_are_parsed(name):
    torch = helpers.require("torch")
    t = torch.zeros((3, 5), dtype=getattr(torch, name))
    buf = _buffers.resolve(DLPackView(t, (2, 1)), "x")
    assert buf.kind == "dlpack" and buf.device == "cuda:1" and buf.ptr == t.data_ptr()
    assert buf.dtype_name == name and buf.count == 15 and buf.shape == (3, 5) and buf.keep is not None
    assert _cuda_buffers.current_stream("dlpack", 1) == 0
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        _buffers.resolve(DLPackView(t.t()), "x")
    with pytest.raises(InvalidArgument, match="CPU memory"):
        _buffers.resolve(DLPackView(t, (1, 0)), "x")


def test_dlpack_offset_views_keep_their_offset():
    torch = helpers.require("torch")
    base = torch.arange(10, dtype=torch.float32)
    view = base[4:]
    buf = _buffers.resolve(DLPackView(view), "x")
    assert buf.ptr == view.data_ptr() and buf.count == 6


def test_torch_fp8_resolves_and_host_refuses_it():
    torch = helpers.require("torch")
    t = torch.zeros(8, dtype=torch.float8_e5m2)
    buf = _buffers.resolve(t, "x")
    assert buf.dtype == _C.DType.float8_e5m2 and buf.itemsize == 1
    with host_comm() as comm, pytest.raises(Unsupported, match="only the nccl backend handles fp8"):
        comm.all_gather(t)
    # The C++ host backend refuses them too (defence in depth).
    with pytest.raises(Unsupported, match="fp8 collectives need the nccl backend"), host_comm() as comm:
        comm._ops.impl.run("ring", 0, t.data_ptr(), t.data_ptr(), 8, _C.DType.float8_e5m2, _C.RedOp.sum, 0, 0)


def _fake_buffer(kind="torch", device="cuda:0", nbytes=16):
    return _buffers.Buffer(object(), kind, BOGUS_PTR, nbytes // 4, _C.DType.float32, "float32", 4, (nbytes // 4,),
                           device)


def test_nccl_placement_rule():
    check = _cuda_buffers.check_device
    check(_fake_buffer(device="cuda:1"), "x", 1)
    with pytest.raises(InvalidArgument) as info:
        check(_fake_buffer(device="cpu"), "x", 0)
    assert "x is a CPU tensor" in str(info.value) and "nccl backend" in str(info.value) and "x.to('cuda:0')" in \
        str(info.value)
    with pytest.raises(InvalidArgument, match="NumPy array"):
        check(_fake_buffer("numpy", "cpu"), "out", 0)
    with pytest.raises(InvalidArgument) as info:
        check(_fake_buffer(device="cuda:1"), "out", 0)
    assert "out is on cuda:1, but this communicator uses cuda:0" in str(info.value) and "device=1" in \
        str(info.value)
    check(_fake_buffer("cai", "cuda", nbytes=0), "x", 0)  # empty: nothing to ask the driver


def test_stream_arguments():
    handle = _cuda_buffers.stream_handle
    assert handle(0, 0) == 0 and handle(12345, 0) == 12345
    for bad in (True, -1, "s", 1.5):
        with pytest.raises(InvalidArgument, match="stream"):
            handle(bad, 0)

    class Protocol:
        def __cuda_stream__(self):
            return (0, 777)

    assert handle(Protocol(), 0) == 777

    class TorchLike:
        __module__ = "torch.cuda.streams"

        def __init__(self, dev):
            self.cuda_stream = 4242
            self.device = type("Dev", (), {"index": dev})()

        def __cuda_stream__(self):  # torch >= 2.6 streams implement the protocol too, which names no device
            return (0, self.cuda_stream)

    assert handle(TorchLike(0), 0) == 4242
    with pytest.raises(InvalidArgument, match="stream belongs to cuda:1, but this communicator uses cuda:0"):
        handle(TorchLike(1), 0)

    class CupyLike:
        __module__ = "cupy.cuda.stream"
        ptr = 99
        device_id = 0

        def __cuda_stream__(self):
            return (0, self.ptr)

    assert handle(CupyLike(), 0) == 99
    with pytest.raises(InvalidArgument, match="stream belongs to cuda:0, but this communicator uses cuda:1"):
        handle(CupyLike(), 1)


def test_host_backend_stream_and_async_rules():
    with host_comm() as comm:
        x = np.arange(6, dtype=np.float32)
        with pytest.raises(InvalidArgument, match="stream= applies to the nccl backend"):
            comm.all_reduce(x, stream=0)
        assert np.array_equal(comm.all_reduce(x.copy(), op=gpucoll.premul_sum(2.0)), 2 * x)  # host runs it too
        work = comm.all_gather(x, async_op=True)  # on the communicator's progress thread
        assert work.wait() and work.is_completed() and work.synchronize() is None
        assert np.array_equal(work.result(), x)
        assert comm.broadcast(x, async_op=True).result() is x
        gathered = comm.gather(x, async_op=True)
        assert gathered.wait() and np.array_equal(gathered.result(), x)
    comm = host_comm()
    comm.abort()
    with pytest.raises(InvalidUsage, match="abort\\(\\) was called"):
        comm.all_reduce(x)
    comm.abort()  # idempotent


# -- Work and the watchdog, on a fake native communicator -----------------------------------------------------------

class FakeNative:
    def __init__(self, seq, done=False):
        self.seq, self.done, self.what, self.state = seq, done, f"all_reduce #{seq} (float32 x 4)", "launched"
        self.waited_on = []
        self.synced = False

    def query(self):
        return self.done

    def wait_on(self, stream):
        self.waited_on.append(stream)

    def synchronize(self):
        self.synced = True


class FakeComm:
    """Stands in for _C.NcclComm: poll() returns what the test sets; calls are recorded."""

    def __init__(self):
        self.issued = 0
        self.aborted = None
        self.closed = False
        self.status = {}
        self.calls = []

    def poll(self):
        base = {"completed": [], "pending": False, "oldest_seq": 0, "oldest_what": "", "oldest_age_s": 0.0,
                "issued": self.issued, "async_error": "", "async_text": "", "usable": self.aborted is None}
        base.update(self.status)
        return base

    def collective(self, coll, in_ptr, out_ptr, count, dtype, op, root, stream, async_op, premul):
        self.issued += 1
        self.calls.append((coll, in_ptr, count, op, root, stream, async_op, premul))
        return FakeNative(self.issued) if async_op else None

    @property
    def usable(self):
        """As NcclComm.usable: false once aborted or closed."""
        return self.aborted is None and not self.closed

    def abort(self, why):
        self.aborted = why

    def close(self):
        self.closed = True


@pytest.fixture
def fast_watchdog(monkeypatch):
    monkeypatch.setenv("GPUCOLL_NCCL_WATCHDOG_MS", "10")


def make_backend(store, comm=None, rank=0, world_size=3, timeout=0.2):
    return _nccl_backend.Nccl(comm or FakeComm(), rank=rank, world_size=world_size, device=0, store=store,
                              prefix="t/", timeout=timeout)


def wait_for(cond, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_watchdog_timeout_names_operation_seq_and_missing_ranks(store, fast_watchdog):
    comm = FakeComm()
    comm.issued = 5
    store.set("t/seq/1", b"5")  # rank 1 reached operation 5; rank 2 is behind; rank 0 is this backend
    store.set("t/seq/2", b"4")
    comm.status = {"pending": True, "oldest_seq": 5, "oldest_what": "all_reduce #5 (float32 x 4)",
                   "oldest_age_s": 1.0}
    backend = make_backend(store, comm)
    try:
        assert wait_for(lambda: comm.aborted is not None)
        err = backend._error
        assert isinstance(err, CollectiveTimeout) and err.ranks == (2,)
        assert "all_reduce #5 (float32 x 4) did not complete within the timeout of 0.2 s on rank 0 of 3" in err.message
        assert "ranks that had not reached operation #5: [2]" in err.message and err.call == "all_reduce"
        assert store.get("t/seq/0") == b"5"  # this rank's progress was published
        src = _fake_buffer()
        with pytest.raises(CollectiveTimeout, match="ranks that had not reached") as first:
            backend.collective(0, "auto", src, src, 4, None, 0, None, False)
        with pytest.raises(CollectiveTimeout) as second:
            backend.barrier()
        assert first.value is not second.value and first.value is not err  # a fresh exception per raise
    finally:
        backend.close()
    assert comm.closed


def test_a_second_thread_failing_raises_the_failure_the_first_is_recording(store):
    """The watchdog names the lost ranks of an ncclRemoteError from their heartbeats, which takes seconds; a call
    that fails meanwhile (its native call found the communicator aborted) must raise that failure, not return
    before there is one (it used to raise AttributeError: the recorded error was still None)."""
    comm = FakeComm()
    backend = make_backend(store, comm, timeout=5.0)
    naming = threading.Event()

    def slow_name_lost(err, should_stop):
        naming.set()
        time.sleep(0.5)
        return RemoteError(f"{err.message}; lost: rank(s) [2]", call=err.call, ranks=(2,))

    backend._heartbeat.name_lost = slow_name_lost
    remote = NcclError("ncclRemoteError: remote process exited or there was a network error", call="all_reduce")
    first = threading.Thread(target=backend._fail, args=(remote,))
    try:
        first.start()
        assert naming.wait(5)
        comm.aborted = "aborted by the watchdog"  # what the native call sees: the communicator is not usable
        t0 = time.monotonic()
        raised = backend._native_failed(NcclError("ncclInvalidUsage: the communicator was aborted"), 1)
        assert type(raised) is RemoteError and raised.ranks == (2,) and "lost: rank(s) [2]" in raised.message
        assert 0.2 < time.monotonic() - t0 < 5.0  # it waited for the first thread's error
        first.join(5)
        assert backend._error.ranks == (2,) and raised is not backend._error
    finally:
        backend.close()


def test_watchdog_publishes_progress_without_waiting_behind_the_ranks_own_store_wait(store):
    """The watchdog shares the rank's store client with the main thread, which may wait in a barrier for the whole
    timeout. Publishing progress must not queue behind that wait (the watchdog would then name no timed-out
    operation until it ended): it is skipped while the client is busy, and done at a later poll."""
    client = TCPStore("127.0.0.1", store.port, is_server=False, timeout=10.0)
    comm = FakeComm()
    backend = make_backend(client, comm)
    try:
        waiter = threading.Thread(target=lambda: client.get("released", timeout=5.0))
        waiter.start()
        deadline = time.monotonic() + 2
        while not client._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        backend._publish(3)
        assert time.monotonic() - t0 < 0.5 and backend._published != 3 and not store.check("t/seq/0")
        store.set("released", b"1")
        waiter.join(5)
        backend._publish(3)
        assert backend._published == 3 and store.get("t/seq/0") == b"3"
    finally:
        backend.close()
        client.close()


def test_watchdog_timeout_when_every_rank_issued_it(store, fast_watchdog):
    comm = FakeComm()
    comm.issued = 2
    store.set("t/seq/1", b"2")
    comm.status = {"pending": True, "oldest_seq": 2, "oldest_what": "broadcast #2 (int8 x 1, root 0)",
                   "oldest_age_s": 5.0}
    backend = make_backend(store, comm, world_size=2)
    try:
        assert wait_for(lambda: backend._error is not None)
        assert "every rank had issued operation #2" in backend._error.message and backend._error.ranks == ()
    finally:
        backend.close()


def test_a_stuck_send_names_its_peer_not_sequence_counts(store, fast_watchdog):
    """Ranks issue different numbers of sends and receives: the timeout names the peer of the stuck one."""
    comm = FakeComm()
    comm.issued = 7
    store.set("t/seq/1", b"0")  # rank 1 issued nothing: it is not part of this exchange and must not be named
    comm.status = {"pending": True, "oldest_seq": 7, "oldest_what": "send #7 (4096 bytes to rank 2)",
                   "oldest_age_s": 1.0}
    backend = make_backend(store, comm)
    try:
        assert wait_for(lambda: backend._error is not None)
        err = backend._error
        assert isinstance(err, CollectiveTimeout) and err.ranks == (2,) and err.call == "send"
        assert "its peer, rank 2, did not post the matching operation" in err.message
    finally:
        backend.close()


def test_watchdog_reports_async_nccl_errors(store, fast_watchdog):
    comm = FakeComm()
    comm.status = {"async_error": "ncclRemoteError", "async_text": "ncclRemoteError (remote process exited)",
                   "pending": True, "oldest_what": "all_gather #3 (float32 x 8)"}
    backend = make_backend(store, comm)
    try:
        assert wait_for(lambda: backend._error is not None)
        err = backend._error
        # NCCL's "remote" error names nobody; gpucoll names the ranks whose heartbeat through the store stood still
        # (backends/nccl_liveness.py): here ranks 1 and 2, which never beat (only rank 0 exists).
        assert isinstance(err, RemoteError) and err.call == "ncclCommGetAsyncError" and err.ranks == (1, 2), err
        assert "while all_gather #3 (float32 x 8) was pending" in err.message and "remote process exited" in err.message
        assert comm.aborted and "remote process exited" in comm.aborted
        work = _C.Work.on_device(FakeNative(3), "cai", 0, backend._raise_if_failed)
        with pytest.raises(RemoteError):
            work.is_completed()
        with pytest.raises(RemoteError):
            work.synchronize()
    finally:
        backend.close()


def test_async_work_keeps_buffers_until_complete_and_waits_on_current_stream(store, fast_watchdog, monkeypatch):
    comm = FakeComm()
    joins = []  # (consumer, producer, device): the fake streams must never reach the CUDA runtime
    monkeypatch.setattr(_C, "cuda_stream_wait", lambda *a: joins.append(a))
    backend = make_backend(store, comm, timeout=60.0)
    try:
        src = _buffers.resolve(FakeCAI(stream=55), "x")
        assert backend.collective(0, "auto", src, src, 4, None, 0, None, False) is None  # synchronous: no Work
        assert comm.calls[-1][5] == 55 and joins == []  # ordered on the producer's stream
        work = backend.collective(0, "auto", src, src, 4, gpucoll.premul_sum(0.25), 0, 9, True)
        assert comm.calls[-1][3] == _C.RedOp.sum and comm.calls[-1][7] == 0.25 and comm.calls[-1][5] == 9
        assert joins == [(9, 55, 0)]  # stream= waits for the producer's stream first
        assert type(work) is gpucoll.Work is _C.Work and len(backend._inflight) == 1
        assert not work.is_completed()
        work.wait()
        assert work._native.waited_on == [0]  # no framework stream for a __cuda_array_interface__ array: legacy
        work._native.done = True
        assert wait_for(lambda: not backend._inflight)  # the watchdog let go of the buffers
        assert work.is_completed()
        work.synchronize()
        assert work._native.synced and "all_reduce #2" in repr(work)
    finally:
        backend.close()


def test_completed_work_is_trivial():
    w = _C.Work(42)
    assert w.wait() and w.is_completed() and w.synchronize() is None and w.result() == 42
