"""gpucoll's own allreduce kernels on a CUDA device: a real GPU, or gpucoll's emulated one (a GPUCOLL_CUDA=emulate
build runs the same kernel sources on the CPU). Every test is @pytest.mark.gpu (skipped with the reason where no
device is usable) and parametrised by its array provider (tests/support/gpu_arrays.py): gpucoll.testing.DeviceArray
everywhere, torch tensors where torch has CUDA (a real GPU). Both one-GPU modes:

* (b) virtual ranks: P communicators in this process (gpucoll.testing.virtual_ranks), one stream each;
* (a) P processes on one device through gpucoll.spawn(backend='custom') (CUDA IPC between the processes).

Covered: every kernel x dtype x op x P in {2, 3, 4, 5, 8} x sizes from 1 element up, odd counts, misaligned
offsets (views starting 1 or 3 elements into their allocation, input and output at different offsets), messages
longer than the staging buffer (pieces), bit-exact against the reference the host backend is checked against
(tests/support/helpers.py, integer-valued inputs with a distinct value per element); outputs pre-filled with a sentinel,
and a guard after (and before) every output that must still hold it; in-place and registered (zero-copy) inputs;
CUDA graph capture with 1000 replays; 10,000 back-to-back calls of varying sizes; a rank that never arrives
(CollectiveTimeout naming it, later calls refused, no hang); the NCCL fallback with its reason; every IPC mapping
closed after teardown. compute-sanitizer runs through tests/custom/sanitize_custom.py (a real GPU).

On the emulated device the sizes are scaled to its speed (two CPU cores run every rank's every block): the
staging halves are 64 KiB instead of 32 MiB, so the same paths (several blocks, several pieces) are reached by
messages up to a few hundred KiB; the matrix is otherwise the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gpu_arrays
import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import CollectiveTimeout, InvalidUsage

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

ALGOS = ("oneshot", "twoshot", "ring", "tree")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")
OPS = ("sum", "min", "max", "avg")
WORLD = (2, 3, 4, 5, 8)
MiB = 1 << 20
GUARD = 3  # elements after each output (and `offset` before it) that must keep the sentinel
EMULATED = gpu_arrays.emulated()
# Staging half per rank: small on the emulated device so that pieces and multi-block kernels come at small sizes.
HALF = (64 << 10) if EMULATED else None
# (input offset, output offset) in elements from the start of their allocations, cycled over the sizes: aligned,
# both misaligned alike (scalar heads and tails), and misaligned differently (no common pack split: all scalar).
OFFSETS = ((0, 0), (1, 1), (3, 1))
# Registered tensors stay alive for the whole session: a communicator keys registrations by address, so a freed
# registered buffer whose address comes back for a later input would be read through stale peer pointers.
_REGISTERED = []


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def counts_for(dtype: str) -> list:
    """Element counts from 1 element up, odd ones included (chunk and slice remainders, scalar heads and tails):
    one block, several blocks, several pieces."""
    size = itemsize(dtype)
    if EMULATED:
        return [16 // size, 1, 37, 1001, (8 << 10) // size + 3, (64 << 10) // size - 5, (200 << 10) // size + 7]
    return [16 // size, 1, 37, 1001, (8 << 10) // size + 3, MiB // size - 5, (3 * MiB) // size + 7]


def reference_bytes(inputs, dtype: str, op: str):
    want = helpers.reference(inputs, dtype, op)
    raw = helpers.bf16_bits(want) if dtype == "bfloat16" else np.ascontiguousarray(want)
    return want, raw.view(np.uint8)


class Output:
    """An output of `count` elements `offset` elements into an allocation with GUARD elements after it, all bytes
    the sentinel."""

    def __init__(self, prov, count: int, dtype: str, device: int, offset: int):
        self.prov, self.count, self.dtype, self.offset = prov, count, dtype, offset
        self.base = prov.empty(offset + count + GUARD, dtype, device)
        self.view = self.base[offset:offset + count]

    def check(self, want, want_raw) -> str | None:
        raw = self.prov.download(self.base.view("uint8") if self.prov.name == "device_array"
                                 else self.base.view(self.prov.torch.uint8), "uint8")
        es = itemsize(self.dtype)
        head, body, tail = raw[:self.offset * es], raw[self.offset * es:(self.offset + self.count) * es], \
            raw[(self.offset + self.count) * es:]
        if np.any(head != gpu_arrays.SENTINEL) or np.any(tail != gpu_arrays.SENTINEL):
            return "wrote outside its output (a guard byte lost the sentinel)"
        if np.array_equal(body, want_raw):
            return None
        got = self.prov.download(self.view, self.dtype)
        return helpers.compare_exact(np.asarray(got, dtype=want.dtype), want) or "bytes differ"


def run_virtual(vr, prov, algo, dtype, op, count, inputs, offsets=(0, 0), in_place=False, registered=False) -> list:
    """One call on all virtual ranks; returns failure strings."""
    P = vr.nranks
    in_off, out_off = offsets
    xs = [prov.upload(inputs[r], dtype, vr.device, in_off) for r in range(P)]
    outs = None if in_place else [Output(prov, count, dtype, vr.device, out_off) for _ in range(P)]
    if registered:
        vr.register(xs)
        _REGISTERED.append(xs)
    prov.synchronize(vr.device)
    vr.all_reduce(xs, None if in_place else [o.view for o in outs], op=op, algo=algo)
    vr.synchronize()
    want, want_raw = reference_bytes(inputs, dtype, op)
    fails = []
    what = f"{algo} {dtype} {op} P={P} count={count} offsets={offsets} in_place={in_place} reg={registered}"
    for r in range(P):
        if in_place:
            got = prov.download(xs[r], dtype)
            bad = helpers.compare_exact(np.asarray(got, dtype=want.dtype), want)
        else:
            bad = outs[r].check(want, want_raw)
        if bad:
            fails.append(f"{what} rank {r}: {bad}")
    return fails


def inputs_for(dtype, op, count, P, seed=5):
    return [helpers.make_input(dtype, op, count, r, P, seed=seed) for r in range(P)]


@pytest.fixture(scope="module", params=WORLD)
def vr(request):
    from gpucoll import testing

    kwargs = {"buffer_bytes": HALF} if HALF else {}
    with testing.virtual_ranks(request.param, device=0, timeout=60.0, **kwargs) as v:
        yield v


# -- (b) virtual ranks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_every_kernel_dtype_op_size(vr, provider):
    # The algorithm is the inner loop: the inputs (most of the host time) are made once for all four kernels.
    prov = gpu_arrays.provider(provider)
    fails = []
    for dtype in DTYPES:
        for op in OPS:
            for i, count in enumerate(counts_for(dtype)):
                inputs = inputs_for(dtype, op, count, vr.nranks)
                for algo in ALGOS:
                    fails += run_virtual(vr, prov, algo, dtype, op, count, inputs, OFFSETS[i % len(OFFSETS)],
                                         in_place=(i + ALGOS.index(algo)) % 4 == 3)
    assert not fails, helpers.format_failures(fails)


@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_large(vr, provider):
    # Many times a staging half: several kernels per call.
    prov = gpu_arrays.provider(provider)
    n = (1 * MiB + 3) if EMULATED else 16 * MiB + 3
    fails = []
    for dtype, op, count in (("float32", "sum", n), ("bfloat16", "avg", n // 2 * 2)):
        inputs = inputs_for(dtype, op, count, vr.nranks)
        for algo in ALGOS:
            fails += run_virtual(vr, prov, algo, dtype, op, count, inputs)
    assert not fails, helpers.format_failures(fails)


@pytest.mark.slow
def test_virtual_default_staging_size():
    """The staging buffer at its default size (GPUCOLL_CUSTOM_BUFFER_BYTES) and a message of tens of MiB, misaligned:
    full-size pieces, as a job sees them. The other emulated tests shrink the halves to 64 KiB to reach the same
    paths cheaply; this one runs the shape a GPU runs, once, on every kernel."""
    from gpucoll import testing
    from gpucoll.backends import custom

    prov = gpu_arrays.provider("device_array")
    half = custom.half_bytes()
    count = (half + half // 2) // 4 + 3  # float32: one full piece and a half
    inputs = inputs_for("float32", "sum", count, 2)
    fails = []
    with testing.virtual_ranks(2, device=0, timeout=120.0) as v:
        assert v.comms[0].half_bytes == half and count * 4 > half, (v.comms[0].half_bytes, half)
        for algo in ALGOS:
            fails += run_virtual(v, prov, algo, "float32", "sum", count, inputs, offsets=(1, 1))
    assert not fails, helpers.format_failures(fails)


@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
@pytest.mark.parametrize("algo", ("oneshot", "twoshot"))
def test_virtual_registered(vr, provider, algo):
    # In place too: a registered one-shot whose output is its input must not overwrite it before every peer read it.
    prov = gpu_arrays.provider(provider)
    piece = (HALF or 32 * MiB) // 4
    fails = []
    for dtype, op in (("float32", "sum"), ("float16", "avg"), ("int32", "max")):
        for count in (1, 1001, piece + 1):
            inputs = inputs_for(dtype, op, count, vr.nranks)
            for offsets, in_place in (((0, 0), False), ((1, 3), False), ((0, 0), True), ((1, 1), True)):
                fails += run_virtual(vr, prov, algo, dtype, op, count, inputs, offsets, in_place, registered=True)
    assert not fails, helpers.format_failures(fails)


@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_small_buffer_pieces(provider):
    from gpucoll import testing

    prov = gpu_arrays.provider(provider)
    with testing.virtual_ranks(3, buffer_bytes=4096) as v:
        fails = []
        for algo in ALGOS:
            fails += run_virtual(v, prov, algo, "float16", "sum", 10007, inputs_for("float16", "sum", 10007, 3))
            fails += run_virtual(v, prov, algo, "int32", "max", 5003, inputs_for("int32", "max", 5003, 3), (1, 1),
                                 in_place=True)
        for algo in ("oneshot", "twoshot"):  # registered inputs, several pieces (in_offset), in place and not
            fails += run_virtual(v, prov, algo, "float32", "sum", 3001, inputs_for("float32", "sum", 3001, 3),
                                 registered=True)
            fails += run_virtual(v, prov, algo, "float32", "avg", 3001, inputs_for("float32", "avg", 3001, 3),
                                 (1, 1), in_place=True, registered=True)
        assert not fails, helpers.format_failures(fails)


@pytest.mark.slow
@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_graph_1000_replays(vr, provider):
    prov = gpu_arrays.provider(provider)
    P, n = vr.nranks, 3001
    replays = 1000  # every P, the emulated device included (1000 replays at P = 8 take seconds there)
    xs = [prov.upload(np.zeros(n, np.float32), "float32", vr.device) for _ in range(P)]
    # One output per algorithm: with a shared one only the last captured algorithm's result would be checked.
    ys = {algo: [Output(prov, n, "float32", vr.device, 0) for _ in range(P)] for algo in ALGOS}
    _REGISTERED.append(xs)  # registered on exit of the capture
    prov.synchronize(vr.device)
    # Warm-up: every kernel is loaded (CUDA lazy loading) and every occupancy query cached before the capture.
    for algo in ALGOS:
        vr.all_reduce(xs, [o.view for o in ys[algo]], algo=algo)
    vr.synchronize()
    with vr.graph_capture() as g:
        for algo in ALGOS:
            vr.all_reduce(xs, [o.view for o in ys[algo]], algo=algo)
    for batch in range(2):
        inputs = [helpers.make_input("float32", "sum", n, r + 10 * batch, P, seed=3) for r in range(P)]
        for x, a in zip(xs, inputs):
            prov.write(x, a)
        for algo in ALGOS:
            for o in ys[algo]:
                prov.fill_sentinel(o.base)
        prov.synchronize(vr.device)
        g.replay(replays // 2)
        vr.synchronize()
        want, want_raw = reference_bytes(inputs, "float32", "sum")
        for algo in ALGOS:
            for r in range(P):
                bad = ys[algo][r].check(want, want_raw)
                assert bad is None, f"{algo} batch {batch} rank {r}: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_10000_varying_calls(vr, provider):
    prov = gpu_arrays.provider(provider)
    P = vr.nranks
    # Small sizes run one block; 20011 int32 (80 KB) runs several (and, on the emulated device, two pieces), so the
    # grid changes from call to call and rows of flags are left stale and picked up again.
    sizes = [1, 7, 64, 333, 20011, 1024, 4093]
    width = max(sizes)
    inputs = [helpers.make_input("int32", "sum", width, r, P, seed=9) for r in range(P)]
    want = helpers.reference(inputs, "int32", "sum")
    xs = [prov.upload(a, "int32", vr.device) for a in inputs]
    calls = 10_000
    starts = np.cumsum([0] + [sizes[i % len(sizes)] for i in range(calls)])
    outs = [prov.empty(int(starts[-1]), "int32", vr.device) for _ in range(P)]
    prov.synchronize(vr.device)
    for i in range(calls):
        n = sizes[i % len(sizes)]
        s = int(starts[i])
        vr.all_reduce([x[:n] for x in xs], [o[s:s + n] for o in outs], algo=ALGOS[(i // len(sizes)) % 4])
    vr.synchronize()
    for r in range(P):
        got = prov.download(outs[r], "int32")
        for i in range(calls):
            n, s = sizes[i % len(sizes)], int(starts[i])
            assert np.array_equal(got[s:s + n], want[:n]), f"call {i} (n={n}) on rank {r}"


@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_virtual_missing_rank_times_out_instead_of_hanging(provider):
    from gpucoll import testing

    prov = gpu_arrays.provider(provider)
    with testing.virtual_ranks(2, timeout=1.0) as v:
        x = prov.upload(np.ones(100, np.float32), "float32", v.device)
        prov.synchronize(v.device)
        v.comms[0].all_reduce(prov.ptr(x), prov.ptr(x), 100, _C.DType.float32, _C.RedOp.sum, "oneshot",
                              v.streams[0])  # rank 1 never calls
        with pytest.raises(CollectiveTimeout, match=r"virtual ranks \[0\] timed out waiting for rank\(s\) \[1\]") as e:
            v.synchronize()
        assert e.value.ranks == (1,)
        with pytest.raises(InvalidUsage, match="timed out"):
            v.all_reduce([x, x], algo="oneshot")


# -- (a) processes sharing one GPU -----------------------------------------------------------------------------------

def _spawn_matrix(comm, provider):
    prov = gpu_arrays.provider(provider)
    P, r = comm.world_size, comm.rank
    fails = []
    for algo in ALGOS:
        for dtype in DTYPES:
            for op in OPS:
                size = itemsize(dtype)
                # One pack, an odd count, several pieces (several blocks each).
                for i, count in enumerate((16 // size, 37, (200 << 10) // size + 7 if EMULATED else MiB // size + 1)):
                    inputs = inputs_for(dtype, op, count, P, seed=2)
                    in_off, out_off = OFFSETS[(i + ALGOS.index(algo)) % len(OFFSETS)]
                    x = prov.upload(inputs[r], dtype, 0, in_off)
                    out = Output(prov, count, dtype, 0, out_off)
                    comm.all_reduce(x, out.view, op=op, algo=algo)
                    prov.synchronize()
                    bad = out.check(*reference_bytes(inputs, dtype, op))
                    if bad:
                        fails.append(f"{algo} {dtype} {op} count={count} rank {r}: {bad}")
    # Longer than a staging half, in place: several kernels.
    n = (200 << 10) + 3 if EMULATED else 16 * MiB + 3
    big = inputs_for("float32", "sum", n, P, seed=4)
    x = prov.upload(big[r], "float32", 0)
    comm.all_reduce(x, algo="twoshot")
    prov.synchronize()
    if helpers.compare_exact(np.asarray(prov.download(x, "float32")), helpers.reference(big, "float32", "sum")):
        fails.append(f"large in-place twoshot rank {r}")
    # Registered input, read in place by every rank, out of place and in place.
    for algo in ("oneshot", "twoshot"):
        y = prov.upload(big[r][:4097], "float32", 0, 1)
        comm.register(y)
        out = Output(prov, 4097, "float32", 0, 0)
        comm.all_reduce(y, out.view, algo=algo)
        prov.synchronize()
        if out.check(*reference_bytes([b[:4097] for b in big], "float32", "sum")):
            fails.append(f"registered {algo} rank {r}")
        comm.all_reduce(y, algo=algo)
        prov.synchronize()
        if helpers.compare_exact(np.asarray(prov.download(y, "float32")),
                                 helpers.reference([b[:4097] for b in big], "float32", "sum")):
            fails.append(f"registered in-place {algo} rank {r}")
        _REGISTERED.append(y)
    return fails, dict(comm._ops.stats)


@pytest.mark.slow
@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
@pytest.mark.parametrize("P", WORLD)
def test_processes_on_one_gpu(P, provider, monkeypatch):
    if HALF:
        monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", str(HALF))
    results = gpucoll.spawn(_spawn_matrix, P, args=(provider,), backend="custom", timeout=600.0, device=0)
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
    ok = all(helpers.compare_exact(y.cpu().numpy(), helpers.reference(inputs, "float32", "sum")) is None
             for y in (y1, y2))
    mappings = _C.custom_ipc_open_handles()
    del g
    return ok, mappings


def _spawn_graph_emulated(comm):
    """The same through gpucoll's own capture (stream capture of the legacy-free stream the calls run on)."""
    prov = gpu_arrays.provider("device_array")
    P, r, n = comm.world_size, comm.rank, 2049
    s = _C.CudaStream(0)
    x = prov.upload(np.zeros(n, np.float32), "float32")
    y1, y2 = Output(prov, n, "float32", 0, 0), Output(prov, n, "float32", 0, 1)
    for algo, y in (("oneshot", y1), ("twoshot", y2)):  # warm-up, as on a GPU
        comm.all_reduce(x, y.view, algo=algo, stream=s.handle)
    s.synchronize()
    graph = _C.MultiStreamGraph(0, [s.handle])
    with comm.graph_capture():
        graph.begin()
        comm.all_reduce(x, y1.view, algo="oneshot", stream=s.handle)
        comm.all_reduce(x, y2.view, algo="twoshot", stream=s.handle)
        graph.end()
    inputs = [helpers.make_input("float32", "sum", n, q, P, seed=8) for q in range(P)]
    prov.write(x, inputs[r])
    for y in (y1, y2):
        prov.fill_sentinel(y.base)
    graph.replay(1000)
    s.synchronize()
    want = reference_bytes(inputs, "float32", "sum")
    ok = all(y.check(*want) is None for y in (y1, y2))
    mappings = _C.custom_ipc_open_handles()
    del graph
    return ok, mappings


