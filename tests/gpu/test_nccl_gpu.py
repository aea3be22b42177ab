"""The NCCL backend on a real GPU (every test is @pytest.mark.gpu: skipped with the reason where none is usable).

* World size 1, in this process: every collective x dtype x op (fp8 where the NCCL and the GPU have it), premul_sum,
  torch and CuPy inputs, ordering on the caller's stream, async Work, CUDA graph capture with 100 replays, bad inputs.
* World size 2 through gpucoll.spawn(backend='nccl'): on two GPUs, or two ranks sharing one GPU with NCCL's
  multi-rank mode (NCCL >= 2.30; skipped with the reason otherwise). Includes a rank that never arrives: the other
  rank's watchdog must raise CollectiveTimeout naming it.

Inputs are integer-valued (tests/helpers.py), so every result is checked bit for bit against the NumPy reference.
"""

from __future__ import annotations

import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll._nccl_backend import PreMulSum
from gpucoll._spawn import free_port
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage, Unsupported

pytestmark = [
    pytest.mark.gpu,
    # gpucoll's emulated CUDA device (GPUCOLL_CUDA=emulate) has no NCCL until its NCCL stand-in exists.
    pytest.mark.skipif(bool(_C.build_info().get("cuda_emulated")),
                       reason="NCCL cannot run on gpucoll's emulated CUDA device yet (the NCCL stand-in is not built)"),
]

COLLS = ("all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather", "all_to_all", "gather", "scatter")
FP8 = ("float8_e4m3fn", "float8_e5m2")
N = 96  # elements per rank-block: divisible by 1, 2, 3, 4, 8


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


# -- data ------------------------------------------------------------------------------------------------------------

def to_torch(a: np.ndarray, dtype: str, device):
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device).to(torch.bfloat16)
    if dtype in FP8:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device).to(getattr(torch, dtype))
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(t, dtype: str) -> np.ndarray:
    import torch

    if dtype == "bfloat16" or dtype in FP8:
        return t.to(torch.float32).cpu().numpy()
    return t.cpu().numpy()


def fp8_input(op: str, count: int, rank: int, world: int) -> np.ndarray:
    """Small integers (exact in e4m3 and e5m2, and so are their sums and products at these sizes), no zeros."""
    rng = np.random.default_rng([rank, count, world, len(op)])
    if op == "prod":
        return rng.choice(np.array([-2.0, -1.0, 1.0, 2.0], np.float32), size=count)
    return rng.integers(1, 4, size=count).astype(np.float32) * rng.choice(np.array([-1.0, 1.0], np.float32), count)


def make(dtype: str, op: str, count: int, rank: int, world: int) -> np.ndarray:
    if dtype in FP8:
        return fp8_input(op, count, rank, world)
    return helpers.make_input(dtype, op, count, rank, world, seed=11)


def reduce_ref(inputs, dtype: str, op) -> np.ndarray:
    if isinstance(op, PreMulSum):
        acc = sum(np.asarray(a, np.float64) * op.scalar for a in inputs)
        return acc.astype(helpers.np_dtype(dtype) if dtype not in FP8 else np.float32)
    if dtype in FP8:
        return helpers.reference([np.asarray(a, np.float32) for a in inputs], "float32", op)
    return helpers.reference(inputs, dtype, op)


def premul_for(dtype: str):
    # Floats (fp8 too): 0.5 keeps integer inputs exact. Integers: -1 (1 for uint8) keeps them in range.
    if dtype in helpers.FLOAT_DTYPES or dtype in FP8:
        return gpucoll.premul_sum(0.5)
    return gpucoll.premul_sum(1 if dtype == "uint8" else -1)


def input_op(op, dtype: str) -> str:
    """The make_input ranges of a call's op. premul_sum: floats those of sum (|x| <= 2**p / W, so x * 0.5 and every
    partial sum stay exact; avg's own inputs are W times larger), integers those of avg (no overflow)."""
    if not isinstance(op, PreMulSum):
        return op
    return "sum" if dtype in helpers.FLOAT_DTYPES or dtype in FP8 else "avg"


