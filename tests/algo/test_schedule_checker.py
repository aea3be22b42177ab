"""The schedule checker (csrc/algo/checker.cc) rejects broken schedules: every registered schedule, given back to it
as op tables (_C.check_schedule_table), passes unchanged and fails once broken in each way a schedule can be
wrong: a step's op dropped, a reduce applied twice, a chunk read from the wrong position, a copy from the wrong
peer, a chunk written while a peer reads it, the last step missing. test_schedules.py relies on the checker for
world sizes 1..64; this is what makes that worth something."""

from __future__ import annotations

import copy

import pytest

from gpucoll import _C

COLL_NAMES = _C.coll_names()
BLOCKED = {3, 4, 5, 6, 7}  # all_gather, reduce_scatter, all_to_all, gather, scatter


def _table(algo: str, coll: int, P: int, root: int = 0):
    per_rank = [_C.schedule_ops(algo, coll, P, root, 0, r) for r in range(P)]
    steps = [[[tuple(op) for op in step] for step in rank["steps"]] for rank in per_rank]
    return per_rank[0]["nchunks"], per_rank[0]["result"], steps


def _root(coll: int, P: int) -> int:
    """The last rank for rooted collectives (a root other than 0 catches schedules that assume it), else 0."""
    return P - 1 if coll in (1, 2, 6, 7) else 0


def _check(coll, P, root, nchunks, result, steps):
    return _C.check_schedule_table(coll, P, root, nchunks, result, steps, 64 * P)


def _ops(steps):
    """(rank, step, index, op) of every op."""
    return [(r, t, i, op) for r, rank in enumerate(steps) for t, step in enumerate(rank) for i, op in enumerate(step)]


def _drop_op(steps, nchunks, coll, P):
    if not _ops(steps):
        return None
    r, t, i, _ = _ops(steps)[-1]  # the last op that writes anything: something ends up missing
    del steps[r][t][i]
    return steps


def _reduce_twice(steps, nchunks, coll, P):
    for r, t, i, op in _ops(steps):
        if op[3] == "reduce":
            steps[r][t].insert(i + 1, op)
            return steps
    return None


def _wrong_position(steps, nchunks, coll, P):
    if coll in BLOCKED or nchunks < 2:
        return None
    for r, t, i, op in _ops(steps):
        if op[3] == "reduce":
            steps[r][t][i] = (op[0], (op[1] + 1) % nchunks, op[2], op[3], op[4])
            return steps
    return None


def _wrong_peer(steps, nchunks, coll, P):
    """A broadcast's first step reads the root's data; read it from another rank instead, which holds none yet.
    (Elsewhere a copy from another peer can be harmless: after a reduction several ranks hold the same chunk.)"""
    if coll != 1 or not steps[0]:
        return None
    root = _root(coll, P)
    for r, rank in enumerate(steps):
        for i, op in enumerate(rank[0]):
            if op[0] == root and r != root:
                other = next(q for q in range(P) if q not in (r, root))
                rank[0][i] = (other, *op[1:])
                return steps
    return None


def _write_while_read(steps, nchunks, coll, P):
    """The owner of a chunk a peer reads at step t writes that chunk at step t too (a copy of itself onto itself
    still counts as a write: the contract is about who writes the buffer, not what)."""
    for r, t, _, op in _ops(steps):
        q, c = op[0], op[1]
        if q != r:
            steps[q][t].append((q, c, c, "copy", "work"))
            return steps
    return None


def _drop_last_step(steps, nchunks, coll, P):
    if not steps[0] or not any(steps[r][-1] for r in range(P)):
        return None
    for rank in steps:
        rank[-1] = []
    return steps


MUTATIONS = {
    "an op dropped": (_drop_op, ("does not hold the expected contributions", "holds no data yet")),
    "a reduce applied twice": (_reduce_twice, ("counted twice",)),
    "a chunk read from the wrong position": (_wrong_position, ("chunk positions differ",)),
    "a copy from the wrong peer": (_wrong_peer, ("holds no data yet",)),
    "a chunk written while a peer reads it": (_write_while_read, ("while a peer reads it",)),
    "the last step missing": (_drop_last_step, ("does not hold the expected contributions", "holds no data yet")),
}

CASES = [(a, c) for a in _C.algorithm_names() for c in range(len(COLL_NAMES)) if _C.algorithm_supports(a, c)]
SIZES = (3, 4, 6, 7)


@pytest.mark.parametrize("algo, coll", CASES, ids=[f"{a}-{COLL_NAMES[c]}" for a, c in CASES])
def test_every_schedule_passes_as_a_table_and_fails_each_way_it_can_be_broken(algo, coll):
    applied = set()
    for P in SIZES:
        if _C.algorithm_unusable(algo, coll, P, 0, 0) is not None:
            continue
        root = _root(coll, P)
        nchunks, result, steps = _table(algo, coll, P, root)
        good = _check(coll, P, root, nchunks, result, steps)
        assert good["ok"], (algo, COLL_NAMES[coll], P, good["error"])
        assert good == _C.check_schedule(algo, coll, P, root, 0, 64 * P)  # the table is the schedule
        for name, (mutate, fragments) in MUTATIONS.items():
            broken = mutate(copy.deepcopy(steps), nchunks, coll, P)
            if broken is None:
                continue
            applied.add(name)
            res = _check(coll, P, root, nchunks, result, broken)
            assert not res["ok"], f"{algo} {COLL_NAMES[coll]} P={P}: the checker accepted {name}"
            assert any(f in res["error"] for f in fragments), (name, res["error"])
    assert {"an op dropped", "a chunk written while a peer reads it"} <= applied or not applied, applied


def test_every_kind_of_breakage_is_exercised():
    """Each mutation applies to some schedule (a mutation that never applies would prove nothing)."""
    applied = set()
    for algo, coll in CASES:
        P = next((p for p in SIZES if _C.algorithm_unusable(algo, coll, p, 0, 0) is None), None)
        if P is None:
            continue
        nchunks, _, steps = _table(algo, coll, P, _root(coll, P))
        applied |= {name for name, (mutate, _) in MUTATIONS.items()
                    if mutate(copy.deepcopy(steps), nchunks, coll, P) is not None}
    assert applied == set(MUTATIONS), set(MUTATIONS) - applied


def test_a_result_in_the_wrong_space_fails():
    nchunks, result, steps = _table("ring", 0, 4)
    assert result == "work"
    res = _check(0, 4, 0, nchunks, "out", steps)
    assert not res["ok"] and "does not hold the expected contributions" in res["error"]
