"""Schedules: every registered algorithm x every collective it supports x world sizes 1..64 passes the symbolic
checker (csrc/algo/checker.cc), unusable cases say why, and step/byte counts match the textbook formulas.

Generic on purpose: algorithms are discovered with _C.algorithm_names(), so a newly registered one is checked
without touching this file. The checker is C++ but its cost grows quickly with P, so rooted collectives try
every root only for small P and a spread of roots above, and local_size is swept only for the algorithms
whose schedule depends on it.
"""

from __future__ import annotations

import functools
import math

import pytest

from gpucoll import _C

ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER = range(8)
COLL_NAMES = _C.coll_names()
ROOTED = {BROADCAST, REDUCE, GATHER, SCATTER}
BLOCKED = {ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER}
SIZES = range(1, 65)
ALL_ROOTS_UP_TO = 12  # every root for P <= this, a spread of roots above

ALGOS = _C.algorithm_names()
CASES = [(a, c) for a in ALGOS for c in range(len(COLL_NAMES)) if _C.algorithm_supports(a, c)]


def nbytes_for(P: int) -> int:
    # Divisible by P (blocked collectives, ring chunks) and by every power of two <= 64 (halving-doubling
    # chunks), so every textbook byte count below is an exact integer.
    return 64 * P


def check(algo: str, coll: int, P: int, root: int = 0, local_size: int = 0) -> dict:
    # One cache key per schedule however the caller spells the defaults: the formula tests reuse the sweep's.
    return _check(algo, coll, P, root, local_size)


@functools.cache
def _check(algo, coll, P, root, local_size):
    return _C.check_schedule(algo, coll, P, root, local_size, nbytes_for(P))