def check(got, want, what: str, failures: list) -> None:
    msg = helpers.compare_exact(np.asarray(got).reshape(-1), np.asarray(want).reshape(-1))
    if msg:
        failures.append(f"{what}: {msg}")


def run_collectives(comm, dtypes, ops, kind="torch") -> list:
    """Every collective on this communicator; returns failure descriptions (empty: all bit-exact)."""
    import torch

    W, r, dev = comm.world_size, comm.rank, comm.device
    failures: list = []
    for dtype in dtypes:
        for op in ops:
            iop = input_op(op, dtype)
            inputs = [make(dtype, iop, W * N, q, W) for q in range(W)]
            want = reduce_ref(inputs, dtype, op)
            tag = f"{dtype}/{op}"
            x = to_torch(inputs[r], dtype, dev)
            check(to_numpy(comm.all_reduce(x.clone(), op=op), dtype), want, f"all_reduce {tag}", failures)
            out = torch.empty_like(x)
            comm.all_reduce(x, out=out, op=op)
            check(to_numpy(out, dtype), want, f"all_reduce(out=) {tag}", failures)
            got = comm.reduce_scatter(x, op=op)
            check(to_numpy(got, dtype), want.reshape(W, N)[r], f"reduce_scatter {tag}", failures)
            for root in range(W):
                res = comm.reduce(x.clone(), op=op, root=root)
                if r == root:
                    check(to_numpy(res, dtype), want, f"reduce root={root} {tag}", failures)
        # Data movement: any values move bit for bit.
        inputs = [make(dtype, "max", W * N, q, W) for q in range(W)]
        x = to_torch(inputs[r], dtype, dev)
        check(to_numpy(comm.all_gather(x), dtype), np.concatenate(inputs), f"all_gather {dtype}", failures)
        want_a2a = np.concatenate([inputs[q].reshape(W, N)[r] for q in range(W)])
        check(to_numpy(comm.all_to_all(x), dtype), want_a2a, f"all_to_all {dtype}", failures)
        for root in range(W):
            b = comm.broadcast(x.clone(), root=root)
            check(to_numpy(b, dtype), inputs[root], f"broadcast root={root} {dtype}", failures)
            g = comm.gather(x, root=root)
            if r == root:
                check(to_numpy(g, dtype), np.concatenate(inputs), f"gather root={root} {dtype}", failures)
            s = comm.scatter(x, root=root)
            check(to_numpy(s, dtype), inputs[root].reshape(W, N)[r], f"scatter root={root} {dtype}", failures)
    torch.cuda.synchronize()
    return failures


# -- world size 1 ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comm():
    pytest.importorskip("torch")
    c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=120.0)
    import torch

    torch.cuda.set_device(int(c.device.split(":")[1]))
    yield c
    c.close()


def test_backend_and_device(comm):
    assert comm.backend == "nccl" and comm.device == "cuda:0"
    assert comm._impl.native.nccl_version == nccl_version()


@pytest.mark.parametrize("dtype", helpers.DTYPES)
def test_every_collective_dtype_op_ws1(comm, dtype):
    ops = list(helpers.OPS) + [premul_for(dtype)]
    failures = run_collectives(comm, [dtype], ops)
    assert not failures, helpers.format_failures(failures)


def test_grouped_send_recv_fallback_ws1(comm):
    """all_to_all/gather/scatter through grouped send/recv, the path NCCL < 2.28 takes."""
    native = comm._impl.native
    native._set_prefer_native(False)
    try:
        assert not native.native(5)
        failures = run_collectives(comm, ["float32", "int8", "bfloat16"], [])
    finally:
        native._set_prefer_native(True)
    assert not failures, helpers.format_failures(failures)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_ws1(comm, dtype):
    why = fp8_usable()
    if why:
        pytest.skip(why)
    failures = run_collectives(comm, [dtype], list(helpers.OPS) + [premul_for(dtype)])
    assert not failures, helpers.format_failures(failures)


