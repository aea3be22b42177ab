"""Ranks that make different calls: every kind of mismatch, on every collective, at 2-5 ranks (host backend).

Every rank must raise the same InvalidArgument - the same text, naming every rank's call - quickly (not a
timeout), and the communicator must stay usable: after each case one exact call of the same collective and one
exact all_reduce, and after the whole matrix 100 matched calls of every collective and size, checked exactly.
Correct programs the check must let through run here too: point-to-point traffic between some ranks only (with
GPUCOLL_DEBUG_CHECKS=1, which broke them before), calls with nothing to move, rooted calls whose non-roots pass
no output.

Kinds: count, dtype, op, root, collective, algorithm (explicit), auto resolving differently (GPUCOLL_ALGO set on
one rank only), one rank skipping a call (it makes its next call instead), a barrier against the collective, an
empty buffer on one rank. One gpucoll.spawn per world size runs the whole matrix; the tests read its report.
"""

from __future__ import annotations

import os
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import InvalidArgument

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZES = (2, 3, 4, 5)
COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
SPLIT = ("reduce_scatter", "all_to_all", "scatter")  # x holds world_size blocks
KINDS = ("count", "dtype", "op", "premul", "root", "collective", "algorithm", "auto", "skip", "barrier", "empty")
TIMEOUT = 30.0  # a mismatch the check missed shows as a hang turned timeout, not as a stuck test
FAST = 5.0  # a caught mismatch raises well within this
N = 7  # elements per (per-rank) block in the mismatched calls


def _x(coll, W, rank, n, dtype=np.int64):
    """Distinct, exact values per element and rank."""
    length = n * W if coll in SPLIT else n
    return (np.arange(length, dtype=np.int64) * 7 + rank * 1_000_003).astype(dtype)


def call(comm, coll, n=N, dtype=np.int64, op="sum", root=0, algo="auto", out=True):
    """One collective call with fresh buffers; returns its output (None where the rank gets none)."""
    W, r = comm.world_size, comm.rank
    x = _x(coll, W, r, n, dtype)
    if coll == "all_reduce":
        return comm.all_reduce(x, op=op, algo=algo)
    if coll == "broadcast":
        return comm.broadcast(x, root=root, algo=algo)
    if coll == "reduce":
        o = np.full(x.size, -1, x.dtype) if (out and r == root) else None
        comm.reduce(x, out=o, op=op, root=root, algo=algo)
        return o
    if coll == "all_gather":
        return comm.all_gather(x, algo=algo)
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, algo=algo)
    if coll == "all_to_all":
        return comm.all_to_all(x, algo=algo)
    if coll == "gather":
        return comm.gather(x, root=root, algo=algo)
    return comm.scatter(x, root=root, algo=algo)


def expected(coll, W, rank, n, root=0):
    xs = [_x(coll, W, q, n) for q in range(W)]
    if coll == "all_reduce":
        return sum(xs)
    if coll == "broadcast":
        return xs[root]
    if coll == "reduce":
        return sum(xs) if rank == root else None
    if coll == "all_gather":
        return np.concatenate(xs)
    if coll == "reduce_scatter":
        return sum(xs)[rank * n:(rank + 1) * n]
    if coll == "all_to_all":
        return np.concatenate([x[rank * n:(rank + 1) * n] for x in xs])
    if coll == "gather":
        return np.concatenate(xs) if rank == root else None
    return xs[root][rank * n:(rank + 1) * n]


def exact(comm, coll, n=N, root=0, algo="auto") -> str:
    """'' when a matched call of `coll` gives the exact result on this rank, else what went wrong."""
    try:
        got = call(comm, coll, n, root=root, algo=algo)
    except Exception as exc:  # noqa: BLE001
        return f"matched {coll}(n={n}) raised {type(exc).__name__}: {exc}"
    want = expected(coll, comm.world_size, comm.rank, n, root)
    if want is None:
        return ""
    if got is None or not np.array_equal(got, want):
        return f"matched {coll}(n={n}, root={root}, algo={algo}) gave a wrong result"
    return ""


def algos_for(coll, W, root=0):
    """Registered algorithms that implement `coll` and can run at this world size and root."""
    from gpucoll import _C

    cid = COLLS.index(coll)
    return [a for a in _C.algorithm_names()
            if _C.algorithm_supports(a, cid) and _C.algorithm_unusable(a, cid, W, root, 0) is None]


