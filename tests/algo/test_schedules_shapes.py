"""Schedules of the one-step and tree shapes: dbt, oneshot, twoshot, direct.

Every (algorithm, collective, P in 1..64, root) passes the symbolic checker (right contributions, nothing
counted twice, no same-step read/write race); on top of that each shape's promises are checked exactly:
step counts, bytes per rank, and for the double binary tree the two trees themselves, rebuilt from the ops.
"""

import math

import pytest

from gpucoll import _C

ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER = range(8)
ROOTED = {BROADCAST, REDUCE, GATHER, SCATTER}
BLOCKED = {ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER}
WORLD_SIZES = range(1, 65)

SUPPORTED = {
    "dbt": [ALL_REDUCE],
    "oneshot": [ALL_REDUCE, ALL_GATHER, BROADCAST, REDUCE],
    "twoshot": [ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER],
    "direct": [BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER],
}


def roots(coll, P):
    if coll not in ROOTED:
        return [0]
    return range(P) if P <= 8 else sorted({0, 1, P // 2, P - 1})


def expected_nchunks(algo, coll, P):
    if coll in BLOCKED or algo == "twoshot":
        return P
    return 2 if algo == "dbt" else 1


def check(algo, coll, P, root=0, nbytes=None):
    nbytes = P * 96 if nbytes is None else nbytes  # divisible by P and by 2: exact byte formulas
    r = _C.check_schedule(algo, coll, P, root, 0, nbytes)
    assert r["ok"], f"{algo} coll={coll} P={P} root={root}: {r['error']}"
    return r


def test_registered():
    names = _C.algorithm_names()
    for algo, colls in SUPPORTED.items():
        assert algo in names
        for coll in range(8):
            assert _C.algorithm_supports(algo, coll) == (coll in colls), (algo, coll)
            if coll in colls:
                assert _C.algorithm_unusable(algo, coll, 5) is None


@pytest.mark.parametrize("algo", sorted(SUPPORTED))
def test_checker_accepts_every_size_and_root(algo):
    for coll in SUPPORTED[algo]:
        for P in WORLD_SIZES:
            for root in roots(coll, P):
                r = check(algo, coll, P, root)
                assert r["nchunks"] == expected_nchunks(algo, coll, P)


# -- double binary tree ----------------------------------------------------------------------------------------


def dbt_steps(P):
    """The construction's exact step count: 2 * the taller tree's height."""
    if P == 1:
        return 0
    return 2 * (int(math.log2(P)) if P % 2 == 0 else math.ceil(math.log2(P)))


def rebuild_trees(P):
    """(parent, children) per tree, read back from the ops: reduces pull from children, copies from the parent."""
    parent = [[None] * P for _ in range(2)]
    children = [[[] for _ in range(P)] for _ in range(2)]
    for rank in range(P):
        sched = _C.schedule_ops("dbt", ALL_REDUCE, P, 0, 0, rank)
        assert sched["nchunks"] == 2 and sched["result"] == "work"
        for ops in sched["steps"]:
            for peer, src, dst, action, space in ops:
                assert src == dst and src in (0, 1) and space == "work" and peer != rank
                if action == "reduce":
                    children[src][rank].append(peer)
                else:
                    assert parent[src][rank] is None, f"P={P}: rank {rank} has two parents in tree {src}"
                    parent[src][rank] = peer
    return parent, children


def test_dbt_two_trees_each_rank_inner_in_exactly_one():
    for P in WORLD_SIZES:
        r = check("dbt", ALL_REDUCE, P, nbytes=1000 * P)
        assert r["nsteps"] == dbt_steps(P), P
        parent, children = rebuild_trees(P)
        heights = []
        for k in range(2):
            # A spanning tree: one root, parent/child links agree, at most two children, every rank reaches the root.
            assert [parent[k][r] for r in range(P)].count(None) == 1, (P, k)
            for r in range(P):
                assert len(children[k][r]) <= 2
                assert sorted(children[k][r]) == sorted(c for c in range(P) if parent[k][c] == r), (P, k, r)
            depth = []
            for r in range(P):
                d, a = 0, r
                while parent[k][a] is not None:
                    a, d = parent[k][a], d + 1
                    assert d < P, f"P={P}: cycle in tree {k}"
                depth.append(d)
            heights.append(max(depth))
        assert 2 * max(heights) == dbt_steps(P), (P, heights)
        if P >= 2:
            # The double-binary-tree property holds for every P >= 2 (P = 1: rank 0 is a lone root in both).
            for rank in range(P):
                inner = [bool(children[k][rank]) for k in range(2)]
                assert inner.count(True) == 1, f"P={P}: rank {rank} inner in trees {inner}"


def test_dbt_bytes():
    for P in WORLD_SIZES:
        N = 1000
        r = check("dbt", ALL_REDUCE, P, nbytes=N)
        # Each tree moves its half once up and once down every edge; no rank moves more than 2N either way.
        assert sum(r["bytes_recv"]) == sum(r["bytes_sent"]) == 2 * (P - 1) * N
        assert max(r["bytes_recv"]) <= 2 * N and max(r["bytes_sent"]) <= 2 * N


# -- one-shot ----------------------------------------------------------------------------------------------------


def test_oneshot_allreduce():
    for P in WORLD_SIZES:
        N = 1000
        r = check("oneshot", ALL_REDUCE, P, nbytes=N)
        assert r["nsteps"] == 1
        assert r["bytes_recv"] == [(P - 1) * N] * P
        assert r["bytes_sent"] == [(P - 1) * N] * P
        want = [(p, 0, 0, "copy" if p == 0 else "reduce", "out") for p in range(P)]
        for rank in sorted({0, P // 2, P - 1}):
            sched = _C.schedule_ops("oneshot", ALL_REDUCE, P, 0, 0, rank)
            # Same ops in the same order on every rank => identical bits everywhere.
            assert sched["result"] == "out" and sched["steps"] == [want]


def test_oneshot_other_shapes_are_one_step():
    for coll in (ALL_GATHER, BROADCAST, REDUCE):
        for P in WORLD_SIZES:
            for root in roots(coll, P):
                assert check("oneshot", coll, P, root)["nsteps"] == 1


# -- two-shot ----------------------------------------------------------------------------------------------------


def test_twoshot_allreduce():
    for P in WORLD_SIZES:
        N = P * 96
        r = check("twoshot", ALL_REDUCE, P, nbytes=N)
        assert r["nsteps"] == 2 and r["nchunks"] == P
        assert r["bytes_sent"] == [2 * (P - 1) * N // P] * P
        assert r["bytes_recv"] == [2 * (P - 1) * N // P] * P


def test_twoshot_halves():
    for P in WORLD_SIZES:
        N = P * 96
        for coll in (REDUCE_SCATTER, ALL_GATHER):
            r = check("twoshot", coll, P, nbytes=N)
            assert r["nsteps"] == 1
            assert r["bytes_recv"] == [(P - 1) * N // P] * P


# -- direct ------------------------------------------------------------------------------------------------------


def test_direct_all_to_all():
    for P in WORLD_SIZES:
        N = P * 96
        r = check("direct", ALL_TO_ALL, P, nbytes=N)
        assert r["nsteps"] == 1
        assert r["bytes_recv"] == [(P - 1) * N // P] * P
        assert r["bytes_sent"] == [(P - 1) * N // P] * P


def test_direct_rooted_traffic_is_on_the_root():
    for P in (1, 2, 3, 5, 8, 13):
        n = 96
        for root in range(P):
            g = check("direct", GATHER, P, root, nbytes=P * n)
            assert g["bytes_recv"] == [(P - 1) * n if q == root else 0 for q in range(P)]
            s = check("direct", SCATTER, P, root, nbytes=P * n)
            assert s["bytes_sent"] == [(P - 1) * n if q == root else 0 for q in range(P)]
            b = check("direct", BROADCAST, P, root, nbytes=n)
            assert b["bytes_sent"] == [(P - 1) * n if q == root else 0 for q in range(P)]
            rd = check("direct", REDUCE, P, root, nbytes=n)
            assert rd["bytes_recv"] == [(P - 1) * n if q == root else 0 for q in range(P)]