def _close_and_count(comm, provider):
    prov = gpu_arrays.provider(provider)
    t = prov.upload(np.ones(64, np.float32), "float32")
    comm.register(t)
    comm.all_reduce(t)
    prov.synchronize()
    before = _C.custom_ipc_open_handles()
    comm.close()
    return before, _C.custom_ipc_open_handles()


@pytest.mark.parametrize("P", (2, 4))
def test_processes_graph_replays_and_ipc_handles_closed(P):
    fn = _spawn_graph_emulated if gpu_arrays.torch_cuda_problem() else _spawn_graph_and_teardown
    results = gpucoll.spawn(fn, P, backend="custom", timeout=300.0)
    assert all(ok for ok, _ in results)
    assert all(m >= P - 1 for _, m in results)  # peers' memory + their registered buffers were mapped
    counts = gpucoll.spawn(_close_and_count, P, args=("device_array",), backend="custom", timeout=300.0)
    assert all(before >= P - 1 for before, _ in counts), counts
    assert [after for _, after in counts] == [0] * P  # teardown closed every mapping


def _streams_and_async(comm):
    """stream= orders a call after the caller's earlier work on that stream (an upload queued there, not yet done
    when the call is made), and async_op=True returns a Work that completes with the result. Three trials: each
    queues on s a 32 MiB copy, then x's fill; a call on any other stream reads x before the fill."""
    prov = gpu_arrays.provider("device_array")
    P, r, n = comm.world_size, comm.rank, 70001  # several pieces on the emulated device's 64 KiB halves
    s = _C.CudaStream(0)
    inputs = inputs_for("int32", "sum", n, P, seed=6)
    host = np.ascontiguousarray(inputs[r])
    pad_src, pad_dst = prov.empty(8 << 20, "float32"), prov.empty(8 << 20, "float32")
    done, bad = [], []
    for trial in range(3):
        x = prov.empty(n, "int32")
        out = Output(prov, n, "int32", 0, 0)
        _C.cuda_copy(pad_dst.ptr, pad_src.ptr, pad_src.nbytes, 0, s.handle)
        _C.cuda_copy(x.ptr, host.ctypes.data, host.nbytes, 0, s.handle)
        work = comm.all_reduce(x, out.view, algo="twoshot", stream=s.handle, async_op=True)
        work.synchronize()
        done.append(work.is_completed())
        why = out.check(*reference_bytes(inputs, "int32", "sum"))
        if why:
            bad.append(f"trial {trial}: {why}")
        s.synchronize()
    return all(done), bad or None