def mismatched(comm, kind, coll):
    """The calls of one case, per rank; None when the kind does not apply to this collective here."""
    W, r = comm.world_size, comm.rank
    last = W - 1
    if kind == "count":
        return lambda: call(comm, coll, n=N + (r == last))
    if kind == "dtype":
        return lambda: call(comm, coll, dtype=np.float64 if r == 1 else np.int64)
    if kind == "op":
        return (lambda: call(comm, coll, op="max" if r == 0 else "sum")) if coll in REDUCING else None
    if kind == "premul":
        # premul_sum(1) is a sum in value, but not the same call: ranks must agree on premul_sum as on any op.
        return (lambda: call(comm, coll, op=gpucoll.premul_sum(1) if r == 0 else "sum")) if coll in REDUCING else None
    if kind == "root":
        return (lambda: call(comm, coll, root=0 if r == 0 else 1)) if coll in ROOTED else None
    if kind == "collective":
        other = COLLS[(COLLS.index(coll) + 1) % len(COLLS)]
        return lambda: call(comm, other if r == 1 else coll)
    if kind == "algorithm":
        names = algos_for(coll, W)
        if len(names) < 2:
            return None
        return lambda: call(comm, coll, algo=names[0] if r == 0 else names[1])
    if kind == "auto":
        # GPUCOLL_ALGO on one rank only: 'auto' resolves to another algorithm there.
        names = algos_for(coll, W)
        from gpucoll import _C

        picked = _C.select_algorithm(COLLS.index(coll), W, N * 8 * (W if coll in SPLIT else 1), 0, "auto")
        others = [a for a in names if a != picked]
        if not others:
            return None

        def run():
            if r != 0:
                return call(comm, coll)
            os.environ["GPUCOLL_ALGO"] = others[0]
            try:
                return call(comm, coll)
            finally:
                del os.environ["GPUCOLL_ALGO"]
        return run
    if kind == "skip":
        # Rank 1 skips this call: what it does next (a barrier, the program's next call) meets it.
        return (lambda: comm.barrier()) if r == 1 else (lambda: call(comm, coll))
    if kind == "barrier":
        return (lambda: comm.barrier()) if r == 0 else (lambda: call(comm, coll))
    if kind == "empty":
        return lambda: call(comm, coll, n=0 if r == 1 else N)
    raise AssertionError(kind)


