"""all_reduce(x, compress=...) on gpucoll's kernels (backends/custom/kernels/compressed.cu), run on a real GPU or on
the emulated device (GPUCOLL_CUDA=emulate): the same result bit for bit as the NumPy reference of the wire format
(gpucoll.compression.reference), which the host backend also matches, at P = 2, 3, 4, 8, every format, sum and avg,
float32 and float16, counts that leave partial quant blocks and cross staging pieces; the output's every byte is
compared and every rank must hold the same bits. A call only some ranks compress raises InvalidArgument on every
rank (the kernels' call check), and the communicator stays usable."""

from __future__ import annotations

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import compression
from gpucoll.errors import InvalidArgument
from gpucoll.testing import DeviceArray

pytestmark = [pytest.mark.spawns, pytest.mark.gpu, *helpers.timeout_mark(600)]

HALF = 64 << 10  # staging half: a compressed piece is 30,720 elements, so 70,001 is three pieces
COUNTS = (1, 255, 257, 5000, 70001)


def _input(q: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(100 * q + n)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(q + 1)
    for b in range(0, n, 256 * 5):  # one huge value every fifth block, an all-equal block, a tiny one
        x[b] = np.float32(4e4 * (q + 1))
        x[b + 256:b + 512] = np.float32(q + 0.5)
        x[b + 512:b + 768] *= np.float32(2.0 ** -110)
    if n > 9:
        x[3], x[5], x[7] = (np.inf if q == 0 else 1.0), (np.nan if q == P_NAN else 2.0), -np.inf
    return x


P_NAN = 1


def _exact(comm, counts, dtypes):
    P, r = comm.world_size, comm.rank
    dev = int(comm.device.split(":")[1])
    fails, results = [], {}
    for wire in compression.WIRES:
        for op in ("sum", "avg"):
            for dtype in dtypes:
                for n in counts:
                    inputs = [_input(q, n).astype(dtype) for q in range(P)]
                    want = compression.reference(inputs, wire, op).astype(dtype)
                    x = DeviceArray.from_host(inputs[r], device=dev)
                    y = DeviceArray.from_host(np.full(n, -7, dtype), device=dev)
                    comm.all_reduce(x, y, op=op, compress=wire)
                    comm.barrier()
                    got = y.to_host()
                    what = f"P={P} {wire} {op} {dtype} n={n}"
                    bits = np.uint16 if dtype == "float16" else np.uint32
                    if not np.array_equal(got.view(bits), want.view(bits)):
                        bad = np.flatnonzero(got.view(bits) != want.view(bits))
                        fails.append(f"{what}: {bad.size} elements differ from the reference, first at "
                                     f"{bad[:4].tolist()}: {got[bad[:3]].tolist()} vs {want[bad[:3]].tolist()}")
                    if not np.array_equal(x.to_host().view(bits), inputs[r].view(bits)):
                        fails.append(f"{what}: the input was written")
                    results[what] = got.view(bits).tobytes()
    return fails, results


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_kernels_match_the_reference_bit_for_bit(P, monkeypatch):
    monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", str(HALF))
    counts = COUNTS if P <= 4 else (257, 70001)
    dtypes = ("float32", "float16") if P <= 3 else ("float32",)
    per_rank = gpucoll.spawn(_exact, P, args=(counts, dtypes), backend="custom", timeout=300.0)
    fails = [f for rank_fails, _ in per_rank for f in rank_fails]
    assert not fails, helpers.format_failures(fails)
    for _, res in per_rank[1:]:
        assert res == per_rank[0][1], "ranks hold different bits"


def _mismatch(comm):
    r = comm.rank
    dev = int(comm.device.split(":")[1])
    seen = []
    for compress in (("int8", None), ("int8", "fp8")):
        x = DeviceArray.from_host(np.arange(1000, dtype=np.float32), device=dev)
        y = DeviceArray.from_host(np.full(1000, -7, np.float32), device=dev)
        comm.all_reduce(x, y, compress=compress[0] if r == 0 else compress[1])
        try:
            comm.barrier()
            seen.append("no error")
        except InvalidArgument as e:
            seen.append("compress" in str(e) and "different calls" in str(e))
        seen.append(bool((y.to_host() == -7).all()))
    z = DeviceArray.from_host(np.full(1000, r + 1, np.float32), device=dev)
    comm.all_reduce(z, compress="int8")
    comm.barrier()
    seen.append(bool((z.to_host() == sum(q + 1 for q in range(comm.world_size))).all()))
    try:
        comm.all_reduce(DeviceArray.from_host(np.arange(10, dtype=np.int32), device=dev), compress="int8")
        seen.append("int32 ran")
    except InvalidArgument as e:
        seen.append("int32" in str(e))
    return seen


def test_a_call_only_some_ranks_compress_raises_on_every_rank():
    per_rank = gpucoll.spawn(_mismatch, 3, backend="custom", timeout=120.0)
    for rank, seen in enumerate(per_rank):
        assert seen == [True] * len(seen), f"rank {rank}: {seen}"
