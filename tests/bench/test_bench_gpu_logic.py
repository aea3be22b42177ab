"""gpucoll-bench's GPU paths on a CPU, through small fakes: which stream each CUDA-side step of devmem.CudaMem runs on
(allocation, upload, download, events, graph capture), what --backend custom refuses or skips before any virtual
rank starts, --check on virtual ranks, ranks sharing GPUs under a launcher, and the peer runner's handling of a rank
that dies. The real GPU runs are tests/bench/test_bench_gpu.py."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import helpers
import numpy as np
import pytest
from test_bench_cli import rows
from test_bench_modes import TINY, FakeVirtualRanks

from gpucoll.bench import cli, devmem, harness, launch, peers, virtual


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "GPUCOLL_TUNING_FILE"):
        monkeypatch.delenv(v, raising=False)


# -- a torch stand-in that records the stream of every CUDA-side step ------------------------------------------------
class _Stream:
    def __init__(self, name, log):
        self.name, self._log = name, log

    def synchronize(self):
        self._log.append(("sync", self.name))


class _Tensor:
    def __init__(self, arr, cuda, log):
        self.a, self._cuda, self._log = arr, cuda, log

    def __getitem__(self, key):
        return _Tensor(self.a[key], self._cuda, self._log)

    def view(self, dtype):
        return _Tensor(self.a.view(dtype), self._cuda, self._log)

    def copy_(self, src, non_blocking=False):
        self._log.append(("copy", self._cuda.current.name))
        self.a[...] = src.a.view(self.a.dtype)
        return self

    def cpu(self):
        self._log.append(("download", self._cuda.current.name))
        return _Tensor(self.a.copy(), self._cuda, self._log)

    def numpy(self):
        return self.a


def fake_torch():
    """A module with the part of torch's API devmem.CudaMem uses; .log holds (step, stream name) pairs."""
    log: list = []
    cuda = types.SimpleNamespace(log=log)
    cuda.current = _Stream("default", log)

    @contextlib.contextmanager
    def stream(s):
        prev, cuda.current = cuda.current, s
        try:
            yield
        finally:
            cuda.current = prev

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, s=None):
            log.append(("event", (s or cuda.current).name))

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0  # ms

    class CUDAGraph:
        def replay(self):
            log.append(("replay", cuda.current.name))

    cuda.stream = stream
    cuda.device = lambda d: contextlib.nullcontext()
    cuda.ExternalStream = lambda ptr, device=None: _Stream(f"external {ptr}", log)
    cuda.current_stream = lambda device=None: cuda.current
    cuda.get_device_name = lambda d: "Fake GPU"
    cuda.Event, cuda.CUDAGraph = Event, CUDAGraph
    cuda.graph = lambda g: stream(_Stream("capture", log))
    cuda.synchronize = lambda device=None: log.append(("device sync", None))
    torch = types.ModuleType("torch")
    torch.cuda, torch.log, torch.uint8, torch.float32, torch.int64 = cuda, log, np.uint8, np.float32, np.int64
    torch.zeros = lambda n, dtype, device: (log.append(("alloc", cuda.current.name)),
                                            _Tensor(np.zeros(n, dtype), cuda, log))[1]
    torch.from_numpy = lambda a: _Tensor(a, cuda, log)
    return torch


def test_virtual_rank_memory_stays_on_its_stream(monkeypatch):
    """A virtual rank's stream is non-blocking: its buffers' zero fill, uploads, downloads and timing events must
    all be on it (a zero fill left on the default stream could land after the first upload)."""
    torch = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    mem = devmem.CudaMem(0, stream=0x1234, lib="torch")
    host = np.arange(16, dtype=np.uint8)
    dev = mem.twin(host)
    mem.upload(host, dev, 4, 12)
    assert (dev.a[4:12] == host[4:12]).all() and not dev.a[:4].any()
    host[:] = 0
    mem.download(dev, host, 0, 16)
    assert host[4:12].tolist() == list(range(4, 12))
    timer = mem.timer()
    timer.start()
    assert timer.stop() == pytest.approx(2e-3)
    assert {where for _, where in torch.log} == {f"external {0x1234}"}, torch.log
    assert [step for step, _ in torch.log][:3] == ["alloc", "copy", "sync"]