def test_processes_stream_order_and_async_work(monkeypatch):
    if HALF:
        monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", str(HALF))
    results = gpucoll.spawn(_streams_and_async, 3, backend="custom", timeout=300.0)
    assert results == [(True, None)] * 3, results


class _Produced:
    """`array` as __cuda_array_interface__ v3 gives it, ready only on `stream` (its producer's)."""

    def __init__(self, array, stream: int):
        self._array, self._stream = array, stream

    @property
    def __cuda_array_interface__(self):
        return dict(self._array.__cuda_array_interface__, stream=self._stream)


def _cai_producer_stream(comm, algo):
    """__cuda_array_interface__ v3 on the custom kernels: with stream= naming another stream, the kernel waits for
    the interface's "stream" (the producer's), where a long copy and then the input's fill are still queued. Before
    the custom backend took its stream where NCCL's does (_cuda_buffers.op_stream), it read the input half-made."""
    prov = gpu_arrays.provider("device_array")
    P, r, n = comm.world_size, comm.rank, 20001
    producer, consumer = _C.CudaStream(0), _C.CudaStream(0)
    inputs = inputs_for("float32", "sum", n, P, seed=11)
    pad_src, pad_dst = prov.empty(8 << 20, "float32"), prov.empty(8 << 20, "float32")  # 32 MiB queued first
    host = np.ascontiguousarray(inputs[r])
    bad = []
    for trial in range(3):
        x = prov.empty(n, "float32")
        out = Output(prov, n, "float32", 0, 0)
        _C.cuda_copy(pad_dst.ptr, pad_src.ptr, pad_src.nbytes, 0, producer.handle)
        _C.cuda_copy(x.ptr, host.ctypes.data, host.nbytes, 0, producer.handle)

        comm.all_reduce(_Produced(x, producer.handle), out=out.view, algo=algo, stream=consumer.handle)
        consumer.synchronize()
        why = out.check(*reference_bytes(inputs, "float32", "sum"))
        if why:
            bad.append(f"trial {trial}: {why}")
        producer.synchronize()
    return bad


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_processes_wait_for_a_cai_producers_stream(monkeypatch, algo):
    if HALF:
        monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", str(HALF))
    results = gpucoll.spawn(_cai_producer_stream, 2, args=(algo,), backend="custom", timeout=300.0)
    assert results == [[], []], results


