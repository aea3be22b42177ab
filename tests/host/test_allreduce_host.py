"""all_reduce on the host backend: every dtype x op x world size 1-4 x count {0, 1, 7, 1000, 2**20+3}, in place and
out of place, checked bit for bit on every rank against the exact NumPy reference of tests/support/helpers.py.

One gpucoll.spawn per world size (a module-scoped fixture): each worker loops over all cases and returns its
failures as text, and the tests below only read those reports. bfloat16 and the CPU torch tensor cases need
torch in the workers; without torch they are skipped with the reason.
"""

from __future__ import annotations

import time

import helpers
import numpy as np
import pytest
from helpers import DTYPES, HAVE_TORCH, OPS

import gpucoll

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(600)]

WORLD_SIZES = (1, 2, 3, 4)
SMALL_COUNTS = (0, 1, 7, 1000)
LARGE = 2**20 + 3  # above one pipelining segment and not a multiple of any world size
SEED = 1234
SENTINEL_BYTE = 0xA5  # out buffers start filled with it, so an element the library never wrote shows up


def _shape(count: int, k: int) -> tuple:
    """Vary the array shape a little: 0-d for some count-1 cases, 2-D for some count-1000 ones."""
    if count == 1 and k % 2:
        return ()
    if count == 1000 and k % 2 == 0:
        return (10, 100)
    return (count,)