def test_graph_capture_issues_on_the_capture_stream(monkeypatch):
    """-G: the collective runs while torch's capture stream is current (where gpucoll's nccl backend enqueues),
    and the graph is launched and timed on the run's stream."""
    torch = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    mem = devmem.CudaMem(0, lib="torch")
    seen = []
    replay = mem.capture(lambda: seen.append(torch.cuda.current_stream(0).name))
    assert seen == ["capture"]
    timer = mem.timer()
    timer.start()
    replay()
    timer.stop()
    assert torch.log[-3:] == [("event", "default"), ("replay", "default"), ("event", "default")]


# -- --backend custom: what the kernels cannot run is refused (or skipped for "all") before the run ----------------------
@pytest.fixture
def fake_vr(monkeypatch):
    FakeVirtualRanks.instances = []
    monkeypatch.setattr(virtual, "_factory", lambda: FakeVirtualRanks)
    monkeypatch.setattr(virtual, "runs", lambda coll: coll == "all_reduce")  # what the real VirtualRanks runs
    monkeypatch.setattr(virtual, "problem", lambda coll=None: None if coll in (None, "all_reduce") else "no")
    monkeypatch.setattr(devmem, "for_comm", lambda comm, staged=False: devmem.StagedHostMem())
    return FakeVirtualRanks


def test_custom_refuses_named_dtypes_and_ops_without_kernels(fake_vr, capsys):
    base = ["all_reduce", *TINY, "--backend", "custom", "--nranks", "2"]
    assert cli.main([*base, "-d", "float,int8"]) == cli.EXIT_USAGE
    assert "-d int8 cannot run on --backend custom" in capsys.readouterr().err
    assert cli.main([*base, "-o", "prod"]) == cli.EXIT_USAGE
    assert "op prod has no custom kernel" in capsys.readouterr().err
    assert not fake_vr.instances  # refused before any virtual rank existed


def test_custom_skips_what_all_includes_without_kernels(fake_vr, capsys):
    helpers.require("torch", "-d all includes bfloat16, whose buffers are torch tensors")
    assert cli.main(["all_reduce", *TINY, "--backend", "custom", "--nranks", "2", "-d", "all", "-o", "all"]) == 0
    out = capsys.readouterr().out
    assert "skipped int8, uint8, int64" in out and "skipped prod" in out
    got = rows(out)
    assert {r[2] for r in got} == {"int32", "half", "float", "double", "bfloat16"}
    assert {r[3] for r in got} == {"sum", "max", "min", "avg"} and all(r[8] == "0" for r in got)


def test_custom_algorithms_are_the_kernels_ones(fake_vr, capsys):
    """The host schedules have algorithms gpucoll's kernels lack: named, refused before any rank starts; from --algo
    all, skipped, and dbt (the tree kernel under another name) runs once, as tree."""
    base = ["all_reduce", *TINY, "--backend", "custom", "--nranks", "2"]
    assert cli.main([*base, "--algo", "ring,halving_doubling"]) == cli.EXIT_USAGE
    assert "--algo halving_doubling cannot run on --backend custom" in capsys.readouterr().err
    assert not fake_vr.instances
    assert cli.main([*base, "--algo", "all"]) == 0
    out = capsys.readouterr().out
    assert "skipped halving_doubling, hierarchical, dbt" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("# Algorithm: ")] == [
        "ring", "tree", "oneshot", "twoshot"]


