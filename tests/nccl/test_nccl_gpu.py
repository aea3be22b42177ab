"""The NCCL backend on a GPU, or on gpucoll's emulated CUDA device with its NCCL stand-in (every test is
@pytest.mark.gpu: skipped with the reason where no CUDA device is usable).

* Correctness runs at world sizes 2 and 3, ranks spawned once per world size for the whole module
  (gpucoll.spawn(backend='nccl'); ranks share the GPU through NCCL's multi-rank mode where there are fewer GPUs):
  every collective x dtype x op (fp8 where NCCL and the GPU have it) and premul_sum, every root, the grouped
  send/recv path of NCCL < 2.28, send/recv in groups, async Work, groups, ordering on the caller's stream, and CUDA
  graph capture with 100 replays. Outputs are pre-filled with a sentinel; inputs hold a distinct value per element.
* Array providers: gpucoll.testing.DeviceArray everywhere; torch and CuPy CUDA arrays only on a real GPU (skipped with
  the reason on the emulated device).
* A rank that never arrives (the watchdog names it), abort(), GPUCOLL_NCCL_BLOCKING_OPS=1, and in-process checks at
  world size 1 (bad inputs, DLPack and __cuda_array_interface__ inputs).
* A world size this machine cannot run (one GPU, NCCL < 2.30: the GPU image's NCCL was 2.28.9) skips with that
  reason; .ci/gpu's summary counts every skip reason, so the gap stays visible.

tests/nccl/nccl_ranks.py holds what the ranks run; tests/nccl/test_nccl_emulated.py what only the stand-in can do (faults,
NCCL versions, device shapes).
"""

from __future__ import annotations

import importlib.util

import gpu_arrays
import helpers
import nccl_ranks
import numpy as np
import pytest
from nccl_ranks import FP8, PROVIDERS, Arrays, check, premul_for

import gpucoll
from gpucoll import _C
from gpucoll._spawn import free_port
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

WORLDS = (2, 3)
REPLAYS = 100


def emulated() -> bool:
    return bool(_C.build_info().get("cuda_emulated"))


def nccl_version() -> int:
    from gpucoll import _nccl

    return int(_nccl.load().get("version") or 0)


def fp8_usable() -> str | None:
    """None when fp8 collectives can run here, else why not."""
    if nccl_version() < _C.NCCL_FP8_VERSION:
        return f"NCCL {nccl_version()} < 2.24 has no fp8"
    devices = _C.cuda_probe()["devices"]
    if not devices or devices[0]["major"] < 9:
        return "fp8 reductions need compute capability 9.0+"
    return None


def provider_problem(kind: str) -> str | None:
    """Why arrays of `kind` cannot be made here (None: they can)."""
    if kind == "device_array":
        return None
    if emulated():
        return (f"{kind} CUDA arrays need a real GPU: this is gpucoll's emulated CUDA device, where only "
                f"gpucoll.testing.DeviceArray allocates")
    if importlib.util.find_spec(kind) is None:
        return f"{kind} is not installed"
    if kind == "torch":
        import torch

        return None if torch.cuda.is_available() else "torch has no CUDA here"
    import cupy

    return None if cupy.cuda.is_available() else "CuPy has no CUDA here"


def live_providers() -> list:
    return [k for k in PROVIDERS if provider_problem(k) is None]


def ops_for(dtype: str) -> list:
    return list(helpers.OPS) + [premul_for(dtype)]


ALL_DTYPES = tuple(helpers.DTYPES) + FP8
CASES = ([f"reduce/{d}/{o}" for d in ALL_DTYPES for o in (*helpers.OPS, "premul")]
         + [f"move/{d}" for d in ALL_DTYPES]
         + [f"grouped/{d}" for d in ("float32", "int8", "bfloat16")]
         + ["p2p", "async", "group", "stream", "graph"])


# -- what the ranks run beyond nccl_ranks.battery: streams and graphs need the provider's own stream API ------------