def roots_for(coll: int, P: int) -> list:
    if coll not in ROOTED:
        return [0]
    if P <= ALL_ROOTS_UP_TO:
        return list(range(P))
    return sorted({0, 1, P // 2, P - 1, 7 * P // 11})


def divisors(P: int) -> list:
    return [d for d in range(1, P + 1) if P % d == 0]


def some_divisors(P: int) -> list:
    """Every divisor for P <= 32; above, 1, P and four spread between (60 has twelve divisors, each check at
    that size costs ~0.1 s)."""
    ds = divisors(P)
    if P <= 32 or len(ds) <= 6:
        return ds
    inner = ds[1:-1]
    return sorted({1, P} | {inner[i * (len(inner) - 1) // 3] for i in range(4)})


def _ops_or_reason(algo, coll, P, local_size):
    why = _C.algorithm_unusable(algo, coll, P, 0, local_size)
    if why is not None:
        return why
    return [_C.schedule_ops(algo, coll, P, 0, local_size, r) for r in range(P)]


@functools.cache
def uses_local_size(algo: str, coll: int) -> bool:
    """Whether the schedule changes with local_size: compared op for op against the flat schedule (cheap, no
    checker) at a few sizes with several divisors."""
    for P in (6, 8, 12):
        flat = _ops_or_reason(algo, coll, P, 0)
        if any(_ops_or_reason(algo, coll, P, ls) != flat for ls in divisors(P)[:-1]):
            return True
    return False


def local_sizes(algo: str, coll: int, P: int) -> list:
    """0 (flat) always; for local_size-aware algorithms the divisors of P and a couple of non-divisors."""
    if not uses_local_size(algo, coll):
        return [0]
    bad = [ls for ls in (3, P - 1, P + 1) if ls >= 1 and P % ls != 0]
    return [0] + [d for d in some_divisors(P) if d != P] + bad[:2]  # 0 already is local_size=P


def where(algo, coll, P, root, ls) -> str:
    return f"{algo} {COLL_NAMES[coll]} P={P} root={root} local_size={ls}"


# -- every algorithm, every collective, every size ----------------------------------------------------------


@pytest.mark.parametrize("algo,coll", CASES, ids=[f"{a}-{COLL_NAMES[c]}" for a, c in CASES])
def test_checker_accepts_every_usable_schedule(algo, coll):
    usable = 0
    for P in SIZES:
        for ls in local_sizes(algo, coll, P):
            for root in roots_for(coll, P):
                why = _C.algorithm_unusable(algo, coll, P, root, ls)
                res = check(algo, coll, P, root, ls)
                ctx = where(algo, coll, P, root, ls)
                if why is not None:
                    # Declining is allowed, but with a sentence, and the checker must report the same one.
                    assert isinstance(why, str) and len(why.split()) >= 3, f"{ctx}: unhelpful reason {why!r}"
                    assert not res["ok"] and res["error"] == "unusable: " + why, f"{ctx}: {res['error']}"
                    continue
                assert res["ok"], f"{ctx}: {res['error']}"
                assert res["nsteps"] >= 0 and res["nchunks"] >= 1, ctx
                if coll in BLOCKED:
                    assert res["nchunks"] == P, ctx
                assert len(res["bytes_sent"]) == P and sum(res["bytes_sent"]) == sum(res["bytes_recv"]), ctx
                if P == 1:
                    assert sum(res["bytes_sent"]) == 0, f"{ctx}: a single rank has nobody to talk to"
                usable += P >= 2
    # An algorithm that declines everything would pass the loop above vacuously.
    assert usable > 0, f"{algo} {COLL_NAMES[coll]} is unusable at every world size 2..64"


@pytest.mark.parametrize("algo", ALGOS)
def test_unsupported_collectives_are_refused_with_a_reason(algo):
    for coll in range(len(COLL_NAMES)):
        if _C.algorithm_supports(algo, coll):
            continue
        res = _C.check_schedule(algo, coll, 4, 0, 0, nbytes_for(4))
        assert not res["ok"] and "does not support" in res["error"]
        assert _C.algorithm_unusable(algo, coll, 4, 0, 0)


def test_every_algorithm_has_a_summary():
    for algo in ALGOS:
        assert len(_C.algorithm_summary(algo)) > 20, algo


# -- textbook formulas ----------------------------------------------------------------------------------------


def need(algo: str) -> None:
    if algo not in ALGOS:
        pytest.fail(f"algorithm {algo!r} is not registered (have {', '.join(ALGOS)})")


def test_ring_allreduce_steps_and_bytes():
    need("ring")
    for P in SIZES:
        res = check("ring", ALL_REDUCE, P)
        N = nbytes_for(P)
        assert res["nsteps"] == 2 * (P - 1), P
        # Bandwidth-optimal: every rank sends (and receives) 2(P-1)/P of the buffer.
        assert res["bytes_sent"] == [2 * (P - 1) * N // P] * P, P
        assert res["bytes_recv"] == [2 * (P - 1) * N // P] * P, P


@pytest.mark.parametrize("coll", [REDUCE_SCATTER, ALL_GATHER])
def test_ring_half_collectives(coll):
    need("ring")
    for P in SIZES:
        res = check("ring", coll, P)
        assert res["nsteps"] == P - 1
        assert res["bytes_sent"] == [(P - 1) * nbytes_for(P) // P] * P


def test_halving_doubling_allreduce_steps_and_bytes():
    need("halving_doubling")
    for P in SIZES:
        res = check("halving_doubling", ALL_REDUCE, P)
        m = int(math.log2(P))
        P2 = 2**m
        N = nbytes_for(P)
        if P == P2:
            assert res["nsteps"] == 2 * m, P
            # Same bandwidth as the ring: N/2 + N/4 + ... + N/P, twice.
            assert res["bytes_sent"] == [2 * (P - 1) * N // P] * P, P
            assert res["nchunks"] == P
        else:
            extra = P - P2
            assert res["nsteps"] == 2 * m + 2, P
            assert res["nchunks"] == P2, P
            # Fold and unfold move the whole vector once each way between the paired ranks; the P' survivors
            # add the power-of-two algorithm's traffic.
            inner = 2 * (P2 - 1) * N // P2
            for r in range(P):
                if r < 2 * extra and r % 2 == 0:
                    assert res["bytes_sent"][r] == N and res["bytes_recv"][r] == N, (P, r)
                    assert res["active_steps"][r] == 1, (P, r)
                elif r < 2 * extra:
                    assert res["bytes_sent"][r] == N + inner and res["bytes_recv"][r] == N + inner, (P, r)
                else:
                    assert res["bytes_sent"][r] == inner, (P, r)


@pytest.mark.parametrize("coll", [REDUCE_SCATTER, ALL_GATHER])
def test_halving_doubling_blocked_needs_power_of_two(coll):
    need("halving_doubling")
    for P in SIZES:
        m = int(math.log2(P))
        if P == 2**m:
            res = check("halving_doubling", coll, P)
            assert res["ok"] and res["nsteps"] == m, P
            assert res["bytes_sent"] == [(P - 1) * nbytes_for(P) // P] * P, P
        else:
            why = _C.algorithm_unusable("halving_doubling", coll, P, 0, 0)
            assert why and "power-of-two" in why, P


@pytest.mark.parametrize("coll", [BROADCAST, REDUCE])
def test_binomial_tree_broadcast_and_reduce(coll):
    need("tree")
    for P in SIZES:
        L = math.ceil(math.log2(P)) if P > 1 else 0
        N = nbytes_for(P)
        for root in roots_for(coll, P):
            res = check("tree", coll, P, root)
            assert res["ok"] and res["nsteps"] == L, (P, root)
            assert res["nchunks"] == 1
            # Every non-root rank receives (broadcast) or sends (reduce) the buffer exactly once; the root is
            # the other end of L of those messages (its L children).
            once, root_side = ("bytes_recv", "bytes_sent") if coll == BROADCAST else ("bytes_sent", "bytes_recv")
            assert res[once] == [0 if r == root else N for r in range(P)], (P, root)
            assert res[root_side][root] == L * N, (P, root)


def test_binomial_tree_allreduce():
    need("tree")
    for P in SIZES:
        L = math.ceil(math.log2(P)) if P > 1 else 0
        res = check("tree", ALL_REDUCE, P)
        assert res["ok"] and res["nsteps"] == 2 * L, P


@pytest.mark.parametrize("coll", [GATHER, SCATTER])
def test_binomial_tree_gather_scatter(coll):
    need("tree")
    for P in SIZES:
        L = math.ceil(math.log2(P)) if P > 1 else 0
        N = nbytes_for(P)
        for root in roots_for(coll, P):
            res = check("tree", coll, P, root)
            assert res["ok"] and res["nsteps"] == L, (P, root)
            # a log P + (P-1)/P N b: the root moves everybody else's block exactly once.
            side = "bytes_recv" if coll == GATHER else "bytes_sent"
            assert res[side][root] == (P - 1) * N // P, (P, root)


def test_hierarchical_steps_and_bytes():
    need("hierarchical")
    for P in SIZES:
        S = nbytes_for(P)
        for L in some_divisors(P):
            nodes = P // L
            res = check("hierarchical", ALL_REDUCE, P, 0, L)
            assert res["ok"], (P, L, res["error"])
            assert res["nsteps"] == 2 * (L - 1) + 2 * (nodes - 1), (P, L)
            # 2(L-1)/L of the buffer inside the node, 2(N-1)/N of one slice (S/L) across nodes.
            per_rank = 2 * (L - 1) * S // L + 2 * (nodes - 1) * S // (L * nodes)
            assert res["bytes_sent"] == [per_rank] * P, (P, L)


def test_hierarchical_flat_is_the_ring():
    need("hierarchical")
    for P in (1, 2, 3, 5, 8):
        flat = check("hierarchical", ALL_REDUCE, P, 0, 0)
        assert flat["nsteps"] == check("ring", ALL_REDUCE, P)["nsteps"]
        assert flat["bytes_sent"] == check("ring", ALL_REDUCE, P)["bytes_sent"]


@pytest.mark.parametrize("P,ls", [(8, 3), (6, 4), (4, 8), (7, 2)])
def test_hierarchical_unusable_says_why(P, ls):
    need("hierarchical")
    why = _C.algorithm_unusable("hierarchical", ALL_REDUCE, P, 0, ls)
    assert why == f"local_size={ls} does not divide world size {P}"
    assert check("hierarchical", ALL_REDUCE, P, 0, ls)["error"] == "unusable: " + why