def cases_for(world_size: int) -> list:
    """(dtype, op, count, shape). Every dtype x op x small count; the large count for every dtype x op at world
    size 4 and for one op per dtype (rotating with the world size) at the others."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, op in enumerate(OPS):
            for count in SMALL_COUNTS:
                cases.append((dtype, op, count, _shape(count, i + j)))
            if world_size == 4 or (i + j + world_size) % len(OPS) == 0:
                cases.append((dtype, op, LARGE, (LARGE,)))
    return cases


def torch_cases_for(world_size: int) -> list:
    """A few CPU torch tensor cases: each non-bf16 dtype once at count 1000, every op once on float32."""
    cases = [(dtype, OPS[(i + world_size) % len(OPS)], 1000, _shape(1000, i))
             for i, dtype in enumerate(d for d in DTYPES if d != "bfloat16")]
    cases += [("float32", op, 7, (7,)) for op in OPS]
    return cases


# -- worker (module level: gpucoll.spawn pickles it by reference) -----------------------------------------------

def _check_numpy(comm, x_in, want, op, inplace):
    x = x_in.copy()
    if inplace:
        res = comm.all_reduce(x, op=op)
        if res is not x:
            return f"returned {type(res).__name__} {id(res)}, not x itself"
        got = x
    else:
        out = np.empty_like(x)
        out.reshape(-1).view(np.uint8).fill(SENTINEL_BYTE)
        res = comm.all_reduce(x, out=out, op=op)
        if res is not out:
            return "returned something other than out"
        err = helpers.compare_exact(x.reshape(-1), x_in.reshape(-1))
        if err:
            return f"modified its input x: {err}"
        got = out
    if got.shape != x_in.shape:
        return f"result shape {got.shape}, expected {x_in.shape}"
    return helpers.compare_exact(got.reshape(-1), want.reshape(-1))


def _torch_bits(t):
    """Bit patterns of a CPU tensor as a NumPy unsigned array (works for bfloat16, which NumPy lacks)."""
    import torch

    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
    if t.numel() == 0:  # torch refuses to reinterpret an empty tensor's elements
        return np.empty(0, dtype=unsigned)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().reshape(-1).view(signed).numpy().view(unsigned)


def _check_torch(comm, x_np, want, dtype, op, inplace):
    import torch

    if dtype == "bfloat16":
        x = torch.from_numpy(x_np.copy()).to(torch.bfloat16)  # exact: the values are bf16-representable
        want_bits = helpers.bf16_bits(want)
    else:
        x = torch.from_numpy(x_np.copy())
        want_bits = helpers._bits(want)
    x_before = _torch_bits(x).copy()
    if inplace:
        res = comm.all_reduce(x, op=op)
        if res is not x:
            return "returned something other than x itself"
        got = x
    else:
        out = torch.empty_like(x)
        if out.numel():
            out.reshape(-1).view(torch.uint8).fill_(SENTINEL_BYTE)
        res = comm.all_reduce(x, out=out, op=op)
        if res is not out:
            return "returned something other than out"
        if not np.array_equal(_torch_bits(x), x_before):
            return "modified its input x"
        got = out
    if tuple(got.shape) != tuple(x_np.shape):
        return f"result shape {tuple(got.shape)}, expected {tuple(x_np.shape)}"
    got_values = got.reshape(-1).float().numpy() if dtype == "bfloat16" else None
    want_values = want.reshape(-1) if dtype == "bfloat16" else None
    return helpers.mismatch(_torch_bits(got), want_bits, got_values, want_values)


def _allreduce_worker(comm, cases, torch_cases, with_torch):
    """Runs every case on this rank; returns {"numpy"|"bf16"|"torch"|"api": [failure text], "checked": {...}}."""
    W, rank = comm.world_size, comm.rank
    report = {"numpy": [], "bf16": [], "torch": [], "api": [], "checked": {"numpy": 0, "bf16": 0, "torch": 0}}
    if (comm.rank, comm.world_size, comm.backend) != (rank, W, "host"):
        report["api"].append(f"properties: rank={comm.rank} world_size={comm.world_size} backend={comm.backend}")
    if with_torch:
        import torch  # noqa: F401 - imported once here rather than inside the first case

    plan = [("numpy", c) for c in cases if c[0] != "bfloat16"]
    if with_torch:
        plan += [("bf16", c) for c in cases if c[0] == "bfloat16"]
        plan += [("torch", c) for c in torch_cases]
    stop = None
    cache = {}
    for kind, (dtype, op, count, shape) in plan:
        key = (dtype, op, count)
        if key not in cache:
            cache.clear()  # keep at most one set of large inputs alive
            inputs = [helpers.make_input(dtype, op, count, q, W, SEED) for q in range(W)]
            cache[key] = (inputs[rank].reshape(shape), helpers.reference(inputs, dtype, op))
        x_np, want = cache[key]
        for inplace in (False, True):
            label = f"{kind} {dtype} {op} count={count} shape={shape} {'in place' if inplace else 'out of place'}"
            try:
                if kind == "numpy":
                    err = _check_numpy(comm, x_np, want, op, inplace)
                else:
                    err = _check_torch(comm, x_np, want, dtype, op, inplace)
            except Exception as exc:  # noqa: BLE001 - reported to the parent as text
                err = f"raised {type(exc).__name__}: {exc}"
                if isinstance(exc, (gpucoll.InvalidUsage, gpucoll.CollectiveTimeout, gpucoll.RemoteError)):
                    stop = label  # the communicator is broken or out of step: later cases would only echo this
            report["checked"][kind] += 1
            if err:
                report[kind].append(f"{label}: {err}")
            if stop:
                report[kind].append(f"stopped after {stop}")
                return report
        if count == LARGE:
            comm.barrier()  # barriers interleaved with collectives must keep the ranks in step

    # The op may also be given as a gpucoll._C.RedOp member or in upper case.
    from gpucoll import _C

    for op in (_C.RedOp.max, "MAX"):
        x = np.arange(5, dtype=np.int32) * (rank + 1)
        try:
            comm.all_reduce(x, op=op)
            if not np.array_equal(x, np.arange(5, dtype=np.int32) * W):
                report["api"].append(f"op={op!r}: got {x.tolist()}")
        except Exception as exc:  # noqa: BLE001
            report["api"].append(f"op={op!r} raised {type(exc).__name__}: {exc}")
    return report


# -- tests --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def reports(request):
    world_size = request.param
    t0 = time.monotonic()
    per_rank = gpucoll.spawn(_allreduce_worker, world_size,
                             args=(cases_for(world_size), torch_cases_for(world_size), HAVE_TORCH),
                             backend="host", timeout=120.0)
    elapsed = time.monotonic() - t0
    assert len(per_rank) == world_size
    return world_size, per_rank, elapsed


def _assert_clean(per_rank, kind, at_least=None):
    failures = helpers.merge_rank_failures(per_rank, kind)
    assert not failures, helpers.format_failures(failures)
    if at_least is None:
        return
    for r, report in enumerate(per_rank):
        assert report["checked"][kind] >= at_least, f"rank {r} checked only {report['checked'][kind]} {kind} cases"


@pytest.mark.slow
def test_numpy_all_dtypes_ops_counts_exact(reports):
    world_size, per_rank, _ = reports
    n = 2 * sum(1 for c in cases_for(world_size) if c[0] != "bfloat16")
    _assert_clean(per_rank, "numpy", n)
    _assert_clean(per_rank, "api")


def test_bfloat16_exact(reports):
    if not HAVE_TORCH:
        pytest.skip(helpers.missing_reason("torch", "bfloat16 arrays need torch (NumPy has no bfloat16)"))
    world_size, per_rank, _ = reports
    _assert_clean(per_rank, "bf16", 2 * sum(1 for c in cases_for(world_size) if c[0] == "bfloat16"))


def test_cpu_torch_tensors_exact(reports):
    helpers.require("torch")
    world_size, per_rank, _ = reports
    _assert_clean(per_rank, "torch", 2 * len(torch_cases_for(world_size)))


def test_case_table_covers_everything():
    """The case table itself: every dtype x op x count at every world size, and the large count for every dtype
    and every op at world size 4."""
    for world_size in WORLD_SIZES:
        cases = cases_for(world_size)
        for dtype in DTYPES:
            for op in OPS:
                counts = {c for d, o, c, _ in cases if d == dtype and o == op}
                assert set(SMALL_COUNTS) <= counts, (world_size, dtype, op, counts)
        large = {(d, o) for d, o, c, _ in cases if c == LARGE}
        assert {d for d, _ in large} == set(DTYPES), world_size
        if world_size == 4:
            assert large == {(d, o) for d in DTYPES for o in OPS}