def stream_order(comm, A: Arrays, failures: list) -> None:
    """An operation on an explicit stream runs after the work queued there before it (and an async one too: the
    internal stream waits for the caller's). A long copy holds the stream first; the collective must see its data."""
    W, r = comm.world_size, comm.rank
    vals = np.arange(4096, dtype=np.float32) + 7 * r
    want = sum(np.arange(4096, dtype=np.float32) + 7 * q for q in range(W)).astype(np.float32)
    for async_op in (False, True):
        tag = "async " if async_op else ""
        if A.kind == "torch":
            torch = A._torch
            s = torch.cuda.Stream()
            x = A.empty(4096, "float32")
            y = A.empty(4096, "float32")
            src = A.put(vals, "float32")
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.cuda._sleep(100_000_000)
                x.copy_(src)
            work = comm.all_reduce(x, out=y, stream=s, async_op=async_op)
            (work.synchronize() if async_op else s.synchronize())
        elif A.kind == "device_array":
            dev = A.device
            s = _C.CudaStream(dev)
            pad_src, pad_dst = A.empty(8 << 20, "float32"), A.empty(8 << 20, "float32")
            x = A.empty(4096, "float32")
            y = A.empty(4096, "float32")
            src = A.put(vals, "float32")
            _C.cuda_copy(pad_dst.ptr, pad_src.ptr, pad_src.nbytes, dev, s.handle)  # ~32 MiB ahead of the fill
            _C.cuda_copy(x.ptr, src.ptr, x.nbytes, dev, s.handle)
            work = comm.all_reduce(x, out=y, stream=s.handle, async_op=async_op)
            (work.synchronize() if async_op else s.synchronize())
        else:
            failures.append("SKIP stream ordering is checked with torch and DeviceArray")
            return
        check(A.get(y, "float32"), want, f"{tag}all_reduce after the stream's earlier copy", failures)
    if A.kind == "device_array":
        cai_producer_stream(comm, A, vals, want, failures)


def cai_producer_stream(comm, A: Arrays, vals, want, failures: list) -> None:
    """__cuda_array_interface__ v3: with stream= naming another stream, the operation waits for the interface's
    "stream" (the producer's), where a long copy and then the fill are still queued."""
    dev = A.device
    producer, consumer = _C.CudaStream(dev), _C.CudaStream(dev)
    pad_src, pad_dst = A.empty(8 << 20, "float32"), A.empty(8 << 20, "float32")
    x, y, src = A.empty(4096, "float32"), A.empty(4096, "float32"), A.put(vals, "float32")
    _C.cuda_copy(pad_dst.ptr, pad_src.ptr, pad_src.nbytes, dev, producer.handle)
    _C.cuda_copy(x.ptr, src.ptr, x.nbytes, dev, producer.handle)

    class Produced:
        @property
        def __cuda_array_interface__(self):
            return dict(x.__cuda_array_interface__, stream=producer.handle)

    comm.all_reduce(Produced(), out=y, stream=consumer.handle)
    consumer.synchronize()
    check(A.get(y, "float32"), want, "all_reduce of a CAI array still being produced on its stream", failures)
    producer.synchronize()


