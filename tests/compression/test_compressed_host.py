"""all_reduce(x, compress=...) on the host backend (csrc/backends/host/compressed.cc).

Every rank's result must equal gpucoll.compression.reference bit for bit (the same wire format computed in NumPy
from every rank's input), be the same on every rank, lie within error_bound of the exact sum on finite elements,
and keep NaN and ±Inf where the exact sum of the inputs has them. Inputs are adversarial per block: one huge value,
denormals, all-equal blocks, zeros, a block straddling the end of a piece, NaN and ±Inf. Bad calls raise the same
typed error on every rank and leave the communicator usable.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import compression
from gpucoll.errors import InvalidArgument

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

SENTINEL = 0x5A
SIZES = (1, 255, 256, 257, 5000, 70001)


def _input(rank: int, n: int, kind: str) -> np.ndarray:
    """Distinct per rank and element; `kind` shapes each 256-element block."""
    rng = np.random.default_rng(1000 * rank + n + (7 if kind == "special" else 0))
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1 + rank)
    nb = -(-n // 256)
    for b in range(nb):
        lo, hi = b * 256, min(n, b * 256 + 256)
        mode = (b + rank) % 6 if kind == "mixed" else -1
        if mode == 0:    # one huge value: the rest of the block keeps only what its scale allows
            x[lo + (7 * b + rank) % (hi - lo)] = np.float32(3e4 * (rank + 1))
        elif mode == 1:  # denormals
            x[lo:hi] = (rng.integers(-50, 50, hi - lo) * 1e-40).astype(np.float32)
        elif mode == 2:  # all equal
            x[lo:hi] = np.float32(0.75 + rank)
        elif mode == 3:  # zeros
            x[lo:hi] = 0
        elif mode == 4:  # tiny but normal, below 2^-100
            x[lo:hi] *= np.float32(2.0 ** -110)
    if kind == "special" and n >= 8:
        x[1] = np.inf if rank == 0 else 1.0           # +Inf + finite
        x[3] = np.inf if rank == 0 else (-np.inf if rank == 1 else 2.0)  # +Inf + -Inf: NaN (P >= 2)
        x[5] = np.nan if rank == 0 else 3.0  # a NaN anywhere survives
        x[7] = -np.inf
    return x


def _bits_equal(got: np.ndarray, want: np.ndarray) -> bool:
    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    same_nan = np.array_equal(np.isnan(g), np.isnan(w))
    fin = ~np.isnan(w)
    return same_nan and np.array_equal(g[fin].view(np.uint32), w[fin].view(np.uint32))


def _check(fails, what, got32, inputs, wire, op, dtype, want32):
    if not _bits_equal(got32, want32):
        bad = np.flatnonzero(got32.view(np.uint32) != want32.view(np.uint32))
        fails.append(f"{what}: differs from the NumPy reference at {bad[:5].tolist()}: got {got32[bad[:3]].tolist()}, "
                     f"want {want32[bad[:3]].tolist()}")
        return
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    if op == "avg":
        exact = exact / len(inputs)
    finite = np.isfinite(exact) & np.all([np.isfinite(x) for x in inputs], axis=0)
    err = np.abs(got32.astype(np.float64) - exact)
    bound = compression.error_bound(inputs, wire, op, dtype)
    over = np.flatnonzero(finite & ~(err <= bound))
    if over.size:
        i = over[0]
        fails.append(f"{what}: error {err[i]:.3g} over the bound {bound[i]:.3g} at element {i} (exact {exact[i]!r})")
    # NaN and ±Inf where the exact sum of the inputs has them (overflow of finite inputs aside)
    nonfinite = ~np.all([np.isfinite(x) for x in inputs], axis=0)
    if not np.array_equal(np.isnan(got32[nonfinite]), np.isnan(exact[nonfinite])) or not np.array_equal(
            np.isinf(got32[nonfinite]) & (got32[nonfinite] > 0), np.isinf(exact[nonfinite]) & (exact[nonfinite] > 0)):
        fails.append(f"{what}: NaN/Inf not carried: got {got32[nonfinite].tolist()[:6]}, "
                     f"exact {exact[nonfinite].tolist()[:6]}")


def _worker(comm, sizes, dtypes):
    P, r = comm.world_size, comm.rank
    fails = []
    for wire in compression.WIRES:
        for n in sizes:
            for kind in ("mixed", "special"):
                for op in ("sum", "avg"):
                    for dtype in dtypes:
                        inputs32 = [_input(q, n, kind) for q in range(P)]
                        inputs = [x.astype(dtype) for x in inputs32]
                        want32 = compression.reference(inputs, wire, op)
                        want = want32.astype(dtype).astype(np.float32)
                        what = f"P={P} {wire} {op} {dtype} n={n} {kind}"
                        x = inputs[r].copy()
                        if (n + len(kind)) % 2:
                            comm.all_reduce(x, op=op, compress=wire)
                            got = x
                        else:  # out of place into a sentinel-filled array; x untouched
                            got = np.empty_like(x)
                            got.view(np.uint8).fill(SENTINEL)
                            assert comm.all_reduce(x, out=got, op=op, compress=wire) is got
                            if not np.array_equal(x.view(np.uint8), inputs[r].view(np.uint8)):
                                fails.append(f"{what}: out of place wrote x")
                        _check(fails, what, got.astype(np.float32), inputs, wire, op, dtype, want)
    return fails


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compressed_all_reduce_matches_the_reference_bit_for_bit(world_size):
    per_rank = gpucoll.spawn(_worker, world_size, args=(SIZES, ("float32", "float16")), backend="host",
                             timeout=120.0)
    fails = [f for rank_fails in per_rank for f in rank_fails]
    assert not fails, helpers.format_failures(fails)


def test_many_pieces_and_ranks_without_a_chunk(monkeypatch):
    """Small segments: a vector of many pieces, the last one partial, and pieces where some ranks own no block."""
    monkeypatch.setenv("GPUCOLL_HOST_SEGMENT_BYTES", "1024")
    per_rank = gpucoll.spawn(_worker, 5, args=((513, 9000), ("float32",)), backend="host", timeout=120.0)
    fails = [f for rank_fails in per_rank for f in rank_fails]
    assert not fails, helpers.format_failures(fails)


def _bf16_worker(comm):
    import torch

    P, r = comm.world_size, comm.rank
    fails = []
    for wire in compression.WIRES:
        inputs32 = [_input(q, 3001, "mixed") for q in range(P)]
        inputs = [torch.from_numpy(x).to(torch.bfloat16) for x in inputs32]
        as32 = [t.float().numpy() for t in inputs]
        want = torch.from_numpy(compression.reference(as32, wire, "sum")).to(torch.bfloat16).float().numpy()
        t = inputs[r].clone()
        comm.all_reduce(t, compress=wire)
        _check(fails, f"bfloat16 {wire}", t.float().numpy(), as32, wire, "sum", "bfloat16", want)
    return fails


def test_bfloat16_torch_tensors():
    helpers.require("torch")
    per_rank = gpucoll.spawn(_bf16_worker, 3, backend="host", timeout=120.0)
    fails = [f for rank_fails in per_rank for f in rank_fails]
    assert not fails, helpers.format_failures(fails)


def _errors_worker(comm):
    r = comm.rank
    seen = []

    def expect(what, fn, *needles):
        try:
            fn()
        except InvalidArgument as e:
            missing = [s for s in needles if s not in str(e)]
            seen.append(f"{what}: ok" if not missing else f"{what}: message lacks {missing}: {e}")
        except Exception as e:  # noqa: BLE001 - reported as a failure below
            seen.append(f"{what}: raised {type(e).__name__}: {e}")
        else:
            seen.append(f"{what}: did not raise")
        seen.append(f"{what}: after: {helpers.still_works(comm) or 'usable'}")

    x = np.arange(300, dtype=np.float32)
    expect("unknown format", lambda: comm.all_reduce(x, compress="int4"), "compress", "int4")
    expect("not a string", lambda: comm.all_reduce(x, compress=8), "compress")
    expect("integer data", lambda: comm.all_reduce(np.arange(300, dtype=np.int32), compress="int8"),
           "compress", "int32")
    expect("float64 data", lambda: comm.all_reduce(np.arange(300, dtype=np.float64), compress="bf16"),
           "compress", "float64")
    expect("op max", lambda: comm.all_reduce(x, op="max", compress="int8"), "compress", "max")
    expect("an algorithm", lambda: comm.all_reduce(x, algo="ring", compress="int8"), "algo")
    # only rank 0 compresses: the call check reports it on every rank instead of reducing int8 codes with floats
    expect("mismatch", lambda: comm.all_reduce(x, compress="int8" if r == 0 else None), "compress")
    expect("mismatched formats", lambda: comm.all_reduce(x, compress="int8" if r == 0 else "fp8"), "compress")
    # async
    y = np.full(1000, r + 1, np.float32)
    work = comm.all_reduce(y, compress="int8", async_op=True)
    work.wait()
    total = sum(q + 1 for q in range(comm.world_size))
    seen.append("async: ok" if np.array_equal(y, np.full(1000, total, np.float32)) else f"async: got {y[:4]}")
    return seen


def test_bad_calls_raise_on_every_rank_and_leave_it_usable():
    per_rank = gpucoll.spawn(_errors_worker, 3, backend="host", timeout=60.0)
    for rank, seen in enumerate(per_rank):
        bad = [s for s in seen if not s.endswith((": ok", ": usable"))]
        assert not bad, f"rank {rank}: {bad}"


def test_only_the_host_backend_compresses():
    """The Backend default: a typed Unsupported that says where compression runs (nccl and custom have none)."""
    from gpucoll.backends.base import Backend
    from gpucoll.errors import Unsupported

    class Fake(Backend):
        name = "nccl"
        create = device = check_buffer = collective = algorithm_for = None

    with pytest.raises(Unsupported, match="host backend"):
        Fake.compressed_all_reduce(Fake.__new__(Fake), None, None, None, "int8", None, False)