def _matrix_worker(comm):
    W = comm.world_size
    report = {"cases": {}, "after": [], "final": [], "correct": []}
    for coll in COLLS:
        for kind in KINDS:
            fn = mismatched(comm, kind, coll)
            if fn is None:
                continue
            t0 = time.monotonic()
            try:
                fn()
                outcome = ("no error", "", ())
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                outcome = (type(exc).__name__, getattr(exc, "message", str(exc)), tuple(getattr(exc, "ranks", ())))
            report["cases"][f"{kind}/{coll}"] = (*outcome, time.monotonic() - t0)
            comm.barrier()  # where a rank skipped, the others make their next call too: all in step again
            for what in (exact(comm, coll), exact(comm, "all_reduce")):
                if what:
                    report["after"].append(f"{kind}/{coll}: {what}")
    # 100 matched calls: every collective, small and multi-piece sizes, every root, auto and explicit algorithms.
    sizes = (1, 7, 1003, 300_001)
    for i in range(100):
        coll = COLLS[i % len(COLLS)]
        n = sizes[(i // len(COLLS)) % len(sizes)]
        n = n // W + 1 if coll in SPLIT or coll in ("all_gather", "gather") else n
        root = i % W if coll in ROOTED else 0
        algos = ["auto", *algos_for(coll, W, root)]
        what = exact(comm, coll, n, root=root, algo=algos[i % len(algos)])
        if what:
            report["final"].append(f"call {i}: {what}")
    report["correct"] = _correct_programs(comm)
    return report


def _correct_programs(comm):
    """Programs that are right and must run without an error and exactly."""
    W, r = comm.world_size, comm.rank
    problems = []
    # Point-to-point between ranks 0 and 1 only, between collectives, with GPUCOLL_DEBUG_CHECKS=1 (which used to
    # count sends and receives into the collective sequence, so ranks disagreed about which call was which).
    os.environ["GPUCOLL_DEBUG_CHECKS"] = "1"
    try:
        for step in range(5):
            if r in (0, 1):
                buf = np.full(3 + step, r, np.int32)
                if r == 0:
                    comm.send(buf, 1)
                else:
                    comm.recv(buf, 0)
                    if not (buf == 0).all():
                        problems.append(f"p2p step {step}: received {buf.tolist()}")
            for coll in ("all_reduce", "broadcast", "all_gather"):
                problems += [f"p2p step {step}: {w}" for w in [exact(comm, coll)] if w]
    finally:
        del os.environ["GPUCOLL_DEBUG_CHECKS"]
    # Nothing to move, on every rank alike.
    for coll in COLLS:
        problems += [f"empty {coll}: {w}" for w in [exact(comm, coll, n=0)] if w]
    # Rooted calls whose non-roots pass no output (reduce) or get none (gather).
    for root in range(W):
        for coll in ("reduce", "gather"):
            problems += [f"{coll} root={root}: {w}" for w in [exact(comm, coll, root=root)] if w]
    return problems


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def report(request):
    W = request.param
    with pytest.MonkeyPatch.context() as mp:
        for var in ("GPUCOLL_ALGO", "GPUCOLL_DEBUG_CHECKS", "GPUCOLL_LOCAL_SIZE"):
            mp.delenv(var, raising=False)
        t0 = time.monotonic()
        per_rank = gpucoll.spawn(_matrix_worker, W, backend="host", timeout=TIMEOUT)
    return W, per_rank, time.monotonic() - t0


def _listed_ranks(msg):
    """The ranks the message's call table lists ("  rank 3: ...", "  ranks 0-1, 4: ..."), sorted."""
    ranks = []
    for line in msg.splitlines()[1:]:
        who = line.strip().split(":")[0].split(" ", 1)[1]
        for part in who.split(", "):
            lo, _, hi = part.partition("-")
            ranks += range(int(lo), int(hi or lo) + 1)
    return sorted(ranks)


def test_every_mismatch_raises_the_same_error_on_every_rank(report):
    W, per_rank, _ = report
    problems, caught = [], 0
    cases = per_rank[0]["cases"]
    for case in cases:
        outcomes = [rep["cases"][case] for rep in per_rank]
        kinds = {o[0] for o in outcomes}
        messages = {o[1] for o in outcomes}
        slow = max(o[3] for o in outcomes)
        bad = []
        if kinds != {InvalidArgument.__name__}:
            bad.append(f"raised {[o[0] for o in outcomes]}")
        elif len(messages) != 1:
            bad.append("ranks got different messages")
        else:
            msg = messages.pop()
            if "different calls" not in msg or _listed_ranks(msg) != list(range(W)):
                bad.append(f"the message does not list every rank's call once: {msg}")
        if slow > FAST:
            bad.append(f"took {slow:.1f} s")
        if bad:
            problems.append(f"{case}: " + "; ".join(bad) + f" ({outcomes[0]})")
        else:
            caught += 1
    print(f"\nws{W}: mismatch kinds caught {caught} / tried {len(cases)}")
    assert not problems, helpers.format_failures(problems)
    assert len(cases) >= 60, sorted(cases)  # every kind that applies, on every collective


def test_messages_name_the_difference(report):
    _, per_rank, _ = report
    cases = per_rank[0]["cases"]
    words = {"count": "count", "dtype": "dtype", "op": "op", "premul": "premul_sum", "root": "root", "collective": "collective",
             "algorithm": "algorithm", "auto": "by auto", "skip": "barrier()", "barrier": "barrier()",
             "empty": "count=0"}
    missing = [case for case, o in cases.items() if words[case.split("/")[0]] not in o[1]]
    assert not missing, [(c, cases[c][1]) for c in missing]


def test_communicator_stays_usable_and_exact(report):
    _, per_rank, _ = report
    failures = helpers.merge_rank_failures(per_rank, "after") + helpers.merge_rank_failures(per_rank, "final")
    assert not failures, helpers.format_failures(failures)


def test_correct_programs_pass(report):
    _, per_rank, _ = report
    failures = helpers.merge_rank_failures(per_rank, "correct")
    assert not failures, helpers.format_failures(failures)