def graph(comm, A: Arrays, failures: list) -> None:
    """all_reduce(x, out=y) then x <- y captured into a CUDA graph and replayed: x = W^k * x0 after k replays, which
    counts the replays (float64; sums of equal values round the same in any order)."""
    W = comm.world_size
    x0 = np.arange(1, 257, dtype=np.float64)
    x, y = A.put(x0, "float64"), A.empty(256, "float64")
    if A.kind == "torch":
        torch = A._torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(x, out=y)  # warm-up outside the capture (NCCL connects lazily)
            x.copy_(torch.from_numpy(x0).to(x.device))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            comm.all_reduce(x, out=y)
            x.copy_(y)
        for _ in range(REPLAYS):
            g.replay()
        torch.cuda.synchronize()
    elif A.kind == "device_array":
        dev = A.device
        s = _C.CudaStream(dev)
        comm.all_reduce(x, out=y, stream=s.handle)  # warm-up outside the capture
        s.synchronize()
        g = _C.MultiStreamGraph(dev, [s.handle])
        g.begin()
        comm.all_reduce(x, out=y, stream=s.handle)
        _C.cuda_copy(x.ptr, y.ptr, x.nbytes, dev, s.handle)
        g.end()
        g.replay(REPLAYS)
        s.synchronize()
    else:
        failures.append("SKIP graph capture is checked with torch and DeviceArray")
        return
    want = x0.copy()
    for _ in range(REPLAYS):
        want = want * W
    check(A.get(x, "float64"), want, f"x after {REPLAYS} replays", failures)
    check(A.get(y, "float64"), want, f"y after {REPLAYS} replays", failures)


def _battery_worker(comm, kinds, fp8: bool):
    dtypes = list(helpers.DTYPES) + (list(FP8) if fp8 else [])
    out = {}
    for kind in kinds:
        res = nccl_ranks.battery(comm, kind, dtypes, ops_for)
        A = Arrays(kind, int(comm.device.split(":")[1]))
        for case, fn in (("stream", stream_order), ("graph", graph)):
            failures: list = []
            try:
                fn(comm, A, failures)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"raised {type(exc).__name__}: {exc}")
            res[case] = failures
        out[kind] = res
    return out


_RESULTS: dict = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"ws{w}")
def world_results(request):
    """(world size, every rank's {provider: {case: failures}}), from one spawn per world size."""
    W = request.param
    if W not in _RESULTS:
        gpu_arrays.require_nccl_ranks(W)
        _RESULTS[W] = gpucoll.spawn(_battery_worker, W, args=(live_providers(), fp8_usable() is None),
                                    backend="nccl", timeout=120.0)
    return W, _RESULTS[W]


@pytest.mark.parametrize("kind", PROVIDERS)
@pytest.mark.parametrize("case", CASES)
def test_collectives(world_results, case, kind):
    why = provider_problem(kind)
    if why:
        pytest.skip(why)
    if any(d in case for d in FP8) and fp8_usable():
        pytest.skip(fp8_usable())
    _, per_rank = world_results
    failures = []
    for r, res in enumerate(per_rank):
        got = res[kind].get(case)
        if got is None:
            skipped = [v for k, v in res[kind].items() if case.startswith(k + "/")]
            if skipped and skipped[0][0].startswith("SKIP"):
                pytest.skip(skipped[0][0][5:])
            failures.append(f"rank {r}: case {case} did not run")
            continue
        if got and got[0].startswith("SKIP"):
            pytest.skip(got[0][5:])
        failures += [f"rank {r}: {f}" for f in got]
    assert not failures, helpers.format_failures(failures)


# -- world size 2: kinds that need ranks of their own ----------------------------------------------------------------

def _blocking_worker(comm, kinds):
    """GPUCOLL_NCCL_BLOCKING_OPS=1: the operations run on a blocking communicator split off the init's."""
    failures = [] if comm._ops.native.blocking else ["the communicator is not blocking"]
    for kind in kinds:
        A = Arrays(kind, int(comm.device.split(":")[1]))
        for dtype in ("float32", "bfloat16", "int32"):
            for op in helpers.OPS:
                nccl_ranks.reductions(comm, A, dtype, op, failures)
            nccl_ranks.movement(comm, A, dtype, failures)
        nccl_ranks.async_work(comm, A, failures)
        nccl_ranks.p2p(comm, A, failures)
        graph(comm, A, failures)
    return [f for f in failures if not f.startswith("SKIP")]