def _missing_peer(comm):
    """Rank 1 never calls: rank 0's kernel gives up after the communicator's timeout, the next synchronisation
    raises CollectiveTimeout naming rank 1, and later calls are refused."""
    prov = gpu_arrays.provider("device_array")
    if comm.rank == 1:
        return None
    x = prov.upload(np.ones(1000, np.float32), "float32")
    comm.all_reduce(x, algo="oneshot")
    out = {}
    try:
        comm.barrier()
    except CollectiveTimeout as e:
        out["timeout"] = (str(e), e.ranks)
    try:
        comm.all_reduce(x, algo="oneshot")
    except InvalidUsage as e:
        out["refused"] = str(e)
    return out


def test_processes_missing_peer_times_out_naming_it():
    results = gpucoll.spawn(_missing_peer, 2, backend="custom", timeout=3.0)
    out = results[0]
    assert "timeout" in out, out
    message, ranks = out["timeout"]
    assert ranks == (1,) and "rank(s) [1]" in message, message
    assert "timed out waiting for a peer" in out.get("refused", ""), out


def _fallback(comm, provider):
    prov = gpu_arrays.provider(provider)
    x = prov.upload(np.full(10, float(comm.rank + 1), np.float32), "float32")
    comm.all_reduce(x, op="prod")  # no custom kernel for prod: NCCL runs it
    prov.synchronize()
    return prov.download(x, "float32").tolist(), dict(comm._ops.stats)