def test_fp8_refused_on_old_nccl(comm):
    import torch

    if nccl_version() >= _C.NCCL_FP8_VERSION:
        pytest.skip(f"the loaded NCCL ({nccl_version()}) has fp8; the gate is unit-tested with fake versions")
    with pytest.raises(Unsupported, match="NCCL >= 2.24"):
        comm.all_reduce(torch.zeros(8, dtype=torch.float8_e4m3fn, device=comm.device))


def test_fp8_reduction_refused_below_sm90(comm):
    import torch

    if nccl_version() < _C.NCCL_FP8_VERSION or fp8_usable() is None:
        pytest.skip("needs an NCCL with fp8 on a GPU below compute capability 9.0")
    x = torch.ones(8, device=comm.device).to(torch.float8_e4m3fn)
    with pytest.raises(Unsupported, match="compute capability 9.0"):
        comm.all_reduce(x)
    assert torch.equal(comm.all_gather(x).float(), torch.ones(8, device=comm.device))  # moving fp8 works, comm too


def test_cupy_inputs_ws1(comm):
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(0):
        x = cupy.arange(4 * N, dtype=cupy.int32)
        assert (comm.all_reduce(x.copy(), op="max") == x).all()
        g = comm.all_gather(x)
        assert isinstance(g, cupy.ndarray) and (g == x).all()
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            y = comm.all_reduce(x * 2)
        s.synchronize()
        assert (y == x * 2).all()


def test_dlpack_and_cai_inputs_ws1(comm):
    import torch

    t = torch.arange(64, dtype=torch.bfloat16, device=comm.device)

    class ViaDLPack:
        def __dlpack__(self, stream=None):
            return t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    out = torch.empty_like(t)
    comm.all_reduce(ViaDLPack(), out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, t)
    f = torch.arange(32, dtype=torch.float32, device=comm.device)

    class ViaCAI:
        __cuda_array_interface__ = f.__cuda_array_interface__

    comm.broadcast(ViaCAI())
    torch.cuda.synchronize()
    assert torch.equal(f, torch.arange(32, dtype=torch.float32, device=comm.device))


def test_cai_producer_stream_is_waited_for(comm):
    """__cuda_array_interface__ v3: an explicit stream= must wait for the interface's "stream" (the producer's)."""
    import torch

    x = torch.zeros(1 << 20, dtype=torch.float32, device=comm.device)
    y = torch.zeros_like(x)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    consumer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)
        x.fill_(7.0)

    class Produced:
        @property
        def __cuda_array_interface__(self):
            return {"shape": (x.numel(),), "typestr": "<f4", "data": (x.data_ptr(), False), "strides": None,
                    "version": 3, "stream": producer.cuda_stream}

    comm.all_reduce(Produced(), out=y, stream=consumer)
    consumer.synchronize()
    assert torch.all(y == 7.0 * comm.world_size)
    producer.synchronize()


def test_collective_is_ordered_on_the_callers_stream(comm):
    import torch

    x = torch.zeros(1 << 20, dtype=torch.float32, device=comm.device)
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill
        x.fill_(3.0)
        comm.all_reduce(x, out=y)  # must run after the fill, on s
    s.synchronize()
    assert torch.all(y == 3.0 * comm.world_size)
    # An explicit stream= (here the raw handle) is honoured the same way.
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.fill_(5.0)
    comm.all_reduce(x, out=y, stream=s.cuda_stream)
    s.synchronize()
    assert torch.all(y == 5.0)