def test_ws2_blocking_ops(monkeypatch):
    gpu_arrays.require_nccl_ranks(2)
    monkeypatch.setenv("GPUCOLL_NCCL_BLOCKING_OPS", "1")  # the spawned ranks inherit it
    results = gpucoll.spawn(_blocking_worker, 2, args=(live_providers(),), backend="nccl", timeout=120.0)
    failures = helpers.merge_rank_failures([{"f": r} for r in results], "f")
    assert not failures, helpers.format_failures(failures)


def _missing_worker(comm):
    """Rank 1 never issues the collective: rank 0's watchdog must abort and name it. Rank 1 leaves once rank 0 has
    raised (told through the store), so nothing depends on how long anything takes."""
    A = Arrays("device_array", int(comm.device.split(":")[1]))
    x = A.put(np.ones(16, np.float32), "float32")
    comm.all_reduce(x)  # both ranks: connected and in step
    if comm.rank == 1:
        comm._store.get("test/missing/seen", timeout=60.0)
        comm.abort()
        return []
    try:
        # Either the call itself times out (a connection waiting for rank 1), or it is enqueued and the watchdog
        # aborts it: synchronize() then returns (the abort ends it) and raises the recorded CollectiveTimeout.
        comm.all_reduce(x, async_op=True).synchronize()
        comm.all_reduce(x)
        problem = ["no CollectiveTimeout"]
    except CollectiveTimeout as e:
        problem = [] if e.ranks == (1,) and "all_reduce #2" in str(e) else [f"wrong timeout: {e!r}"]
    try:
        comm.all_reduce(x)
        problem.append("a call after the timeout did not raise")
    except CollectiveTimeout:
        pass
    comm._store.set("test/missing/seen", b"1")
    return problem


def test_ws2_watchdog_names_the_missing_rank():
    gpu_arrays.require_nccl_ranks(2)
    results = gpucoll.spawn(_missing_worker, 2, backend="nccl", timeout=4.0)
    assert results == [[], []], results


def _abort_worker(comm):
    """abort() while an operation waits for a peer that never comes: it returns, ends the operation, and later calls
    raise InvalidUsage naming the abort."""
    A = Arrays("device_array", int(comm.device.split(":")[1]))
    x = A.put(np.arange(64, dtype=np.int32), "int32")
    comm.all_reduce(x)
    problems = []
    if comm.rank == 0:
        work = comm.all_reduce(x, async_op=True)  # rank 1 never joins it
        comm.abort()
        work_done = False
        try:
            work.synchronize()
            work_done = True
        except InvalidUsage:
            work_done = True  # the communicator is closed: also an answer, not a hang
        if not work_done:
            problems.append("synchronize() after abort() did not return")
    else:
        comm.abort()  # before or after rank 0's operation: either way that one waits until rank 0's abort
    try:
        comm.all_reduce(x)
        problems.append("all_reduce after abort() did not raise")
    except InvalidUsage as e:
        if "abort" not in str(e):
            problems.append(f"the error after abort() does not say so: {e}")
    return problems


def test_ws2_abort_releases_waiting_work():
    gpu_arrays.require_nccl_ranks(2)
    results = gpucoll.spawn(_abort_worker, 2, backend="nccl", timeout=60.0)
    assert results == [[], []], results


# -- world size 1, in this process: the API's checks --------------------------------------------------------------

@pytest.fixture(scope="module")
def comm():
    c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=120.0)
    yield c
    c.close()


def test_backend_and_device(comm):
    assert comm.backend == "nccl" and comm.device == "cuda:0"
    assert comm._ops.native.nccl_version == nccl_version()