@pytest.mark.parametrize("provider", gpu_arrays.provider_params())
def test_nccl_fallback_with_reason(provider):
    why = gpu_arrays.nccl_ranks_problem(2)
    if why:
        pytest.skip(f"the custom backend's NCCL fallback cannot run here: {why}")
    results = gpucoll.spawn(_fallback, 2, args=(provider,), backend="custom")
    assert all(vals == [2.0] * 10 and stats == {"custom": 0, "nccl": 1} for vals, stats in results)


class _ByteView:
    """A float32 view starting `shift` bytes into `base`'s allocation: misaligned for its element size."""

    def __init__(self, base, shift: int, count: int):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "version": 3, "strides": None,
                                         "data": (base.__cuda_array_interface__["data"][0] + shift, False)}


def _misaligned(comm):
    from gpucoll.errors import InvalidArgument

    A = gpu_arrays.provider("device_array")
    base = A.upload(np.zeros(12, np.float32), "float32")
    try:
        comm.all_reduce(_ByteView(base, 2, 10))
    except InvalidArgument as e:
        refused = str(e)
    else:
        refused = ""
    x = A.upload(np.full(10, float(comm.rank + 1), np.float32), "float32")
    comm.all_reduce(x)  # the refused call left the ranks in step: the next one runs on the kernels
    A.synchronize()
    return refused, A.download(x, "float32").tolist(), dict(comm._ops.stats)


