"""all_reduce_coalesced and all_gather_coalesced on the host backend (tensor fusion, issue 32), world sizes 2, 3 and 4.

One gpucoll.spawn per world size (a module-scoped fixture): each worker runs every case and returns its failures as
text, and the tests below read those reports. The worker sets GPUCOLL_HOST_FUSION_BYTES to 4 KiB before its first
coalesced call, so lists of a few thousand elements already run as several chunks (and the all-gather of the totals
that guards them). Inputs are helpers.make_input's, exact in every dtype, distinct per rank, element and array, and
each array is checked bit for bit against the exact reference of its own inputs.
"""

from __future__ import annotations

import os

import helpers
import numpy as np
import pytest
from helpers import HAVE_TORCH

import gpucoll

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZES = (2, 3, 4)
CHUNK = 4096  # bytes: GPUCOLL_HOST_FUSION_BYTES in the workers
SEED = 4321
# Per list: the arrays' sizes. 0-size arrays sit inside lists; the last two lists cross the 4 KiB chunk many times,
# with arrays that straddle chunk boundaries (511, 1025 and 3001 elements are not multiples of anything).
SIZES = ([1], [7, 0, 1000, 33], [511, 1, 1025, 0, 3001, 2], [4096, 5, 4099])
NP_CASES = (("float32", "sum"), ("float32", "max"), ("float64", "avg"), ("float16", "sum"), ("int32", "sum"),
            ("int64", "prod"), ("int8", "min"), ("uint8", "sum"))
TORCH_CASES = (("bfloat16", "sum"), ("float16", "max"), ("float32", "avg"), ("int64", "sum"))


def _inputs(dtype, op, sizes, W, tag):
    """Per array: every rank's input (distinct per array through the seed) and the exact result."""
    out = []
    for k, n in enumerate(sizes):
        per_rank = [helpers.make_input(dtype, op, n, q, W, SEED + 97 * k + tag) for q in range(W)]
        out.append((per_rank, helpers.reference(per_rank, dtype, op)))
    return out


def _torch_bits(t):
    import torch

    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
    if t.numel() == 0:
        return np.empty(0, dtype=unsigned)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(signed).numpy().view(unsigned)


def _raises(fn, exc_type, *needles):
    """"" if fn() raises exc_type with every needle in its message, else what happened."""
    try:
        fn()
    except exc_type as e:
        missing = [n for n in needles if n not in str(e)]
        return f"message lacks {missing}: {e}" if missing else ""
    except Exception as e:  # noqa: BLE001 - reported as text
        return f"raised {type(e).__name__} instead of {exc_type.__name__}: {e}"
    return f"did not raise {exc_type.__name__}"