def test_async_work(comm):
    import torch

    x = torch.zeros((1 << 20,), device=comm.device)
    out = torch.zeros_like(x)
    cur = torch.cuda.current_stream()
    torch.cuda._sleep(100_000_000)
    x.fill_(2.0)  # behind the sleep: the internal stream must wait for the caller's before reading x
    work = comm.all_reduce(x, out=out, async_op=True)
    assert isinstance(work, gpucoll.Work) and work.result() is out
    work.wait()  # the current stream waits; the host does not
    y = out * 1  # ordered after the collective through the wait
    cur.synchronize()
    assert work.is_completed() and torch.all(y == 2.0 * comm.world_size)
    x = torch.full((1 << 20,), 2.0, device=comm.device)
    w2 = comm.all_gather(x[:16], async_op=True)
    w2.synchronize()
    assert w2.is_completed() and torch.equal(w2.result(), x[:16].repeat(comm.world_size))


def test_group_ws1(comm):
    import torch

    a = torch.ones(8, device=comm.device)
    b = torch.full((8,), 2.0, device=comm.device)
    with comm.group():
        comm.all_reduce(a)
        wb = comm.all_reduce(b, async_op=True)
        with pytest.raises(InvalidUsage, match="inside the group"):
            wb.synchronize()
    wb.synchronize()
    assert torch.all(a == 1) and torch.all(b == 2)


def test_torch_graph_capture_replays(comm):
    import torch

    x = torch.zeros(1024, dtype=torch.float32, device=comm.device)
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(x, out=y)  # warm-up outside the capture (NCCL connects lazily)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x, out=y)
        x.add_(1.0)
    for i in range(100):
        g.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 100.0) and torch.all(y == 99.0 * comm.world_size)


def test_cupy_graph_capture_replays(comm):
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(0):
        x = cupy.zeros(256, dtype=cupy.float32)
        y = cupy.empty_like(x)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            comm.all_reduce(x, out=y)
            s.synchronize()
            s.begin_capture()
            comm.all_reduce(x, out=y)
            x += 1
            graph = s.end_capture()
        for _ in range(100):
            graph.launch(stream=s)
        s.synchronize()
        assert float(x[0]) == 100.0 and float(y[0]) == 99.0


def test_bad_inputs(comm):
    import torch

    with pytest.raises(InvalidArgument, match="x is a CPU tensor.*nccl backend"):
        comm.all_reduce(torch.zeros(4))
    with pytest.raises(InvalidArgument, match="NumPy array"):
        comm.all_reduce(np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="contiguous"):
        comm.all_reduce(torch.zeros(4, 4, device=comm.device).t())
    with pytest.raises(InvalidArgument, match="out is a CPU tensor"):
        comm.all_reduce(torch.zeros(4, device=comm.device), out=torch.zeros(4))
    with pytest.raises(InvalidArgument, match="stream"):
        comm.all_reduce(torch.zeros(4, device=comm.device), stream="default")
    if torch.cuda.device_count() > 1:
        with pytest.raises(InvalidArgument, match="x is on cuda:1, but this communicator uses cuda:0"):
            comm.all_reduce(torch.zeros(4, device="cuda:1"))
        with pytest.raises(InvalidArgument, match="stream belongs to cuda:1"):
            comm.all_reduce(torch.zeros(4, device=comm.device), stream=torch.cuda.Stream(device=1))


def test_barrier_and_abort():
    torch = pytest.importorskip("torch")

    c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=60.0)
    c.barrier()
    c.abort()
    with pytest.raises(InvalidUsage, match="abort"):
        c.all_reduce(torch.zeros(4, device="cuda:0"))


# -- world size 2 --------------------------------------------------------------------------------------------------

def ws2_available() -> str | None:
    pytest.importorskip("torch")  # the workers use torch tensors
    count = int(_C.cuda_probe()["device_count"])
    if count >= 2:
        return None
    if not _C.nccl_multi_rank_gpu_supported(nccl_version()):
        return f"one GPU and NCCL {nccl_version()} < 2.30: two ranks cannot share it (NCCL_MULTI_RANK_GPU_ENABLE)"
    return None