def test_misaligned_pointer_is_an_argument_error_on_every_rank():
    """A pointer not aligned to its element size is a per-rank fact: declining to NCCL on one rank alone would
    split the ranks between two backends, so the one native call raises InvalidArgument before enqueuing."""
    for refused, vals, stats in gpucoll.spawn(_misaligned, 2, backend="custom"):
        assert "aligned to their element size" in refused and "4 bytes" in refused, refused
        assert vals == [3.0] * 10 and stats == {"custom": 1, "nccl": 0}, (vals, stats)


def _old_nccl_shared_gpu(comm):
    from gpucoll.errors import Unsupported

    A = gpu_arrays.provider("device_array")
    x = A.upload(np.full(10, float(comm.rank + 1), np.float32), "float32")
    comm.all_reduce(x)
    A.synchronize()
    refused = ""
    try:
        comm.all_reduce(x, op="prod")  # no custom kernel: the fallback would run it, and there is none
    except Unsupported as e:
        refused = str(e)
    return A.download(x, "float32").tolist(), refused, dict(comm._ops.stats)


def test_processes_share_a_gpu_with_an_nccl_older_than_2_30(monkeypatch):
    """Ranks on one GPU with an NCCL that cannot share it (the GPU image's NCCL was 2.28.9): the custom kernels run
    and the NCCL fallback is left out on every rank, with the reason; its init used to fail every rank ('Duplicate
    GPU detected'). The emulated NCCL stand-in plays 2.28.9 here; a real GPU meets it with its own NCCL."""
    from gpucoll import _nccl

    if EMULATED:
        monkeypatch.setenv("NCCL_EMU_VERSION", "22809")
    elif _C.nccl_multi_rank_gpu_supported(int(_nccl.load().get("version") or 0)):
        pytest.skip("the loaded NCCL (>= 2.30) shares GPUs: test_nccl_fallback_with_reason covers it")
    for vals, refused, stats in gpucoll.spawn(_old_nccl_shared_gpu, 2, backend="custom", device=0, timeout=120.0):
        assert vals == [3.0] * 10 and stats == {"custom": 1, "nccl": 0}, (vals, stats)
        assert "no NCCL fallback" in refused and "share a GPU" in refused and "2.28.9" in refused, refused