def test_check_on_virtual_ranks_skips_what_they_cannot_run(fake_vr, monkeypatch, capsys):
    monkeypatch.setattr(cli, "resolve_backend", lambda b, coll=None: b)
    assert cli.main(["--health-check", "--backend", "custom", "--colls", "all_reduce,broadcast,sendrecv"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "all_reduce      OK" in out and "broadcast       SKIP" in out and "sendrecv        SKIP" in out
    assert "check: OK (1 runs; backends: custom)" in out


def test_runnable_rule():
    notes = []
    why = {"b": "no b"}.get
    assert cli._runnable(["a", "b"], True, "-d", "X", notes, why) == ["a"] and "skipped b (no b)" in notes[0]
    with pytest.raises(cli.UsageError, match="-d b cannot run on X: no b; pick from a"):
        cli._runnable(["a", "b"], False, "-d", "X", [], why)
    with pytest.raises(cli.UsageError, match="-d b cannot run"):
        cli._runnable(["b"], True, "-d", "X", [], why)  # "all" but nothing left


# -- ranks sharing GPUs under a launcher -------------------------------------------------------------------------------
def test_launcher_ranks_beyond_the_gpus_share_them(monkeypatch):
    from gpucoll import _C
    from gpucoll.backends import nccl as _nccl_backend
    from gpucoll.errors import Unsupported

    monkeypatch.setattr(_C, "cuda_probe", lambda: {"device_count": 1})
    monkeypatch.delenv(_nccl_backend.MULTI_RANK_ENV, raising=False)
    monkeypatch.setattr(_nccl_backend, "spawn_plan", lambda n, b: ("nccl", {_nccl_backend.MULTI_RANK_ENV: "1"}))
    p = harness.Params()
    launch.share_gpus(p, 1)  # one rank per GPU: nothing to share
    assert _nccl_backend.MULTI_RANK_ENV not in os.environ and not p.notes
    launch.share_gpus(p, 2)
    assert os.environ[_nccl_backend.MULTI_RANK_ENV] == "1" and "share GPUs" in p.notes[0]

    def refuse(n, b):
        raise Unsupported("the loaded NCCL is 2.27.3")

    monkeypatch.setattr(_nccl_backend, "spawn_plan", refuse)
    with pytest.raises(cli.UsageError, match="2.27.3"):
        launch.share_gpus(p, 2)


def test_torch_peer_sharing_a_gpu_needs_a_multi_rank_nccl(monkeypatch):
    torch = helpers.require("torch")
    from gpucoll import _C

    monkeypatch.setattr(_C, "cuda_probe", lambda: {"device_count": 1})
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    assert peers._torch_shares_gpus_problem(1) is None
    assert "2.27.7" in peers._torch_shares_gpus_problem(2)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 32, 3))
    assert peers._torch_shares_gpus_problem(2) is None


# -- the peer runner -----------------------------------------------------------------------------------------------------
def _dies(rank, nranks, port, results):
    if rank == 1:
        os._exit(7)
    results.put((rank, {"ok": 1}, None))


@pytest.mark.spawns
def test_peer_rank_that_dies_fails_fast():
    helpers.require("torch")
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 7"):
        peers.run_local_ranks(_dies, 2, (), timeout=120.0, what="--compare (test)")
    assert time.monotonic() - t0 < 60


def test_max_bytes_fit_the_gpu(monkeypatch):
    """nccl-tests' "Reducing maxBytes": two device twins per rank must fit the smallest GPU, ranks sharing it."""
    from gpucoll import _C

    gpu = 8 << 30
    monkeypatch.setattr(_C, "cuda_probe", lambda: {"device_count": 2, "devices": [{"total_memory": gpu}] * 2})
    for backend, ranks, per_gpu in (("nccl", 2, 1), ("nccl", 4, 2), ("custom", 4, 4)):
        p = harness.Params(backend=backend, minbytes=8, maxbytes=1 << 40)
        cli._fit_memory(p, ranks)
        assert p.maxbytes <= int(gpu * 0.9) // (2 * per_gpu) and "due to memory limitation" in p.notes[-1]