def _ws2_worker(comm, kind):
    import torch

    torch.cuda.set_device(int(comm.device.split(":")[1]))
    if kind == "torch":
        dtypes = list(helpers.DTYPES) + ([d for d in FP8] if fp8_usable() is None else [])
        failures = []
        for dtype in dtypes:
            failures += run_collectives(comm, [dtype], list(helpers.OPS) + [premul_for(dtype)])
        # send/recv, grouped both ways (would deadlock without the group)
        peer = 1 - comm.rank
        mine = torch.full((1000,), comm.rank + 1.0, device=comm.device)
        theirs = torch.empty_like(mine)
        with comm.group():
            comm.send(mine, peer)
            comm.recv(theirs, peer)
        torch.cuda.synchronize()
        if not torch.all(theirs == peer + 1.0):
            failures.append("send/recv in a group")
        work = comm.all_reduce(mine, async_op=True)
        work.synchronize()
        if not torch.all(mine == 3.0):
            failures.append("async all_reduce")
        comm.barrier()
        return failures
    if kind == "fallback":
        comm._impl.native._set_prefer_native(False)
        return run_collectives(comm, ["float32", "int64", "bfloat16"], [])
    if kind == "graph":
        x = torch.full((512,), float(comm.rank), device=comm.device)
        y = torch.empty_like(x)
        comm.all_reduce(x, out=y)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            comm.all_reduce(x, out=y)
            x.add_(1.0)
        for _ in range(100):
            g.replay()
        torch.cuda.synchronize()
        # After 100 replays x = rank + 100; the last replay reduced rank + 99 on each rank.
        return [] if torch.all(y == (0 + 99) + (1 + 99)) else [f"graph: y[0]={float(y[0])}"]
    if kind == "blocking":
        # GPUCOLL_NCCL_BLOCKING_OPS=1: the operations run on a blocking communicator split off the init's
        failures = [] if comm._impl.native.blocking else ["the communicator is not blocking"]
        failures += run_collectives(comm, ["float32", "bfloat16", "int32"], list(helpers.OPS))
        failures += _ws2_worker(comm, "graph")
        x = torch.ones(1 << 20, device=comm.device)
        work = comm.all_reduce(x, async_op=True)
        work.synchronize()
        return failures + ([] if torch.all(x == 2.0) else ["async all_reduce on the blocking communicator"])
    if kind == "missing":
        # Rank 1 never joins the collective: rank 0's watchdog must abort and name rank 1.
        if comm.rank == 1:
            time.sleep(20.0)
            comm.abort()
            return []
        x = torch.ones(16, device=comm.device)
        try:
            # Either the call itself times out (NCCL connects lazily, and the connection waits for rank 1), or it
            # is enqueued and the watchdog aborts it: synchronize() then returns (the kernels end) and the next
            # call raises the recorded CollectiveTimeout.
            comm.all_reduce(x)
            torch.cuda.synchronize()
            comm.all_reduce(x)
        except CollectiveTimeout as e:
            return [] if e.ranks == (1,) and "all_reduce #" in str(e) else [f"wrong timeout: {e!r}"]
        return ["no CollectiveTimeout"]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["torch", "fallback", "graph", "blocking"])
def test_ws2(kind, monkeypatch):
    why = ws2_available()
    if why:
        pytest.skip(why)
    if kind == "blocking":
        monkeypatch.setenv("GPUCOLL_NCCL_BLOCKING_OPS", "1")  # the spawned ranks inherit it
    results = gpucoll.spawn(_ws2_worker, 2, args=(kind,), backend="nccl", timeout=300.0)
    failures = helpers.merge_rank_failures([{"f": r} for r in results], "f")
    assert not failures, helpers.format_failures(failures)


def test_ws2_watchdog_names_the_missing_rank():
    why = ws2_available()
    if why:
        pytest.skip(why)
    results = gpucoll.spawn(_ws2_worker, 2, args=("missing",), backend="nccl", timeout=8.0)
    assert results == [[], []], results