def test_sanitizers_clean():
    if EMULATED:
        pytest.skip("compute-sanitizer needs a real GPU (the emulated device has ThreadSanitizer: tests/emulation)")
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH")
    script = Path(__file__).with_name("sanitize_custom.py")
    proc = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _process_shapes(comm, nbytes):
    native = comm._ops.impl
    return native.sms, tuple(native.shape_for("twoshot", nbytes, _C.DType.float32, _C.RedOp.sum))


def test_processes_sharing_a_gpu_cap_their_grids_like_virtual_ranks():
    """Under CUDA MPS the kernels of processes on one GPU run at once and spin on each other, as virtual ranks do:
    every block of every rank must be resident together. (An H200 run of the process tests under MPS stalled:
    bench/results/h200-2026-11-27-second.) Each process's grid is capped as P virtual ranks' would be."""
    P, nbytes = 3, 64 * MiB
    shapes = gpucoll.spawn(_process_shapes, P, args=(nbytes,), backend="custom", device=0, timeout=120.0)
    from gpucoll.testing import virtual_ranks

    with virtual_ranks(P, device=0) as vr:
        want = tuple(vr.launch_shape("twoshot", nbytes))
    sms = shapes[0][0]
    assert all(s == (sms, want) for s in shapes), (shapes, want)
    uncapped = tuple(_C.custom_launch_shape("twoshot", nbytes, P, sms))
    if want[0] == uncapped[0]:
        pytest.skip(f"this device's {sms} SMs hold every block of {P} uncapped ranks: the cap does not bind")
    assert want[0] < uncapped[0]