def _worker(comm, with_torch):
    os.environ["GPUCOLL_HOST_FUSION_BYTES"] = str(CHUNK)  # read when the first coalesced call makes the stager
    W, r = comm.world_size, comm.rank
    fails = []

    def check(label, got_list, cases, bits=None):
        for k, (got, (_, want)) in enumerate(zip(got_list, cases)):
            if bits is not None:
                err = helpers.mismatch(bits(got), helpers.bf16_bits(want) if want.dtype == np.float32 and
                                       str(got.dtype) == "torch.bfloat16" else helpers._bits(want))
            else:
                err = helpers.compare_exact(np.asarray(got).reshape(-1), want.reshape(-1))
            if err:
                fails.append(f"{label} arrays[{k}]: {err}")

    # Exact results, NumPy, every size list; the same list in place is returned.
    for t, (dtype, op) in enumerate(NP_CASES):
        for s, sizes in enumerate(SIZES):
            cases = _inputs(dtype, op, sizes, W, 1000 * t + 10 * s)
            arrays = [c[0][r].copy() for c in cases]
            res = comm.all_reduce_coalesced(arrays, op=op)
            if res is not arrays:
                fails.append(f"numpy {dtype} {op} {sizes}: returned something other than the list")
            check(f"numpy {dtype} {op} {sizes}", arrays, cases)

    # Zero-copy: consecutive views of one buffer (in place, no staging), reversed views (staged), and a mixture of
    # views and separate arrays, across chunks; a 2-D array among them.
    sizes = [300, 2000, 1, 1700, 1000]
    cases = _inputs("float32", "sum", sizes, W, 7)
    flat = np.concatenate([c[0][r] for c in cases])
    offs = np.cumsum([0, *sizes])
    views = [flat[offs[k]:offs[k + 1]] for k in range(len(sizes))]
    comm.all_reduce_coalesced(views)
    check("adjacent views", views, cases)
    flat = np.concatenate([c[0][r] for c in cases])
    views = [flat[offs[k]:offs[k + 1]] for k in range(len(sizes))]
    comm.all_reduce_coalesced(views[::-1])
    check("reversed views", views, cases)
    flat = np.concatenate([c[0][r] for c in cases])
    mixed = [flat[offs[0]:offs[1]], cases[1][0][r].copy(), flat[offs[2]:offs[3]], flat[offs[3]:offs[4]],
             cases[4][0][r].copy().reshape(10, 100)]
    comm.all_reduce_coalesced(mixed)
    check("views and arrays", mixed, cases)
    stager = comm._ops._coalescer
    if stager.chunk_bytes != CHUNK or stager.staging_bytes > CHUNK:
        fails.append(f"staging: chunk {stager.chunk_bytes}, holds {stager.staging_bytes} bytes (bound {CHUNK})")

    # torch CPU tensors (bfloat16 included), and async_op=True.
    if with_torch:
        import torch

        for t, (dtype, op) in enumerate(TORCH_CASES):
            cases = _inputs(dtype, op, SIZES[2], W, 5000 + t)
            tdt = getattr(torch, dtype)
            tensors = [torch.from_numpy(c[0][r].copy()).to(tdt) for c in cases]
            comm.all_reduce_coalesced(tensors, op=op)
            check(f"torch {dtype} {op}", tensors, cases, bits=_torch_bits)
        cases = _inputs("float32", "sum", SIZES[3], W, 6000)
        tensors = [torch.from_numpy(c[0][r].copy()) for c in cases]
        work = comm.all_reduce_coalesced(tensors, async_op=True)
        work.wait()
        if work.result() is not tensors:
            fails.append("async_op: result() is not the list")
        check("torch async_op", tensors, cases, bits=_torch_bits)
    cases = _inputs("int32", "max", SIZES[3], W, 6100)
    arrays = [c[0][r].copy() for c in cases]
    work = comm.all_reduce_coalesced(arrays, op="max", async_op=True)
    work.wait()
    check("numpy async_op", arrays, cases)

    # A synchronous call after an async one on the same arrays packs them only once the async one wrote them.
    for sizes in ((300, 5, 70), (3000, 5, 700)):  # one chunk, several
        seq = [np.full(n, r + 1, np.int64) for n in sizes]
        work = comm.all_reduce_coalesced(seq, async_op=True)
        comm.all_reduce_coalesced(seq)
        work.wait()
        if not all(np.all(a == W * (W * (W + 1) // 2)) for a in seq):
            fails.append(f"async then sync on the same arrays {sizes}: {[int(a[0]) for a in seq]}")

    # premul_sum goes per array (the native path reduces with RedOps).
    x = [np.full(3, r + 1, np.float32), np.full(5, 2 * (r + 1), np.float32)]
    comm.all_reduce_coalesced(x, op=gpucoll.premul_sum(2.0))
    tot = W * (W + 1)
    if not (np.all(x[0] == tot) and np.all(x[1] == 2 * tot)):
        fails.append(f"premul_sum: got {x[0].tolist()} {x[1].tolist()}")

    # Empty list (still one collective: a rank with nothing meets the others), single array, a tuple.
    seq = comm._ops.impl.op_seq
    if comm.all_reduce_coalesced([]) != [] or comm.all_gather_coalesced([]) != []:
        fails.append("empty list: not returned")
    if comm._ops.impl.op_seq != seq + 2:
        fails.append(f"empty lists made {comm._ops.impl.op_seq - seq} collectives, not 2")
    err = _raises(lambda: comm.all_reduce_coalesced([] if r else [np.ones(3, np.float32)]), gpucoll.InvalidArgument,
                  "all_reduce_coalesced")
    if err:
        fails.append(f"an empty list on some ranks only: {err}")
    one = np.arange(10, dtype=np.int64) * (r + 1)
    comm.all_reduce_coalesced((one,))
    if not np.array_equal(one, np.arange(10) * (W * (W + 1) // 2)):
        fails.append(f"single array: {one.tolist()}")

    # Argument errors, raised alike on every rank before anything ran; the communicator stays usable.
    fl = np.zeros(4, np.float32)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    bad = [
        ("mixed dtype", lambda: comm.all_reduce_coalesced([fl, np.zeros(4, np.float64)]), gpucoll.InvalidArgument,
         ("arrays[1]", "float64", "float32")),
        ("read-only", lambda: comm.all_reduce_coalesced([fl, fl[:0], ro]), gpucoll.InvalidArgument,
         ("arrays[2]", "writable")),
        ("strided", lambda: comm.all_reduce_coalesced([np.zeros(8, np.float32)[::2]]), gpucoll.InvalidArgument,
         ("arrays[0]", "contiguous")),
        ("overlap", lambda: comm.all_reduce_coalesced([fl, fl[1:]]), gpucoll.InvalidArgument, ("arrays[1]",)),
        ("not a list", lambda: comm.all_reduce_coalesced(fl), gpucoll.InvalidArgument, ("arrays",)),
        ("bad op", lambda: comm.all_reduce_coalesced([fl], op="xor"), gpucoll.InvalidArgument, ("op",)),
    ]
    if with_torch:
        import torch

        bad.append(("mixed torch dtype", lambda: comm.all_reduce_coalesced(
            [torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)]), gpucoll.InvalidArgument, ("arrays[1]",)))
    for label, fn, exc, needles in bad:
        err = _raises(fn, exc, *needles)
        if err:
            fails.append(f"{label}: {err}")
    err = helpers.still_works(comm)
    if err:
        fails.append(f"after the argument errors: {err}")

    # Lists that differ across ranks raise InvalidArgument on every rank, never plausible numbers: one chunk with
    # a rank-dependent total; totals that differ by a multiple of the chunk (every chunk's count agrees: the
    # all-gather of the totals catches it); one rank within a chunk, the others above; a different list length.
    per = CHUNK // 4
    mismatched = [
        ("one chunk", [np.ones(10 + (r == W - 1), np.float32)], ("all_reduce_coalesced",)),
        ("chunk multiple", [np.ones(per * (2 + (r == 0)), np.float32)], ("different total", "rank")),
        ("within and above", [np.ones(per * (1 if r == 1 else 3), np.float32)], ("all_reduce_coalesced",)),
        ("list length", [np.ones(7, np.float32)] * (1 if r else 2), ("all_reduce_coalesced",)),
    ]
    for label, arrays, needles in mismatched:
        copies = [a.copy() for a in arrays]
        err = _raises(lambda copies=copies: comm.all_reduce_coalesced(copies), gpucoll.InvalidArgument, *needles)
        if err:
            fails.append(f"mismatched lists ({label}): {err}")
        err = helpers.still_works(comm)
        if err:
            fails.append(f"after mismatched lists ({label}): {err}")
    err = _raises(lambda: comm.all_gather_coalesced([np.full(per * (2 + (r == 0)), r, np.int32)]),
                  gpucoll.InvalidArgument, "all_gather_coalesced")
    if err:
        fails.append(f"all_gather_coalesced, mismatched lists: {err}")
    # One int64 on a rank, several chunks elsewhere: the data call of the one must not pair with the totals' check.
    err = _raises(lambda: comm.all_gather_coalesced([np.ones(1 if r == 0 else 2000, np.int64)]),
                  gpucoll.InvalidArgument, "all_gather_coalesced")
    if err:
        fails.append(f"all_gather_coalesced, one int64 against several chunks: {err}")

    # all_gather_coalesced: each input into its own output of world_size x its rows, in rank order; new outputs,
    # given ones, and several chunks (each chunk holds this rank's piece and every rank's copy).
    for sizes in (SIZES[1], SIZES[2], [700, 3, 900]):
        ins = [(np.arange(n, dtype=np.int32) * 10 + 1_000_000 * r + k) for k, n in enumerate(sizes)]
        want = [np.concatenate([np.arange(n, dtype=np.int32) * 10 + 1_000_000 * q + k for q in range(W)])
                for k, n in enumerate(sizes)]
        got = comm.all_gather_coalesced(ins)
        outs = [np.full(W * n, -1, np.int32) for n in sizes]
        got2 = comm.all_gather_coalesced(ins, outs)
        if any(g is not o for g, o in zip(got2, outs)):
            fails.append("all_gather_coalesced: did not return the given outputs")
        for k in range(len(sizes)):
            for label, g in (("new", got[k]), ("given", got2[k])):
                err = helpers.compare_exact(np.asarray(g).reshape(-1), want[k])
                if err:
                    fails.append(f"all_gather_coalesced {sizes} {label} outputs[{k}]: {err}")
    x2 = np.arange(6, dtype=np.float32).reshape(3, 2) + r
    g = comm.all_gather_coalesced([x2])[0]
    if g.shape != (3 * W, 2) or not np.array_equal(g, np.concatenate([x2 - r + q for q in range(W)])):
        fails.append(f"all_gather_coalesced 2-D: shape {g.shape}")
    err = _raises(lambda: comm.all_gather_coalesced([x2], [np.zeros(5, np.float32)]), gpucoll.InvalidArgument,
                  "outputs[0]")
    if err:
        fails.append(f"all_gather_coalesced, wrong output size: {err}")
    err = helpers.still_works(comm)
    if err:
        fails.append(f"at the end: {err}")
    return fails


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def reports(request):
    per_rank = gpucoll.spawn(_worker, request.param, args=(HAVE_TORCH,), backend="host", timeout=120.0)
    return request.param, per_rank


def test_coalesced_host(reports):
    world_size, per_rank = reports
    assert len(per_rank) == world_size
    failures = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not failures, helpers.format_failures(failures)


def test_per_array_fallback_inside_a_fusing_group():
    """The fallback of backends without a fused path (nccl, custom): one collective per array, inside group() where
    the backend's group fuses launches (NCCL's), in list order, the last Work returned."""
    import contextlib

    from gpucoll import _buffers
    from gpucoll.backends.base import ALL_GATHER, ALL_REDUCE, Backend

    class Fake:
        name = "fake"
        all_reduce_coalesced = Backend.all_reduce_coalesced
        all_gather_coalesced = Backend.all_gather_coalesced
        _per_array = Backend._per_array

        def __init__(self, fuses):
            self.group_fuses, self.log = fuses, []

        @contextlib.contextmanager
        def group(self):
            self.log.append("start")
            yield
            self.log.append("end")

        def collective(self, coll, algo, src, dst, count, redop, root, stream, async_op):
            self.log.append((coll, src.ptr, dst.ptr, count, redop, async_op))
            return f"work{len(self.log)}"

    xs = [np.zeros(n, np.float32) for n in (3, 1, 5)]
    outs = [np.zeros(2 * n, np.float32) for n in (3, 1, 5)]
    bufs = [_buffers.resolve(x, "x") for x in xs]
    dsts = [_buffers.resolve(o, "out") for o in outs]
    nccl = Fake(True)
    assert nccl.all_reduce_coalesced(bufs, "op", True, xs) == "work4"
    assert nccl.log == ["start", *[(ALL_REDUCE, b.ptr, b.ptr, b.count, "op", True) for b in bufs], "end"]
    custom = Fake(False)
    custom.all_gather_coalesced(bufs, dsts, False)
    assert custom.log == [(ALL_GATHER, b.ptr, d.ptr, b.count, None, False) for b, d in zip(bufs, dsts)]


def _gathered(comm):
    """Arrays that are not one range of memory, over several chunks: the collective's copy-in gathers from them and
    its result is written straight into them (CollArgs::segs), whether the schedule ends in the work buffer (ring)
    or writes the output itself (twoshot, oneshot, tree). Exact small integers, zero-length arrays among them."""
    P, r = comm.world_size, comm.rank
    sizes = [int(n) for n in np.random.default_rng(5).integers(0, 3000, 40)]
    fails = []
    for dtype, op in (("float32", "sum"), ("int32", "max"), ("float16", "sum"), ("int64", "avg")):
        arrays = [((np.arange(n) * 7 + r * 3 + i) % 23).astype(dtype) for i, n in enumerate(sizes)]
        keep = [np.full(5, -1, dtype) for _ in sizes]  # neighbours in memory that must stay untouched
        comm.all_reduce_coalesced(arrays, op=op)
        for i, n in enumerate(sizes):
            each = np.array([(np.arange(n) * 7 + q * 3 + i) % 23 for q in range(P)], dtype=np.int64).reshape(P, n)
            want = each.max(axis=0) if op == "max" else each.sum(axis=0)
            if op == "avg":
                want = np.trunc(want / P)  # integer avg: the sum divided, truncated
            if not np.array_equal(arrays[i], want.astype(dtype)):
                fails.append(f"{dtype} {op} arrays[{i}] (n={n})")
                break
        if any((k != -1).any() for k in keep):
            fails.append(f"{dtype} {op}: memory beside the arrays was written")
    return fails


@pytest.mark.parametrize("algo", ["ring", "twoshot", "oneshot", "tree"])
def test_gathered_chunks_on_every_schedule(algo, monkeypatch):
    monkeypatch.setenv("GPUCOLL_ALGO", f"allreduce:{algo}")
    monkeypatch.setenv("GPUCOLL_HOST_FUSION_BYTES", "20000")
    fails = [f for per in gpucoll.spawn(_gathered, 3, backend="host", timeout=120.0) for f in per]
    assert not fails, fails