@pytest.mark.parametrize("kind", PROVIDERS)
def test_bad_inputs(comm, kind):
    why = provider_problem(kind)
    if why:
        pytest.skip(why)
    A = Arrays(kind, 0)
    with pytest.raises(InvalidArgument, match="NumPy array"):
        comm.all_reduce(np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="stream"):
        comm.all_reduce(A.put(np.zeros(4, np.float32), "float32"), stream="default")
    with pytest.raises(InvalidArgument, match="out"):
        comm.all_reduce(A.put(np.zeros(4, np.float32), "float32"), out=A.empty(5, "float32"))
    with pytest.raises(InvalidArgument, match="root"):
        comm.broadcast(A.put(np.zeros(4, np.float32), "float32"), root=1)
    if kind == "torch":
        import torch

        with pytest.raises(InvalidArgument, match="x is a CPU tensor.*nccl backend"):
            comm.all_reduce(torch.zeros(4))
        with pytest.raises(InvalidArgument, match="contiguous"):
            comm.all_reduce(torch.zeros(4, 4, device=comm.device).t())
        if torch.cuda.device_count() > 1:
            with pytest.raises(InvalidArgument, match="x is on cuda:1, but this communicator uses cuda:0"):
                comm.all_reduce(torch.zeros(4, device="cuda:1"))
    x = A.put(np.arange(8, dtype=np.int32), "int32")
    comm.all_reduce(x)  # still usable after the refusals
    check(A.get(x, "int32"), np.arange(8, dtype=np.int32), "all_reduce after bad inputs", [])


def test_dlpack_and_cai_inputs(comm):
    """Objects that only export DLPack or __cuda_array_interface__ (here wrapping DeviceArrays)."""
    A = Arrays("device_array", 0)
    t = A.put(np.arange(64, dtype=np.float32), "bfloat16")

    class ViaDLPack:
        def __dlpack__(self, stream=None):
            return t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    out = A.empty(64, "bfloat16")
    comm.all_reduce(ViaDLPack(), out=out)
    failures: list = []
    check(A.get(out, "bfloat16"), np.arange(64, dtype=np.float32), "all_reduce of a DLPack input", failures)
    f = A.put(np.arange(32, dtype=np.float32), "float32")

    class ViaCAI:
        __cuda_array_interface__ = f.__cuda_array_interface__

    comm.broadcast(ViaCAI())
    check(A.get(f, "float32"), np.arange(32, dtype=np.float32), "broadcast of a CAI input", failures)
    strided = dict(f.__cuda_array_interface__, shape=(16,), strides=(8,))

    class Strided:
        __cuda_array_interface__ = strided

    with pytest.raises(InvalidArgument, match="contiguous"):
        comm.all_reduce(Strided())
    assert not failures, failures


def test_fp8_refused_on_old_nccl(comm):
    from gpucoll.errors import Unsupported

    if nccl_version() >= _C.NCCL_FP8_VERSION:
        pytest.skip(f"the loaded NCCL ({nccl_version()}) has fp8 (test_nccl_emulated.py runs the gate with an emulated "
                    f"older NCCL)")
    x = Arrays("device_array", 0).put(np.zeros(8, np.float32), "float8_e4m3fn")
    with pytest.raises(Unsupported, match="NCCL >= 2.24"):
        comm.all_reduce(x)


def test_fp8_reduction_refused_below_sm90(comm):
    from gpucoll.errors import Unsupported

    if nccl_version() < _C.NCCL_FP8_VERSION or fp8_usable() is None:
        pytest.skip("needs an NCCL with fp8 on a GPU below compute capability 9.0 (test_nccl_emulated.py runs it on an "
                    "emulated sm_80)")
    A = Arrays("device_array", 0)
    x = A.put(np.ones(8, np.float32), "float8_e4m3fn")
    with pytest.raises(Unsupported, match="compute capability 9.0"):
        comm.all_reduce(x)
    failures: list = []
    check(A.get(comm.all_gather(x), "float8_e4m3fn"), np.ones(8, np.float32), "fp8 all_gather", failures)
    assert not failures, failures  # moving fp8 works, and the communicator too


def test_barrier_and_abort():
    c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=60.0)
    c.barrier()
    c.abort()
    A = Arrays("device_array", 0)
    with pytest.raises(InvalidUsage, match="abort"):
        c.all_reduce(A.put(np.zeros(4, np.float32), "float32"))
