"""gpucoll's own allreduce kernels on a real GPU (every test is @pytest.mark.gpu: skipped with the reason where none is
usable). Both one-GPU modes:

* (b) virtual ranks: P communicators in this process (gpucoll.testing.virtual_ranks), one stream each;
* (a) P processes on one device through gpucoll.spawn(backend='custom') (CUDA IPC between the processes).

Covered: every kernel x dtype x op x P in {2, 3, 4, 8} x sizes from 16 B to 64 MiB with odd counts, bit-exact
against the NumPy reference on integer-valued inputs (tests/helpers.py); registered (zero-copy) inputs; messages
longer than the staging buffer (pieces); CUDA graph capture with 1000 replays; 10,000 back-to-back calls of varying
sizes; a rank that never arrives (CollectiveTimeout, no hang); NCCL fallback with its reason; every IPC mapping
closed after teardown. compute-sanitizer runs through tests/gpu/sanitize_custom.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import CollectiveTimeout

pytestmark = pytest.mark.gpu

ALGOS = ("oneshot", "twoshot", "ring", "tree")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")
OPS = ("sum", "min", "max", "avg")
WORLD = (2, 3, 4, 8)
MiB = 1 << 20
# Registered tensors stay alive for the whole session: a communicator keys registrations by address, so a freed
# registered tensor whose address the caching allocator hands to a later input would be read through stale peer
# pointers (the library has no deregistration yet).
_REGISTERED = []


def counts_for(dtype: str) -> list:
    """Element counts from 16 bytes up, odd ones included (chunk and slice remainders, scalar heads and tails)."""
    size = np.dtype(helpers.np_dtype(dtype)).itemsize if dtype != "bfloat16" else 2
    return [16 // size, 1, 37, 1001, (8 << 10) // size + 3, (1 * MiB) // size - 5, (3 * MiB) // size + 7]


def to_torch(a: np.ndarray, dtype: str, device: str):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def to_numpy(t, dtype: str) -> np.ndarray:
    import torch

    return (t.to(torch.float32) if dtype == "bfloat16" else t).cpu().numpy()


def check(dtype, op, inputs, got) -> str | None:
    want = helpers.reference(inputs, dtype, op)
    return helpers.compare_exact(np.asarray(got, dtype=want.dtype), want)


def run_virtual(vr, algo, dtype, op, count, registered=False, outs=True, inputs=None) -> list:
    """One call on all virtual ranks; returns failure strings. `inputs` (NumPy, one per rank) may be passed in so
    that several algorithms share the cost of making them."""
    import torch

    P = vr.nranks
    if inputs is None:
        inputs = [helpers.make_input(dtype, op, count, r, P, seed=5) for r in range(P)]
    xs = [to_torch(a, dtype, f"cuda:{vr.device}") for a in inputs]
    ys = [torch.empty_like(x) for x in xs] if outs else None
    if registered:
        vr.register(xs)
        _REGISTERED.append(xs)
    torch.cuda.synchronize(vr.device)
    vr.all_reduce(xs, ys, op=op, algo=algo)
    vr.synchronize()
    fails = []
    for r, t in enumerate(ys if outs else xs):
        bad = check(dtype, op, inputs, to_numpy(t, dtype))
        if bad:
            fails.append(f"{algo} {dtype} {op} P={P} count={count} reg={registered} rank {r}: {bad}")
    return fails


@pytest.fixture(scope="module", params=WORLD)
def vr(request):
    pytest.importorskip("torch")
    from gpucoll import testing

    with testing.virtual_ranks(request.param, device=0, timeout=30.0) as v:
        yield v


# -- (b) virtual ranks ---------------------------------------------------------------------------------------------

def test_virtual_every_kernel_dtype_op_size(vr):
    # The algorithm is the inner loop: the inputs (most of the host time) are made once for all four kernels.
    fails = []
    for dtype in DTYPES:
        for op in OPS:
            for i, count in enumerate(counts_for(dtype)):
                inputs = [helpers.make_input(dtype, op, count, r, vr.nranks, seed=5) for r in range(vr.nranks)]
                for algo in ALGOS:  # in place and out of place
                    fails += run_virtual(vr, algo, dtype, op, count, outs=i % 2 == 0, inputs=inputs)
    assert not fails, helpers.format_failures(fails)


def test_virtual_64mib(vr):
    # Larger than a staging half (32 MiB): several kernels per call.
    fails = []
    for dtype, op, count in (("float32", "sum", 16 * MiB + 3), ("bfloat16", "avg", 32 * MiB)):
        inputs = [helpers.make_input(dtype, op, count, r, vr.nranks, seed=5) for r in range(vr.nranks)]
        for algo in ALGOS:
            fails += run_virtual(vr, algo, dtype, op, count, inputs=inputs)
    assert not fails, helpers.format_failures(fails)


@pytest.mark.parametrize("algo", ("oneshot", "twoshot"))
def test_virtual_registered(vr, algo):
    # In place too: a registered one-shot whose output is its input must not overwrite it before every peer read it.
    fails = []
    for dtype, op in (("float32", "sum"), ("float16", "avg"), ("int32", "max")):
        for count in (1, 1001, (2 * MiB) // 4 + 1):
            for outs in (True, False):
                fails += run_virtual(vr, algo, dtype, op, count, registered=True, outs=outs)
    assert not fails, helpers.format_failures(fails)


def test_virtual_small_buffer_pieces():
    pytest.importorskip("torch")
    from gpucoll import testing

    with testing.virtual_ranks(3, buffer_bytes=4096) as v:
        fails = []
        for algo in ALGOS:
            fails += run_virtual(v, algo, "float16", "sum", 10007)
            fails += run_virtual(v, algo, "int32", "max", 5003, outs=False)
        for algo in ("oneshot", "twoshot"):  # registered inputs, several pieces (in_offset), in place and not
            fails += run_virtual(v, algo, "float32", "sum", 3001, registered=True)
            fails += run_virtual(v, algo, "float32", "avg", 3001, registered=True, outs=False)
        assert not fails, helpers.format_failures(fails)


def test_virtual_graph_1000_replays(vr):
    import torch

    P, n = vr.nranks, 3001
    dev = f"cuda:{vr.device}"
    xs = [torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(P)]
    # One output per algorithm: with a shared one only the last captured algorithm's result would be checked.
    ys = {algo: [torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(P)] for algo in ALGOS}
    _REGISTERED.append(xs)  # registered on exit of the capture
    torch.cuda.synchronize()
    # Warm-up: every kernel is loaded (CUDA lazy loading) and every occupancy query cached before the capture.
    for algo in ALGOS:
        vr.all_reduce(xs, ys[algo], algo=algo)
    vr.synchronize()
    with vr.graph_capture() as g:
        for algo in ALGOS:
            vr.all_reduce(xs, ys[algo], algo=algo)
    for batch in range(2):
        inputs = [helpers.make_input("float32", "sum", n, r + 10 * batch, P, seed=3) for r in range(P)]
        for x, a in zip(xs, inputs):
            x.copy_(torch.from_numpy(a))
        torch.cuda.synchronize()
        for algo in ALGOS:
            for y in ys[algo]:
                y.zero_()
        torch.cuda.synchronize()
        g.replay(500)
        vr.synchronize()
        for algo in ALGOS:
            for r in range(P):
                bad = check("float32", "sum", inputs, ys[algo][r].cpu().numpy())
                assert bad is None, f"{algo} batch {batch} rank {r}: {bad}"


def test_virtual_10000_varying_calls(vr):
    import torch

    P = vr.nranks
    dev = f"cuda:{vr.device}"
    # Small sizes run one block; 20011 int32 (80 KB) runs several, so the grid changes from call to call and
    # rows of flags are left stale and picked up again.
    sizes = [1, 7, 64, 333, 20011, 1024, 4093]
    width = max(sizes)
    inputs = [helpers.make_input("int32", "sum", width, r, P, seed=9) for r in range(P)]
    want = helpers.reference(inputs, "int32", "sum")
    xs = [torch.from_numpy(a).to(dev) for a in inputs]
    calls = 10_000
    outs = [torch.zeros((calls, width), dtype=torch.int32, device=dev) for _ in range(P)]
    torch.cuda.synchronize()
    for i in range(calls):
        n = sizes[i % len(sizes)]
        vr.all_reduce([x[:n] for x in xs], [o[i, :n] for o in outs], algo=ALGOS[(i // len(sizes)) % 4])
    vr.synchronize()
    for r in range(P):
        got = outs[r].cpu().numpy()
        for i in range(calls):
            n = sizes[i % len(sizes)]
            assert np.array_equal(got[i, :n], want[:n]), f"call {i} (n={n}) on rank {r}"


def test_virtual_missing_rank_times_out_instead_of_hanging():
    torch = pytest.importorskip("torch")
    from gpucoll import testing

    with testing.virtual_ranks(2, timeout=1.0) as v:
        x = torch.ones(100, device="cuda:0")
        torch.cuda.synchronize()
        v.comms[0].all_reduce(x.data_ptr(), x.data_ptr(), 100, _C.DType.float32, _C.RedOp.sum, "oneshot",
                              v.streams[0])  # rank 1 never calls
        with pytest.raises(CollectiveTimeout, match="virtual ranks \\[0\\]"):
            v.synchronize()


# -- (a) processes sharing one GPU -----------------------------------------------------------------------------------

def _spawn_matrix(comm):
    import torch

    P, r = comm.world_size, comm.rank
    fails = []
    for algo in ALGOS:
        for dtype in DTYPES:
            for op in OPS:
                for count in (16 // (4 if dtype in ("float32", "int32") else 2 if dtype != "float64" else 8), 37,
                              (1 * MiB) // 4 + 1):
                    inputs = [helpers.make_input(dtype, op, count, q, P, seed=2) for q in range(P)]
                    x = to_torch(inputs[r], dtype, comm.device)
                    comm.all_reduce(x, op=op, algo=algo)
                    torch.cuda.synchronize()
                    bad = check(dtype, op, inputs, to_numpy(x, dtype))
                    if bad:
                        fails.append(f"{algo} {dtype} {op} count={count} rank {r}: {bad}")
    big = [helpers.make_input("float32", "sum", 16 * MiB, q, P, seed=4) for q in range(P)]
    x = to_torch(big[r], "float32", comm.device)
    comm.all_reduce(x, algo="twoshot")
    torch.cuda.synchronize()
    if check("float32", "sum", big, x.cpu().numpy()):
        fails.append(f"64 MiB twoshot rank {r}")
    # Registered input, read in place by every rank.
    y = to_torch(big[r][:4097], "float32", comm.device)
    comm.register(y)
    out = torch.empty_like(y)
    comm.all_reduce(y, out, algo="oneshot")
    torch.cuda.synchronize()
    if check("float32", "sum", [b[:4097] for b in big], out.cpu().numpy()):
        fails.append(f"registered oneshot rank {r}")
    return fails, dict(comm._impl.stats)


@pytest.mark.parametrize("P", WORLD)
def test_processes_on_one_gpu(P):
    pytest.importorskip("torch")
    results = gpucoll.spawn(_spawn_matrix, P, backend="custom", timeout=600.0, device=0)
    fails = [f for fails, _ in results for f in fails]
    assert not fails, helpers.format_failures(fails)
    assert all(stats["nccl"] == 0 and stats["custom"] > 0 for _, stats in results)


def _spawn_graph_and_teardown(comm):
    import torch

    P, r, n = comm.world_size, comm.rank, 2049
    x = torch.zeros(n, dtype=torch.float32, device=comm.device)
    y1, y2 = torch.zeros_like(x), torch.zeros_like(x)  # one output per algorithm: each result is checked
    s = torch.cuda.Stream(comm.device)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        # Warm-up outside capture, every captured kernel: torch's capture is in global mode, where a first launch
        # that has to load its kernel (CUDA lazy loading) is not something to rely on.
        comm.all_reduce(x, y1, algo="oneshot")
        comm.all_reduce(x, y2, algo="twoshot")
    s.synchronize()
    with comm.graph_capture(), torch.cuda.graph(g, stream=s):
        comm.all_reduce(x, y1, algo="oneshot")
        comm.all_reduce(x, y2, algo="twoshot")
    inputs = [helpers.make_input("float32", "sum", n, q, P, seed=8) for q in range(P)]
    x.copy_(torch.from_numpy(inputs[r]))
    torch.cuda.synchronize()
    for _ in range(1000):
        g.replay()
    torch.cuda.synchronize()
    ok = all(check("float32", "sum", inputs, y.cpu().numpy()) is None for y in (y1, y2))
    mappings = _C.custom_ipc_open_handles()
    del g
    return ok, mappings


def _close_and_count(comm):
    import torch

    t = torch.ones(64, device=comm.device)
    comm.register(t)
    comm.all_reduce(t)
    torch.cuda.synchronize()
    before = _C.custom_ipc_open_handles()
    comm.close()
    return before, _C.custom_ipc_open_handles()


@pytest.mark.parametrize("P", (2, 4))
def test_processes_graph_replays_and_ipc_handles_closed(P):
    pytest.importorskip("torch")
    results = gpucoll.spawn(_spawn_graph_and_teardown, P, backend="custom", timeout=300.0)
    assert all(ok for ok, _ in results)
    assert all(m >= P - 1 for _, m in results)  # peers' memory + their registered buffers were mapped
    counts = gpucoll.spawn(_close_and_count, P, backend="custom", timeout=300.0)
    assert all(before >= P - 1 for before, _ in counts), counts
    assert [after for _, after in counts] == [0] * P  # teardown closed every mapping


def _fallback(comm):
    import torch

    x = torch.full((10,), float(comm.rank + 1), device=comm.device)
    comm.all_reduce(x, op="prod")  # no custom kernel for prod: NCCL runs it
    torch.cuda.synchronize()
    return x.cpu().tolist(), dict(comm._impl.stats)


def test_nccl_fallback_with_reason():
    pytest.importorskip("torch")
    from gpucoll import _nccl

    if not _C.nccl_multi_rank_gpu_supported(int(_nccl.load().get("version") or 0)):
        pytest.skip("NCCL < 2.30: two ranks cannot share the GPU for the fallback")
    results = gpucoll.spawn(_fallback, 2, backend="custom")
    assert all(vals == [2.0] * 10 and stats == {"custom": 0, "nccl": 1} for vals, stats in results)


def test_sanitizers_clean():
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH")
    script = Path(__file__).with_name("sanitize_custom.py")
    proc = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
