"""Algorithm choice: an explicit algo= wins, then GPUCOLL_ALGO, then the cost model.

Most checks call gpucoll._C.select_algorithm in this process (GPUCOLL_ALGO is read at every call, so
monkeypatch.setenv takes effect at once). One 2-rank gpucoll.spawn shows that a live communicator consults
GPUCOLL_ALGO (a bogus value makes auto fail on every rank, naming the variable) and that algo= wins over it.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import InvalidArgument

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(120)]

COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
ALGOS = ("ring", "tree", "halving_doubling", "hierarchical", "dbt", "oneshot", "twoshot", "direct")
NRANKS = (1, 2, 3, 4, 5, 8)
SIZES = (0, 8, 1024, 1 << 20, 64 << 20)
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(autouse=True)
def _no_algo_env(monkeypatch):
    for var in ("GPUCOLL_ALGO", "GPUCOLL_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)


def select(coll, nranks, nbytes, requested="auto", local_size=0):
    return _C.select_algorithm(COLLS.index(coll), nranks, nbytes, local_size, requested)


def implementing(coll):
    return [a for a in _C.algorithm_names() if _C.algorithm_supports(a, COLLS.index(coll))]


def baseline():
    """What auto picks with no GPUCOLL_ALGO, for every (collective, nranks, bytes)."""
    return {(c, p, b): select(c, p, b) for c in COLLS for p in NRANKS for b in SIZES}


def test_registry_names_and_collective_ids():
    assert tuple(_C.algorithm_names()) == ALGOS
    assert tuple(_C.coll_names()) == COLLS
    for coll in COLLS:
        assert implementing(coll), coll


def test_env_allreduce_ring_makes_auto_pick_ring(monkeypatch):
    base = baseline()
    assert any(v != "ring" for (c, _, _), v in base.items() if c == "all_reduce")  # else the test proves nothing
    monkeypatch.setenv("GPUCOLL_ALGO", "allreduce:ring")
    for (coll, p, b), was in base.items():
        got = select(coll, p, b)
        if coll == "all_reduce":
            assert got == "ring", (p, b)
        else:
            assert got == was, (coll, p, b, got, was)


@pytest.mark.parametrize("coll", COLLS)
def test_explicit_algo_wins_over_env(monkeypatch, coll):
    algos = implementing(coll)
    monkeypatch.setenv("GPUCOLL_ALGO", f"{coll}:{algos[-1]},{algos[0]}")
    for algo in algos:
        assert select(coll, 4, KiB, algo) == algo
        assert select(coll, 4, KiB, algo.upper()) == algo
    assert select(coll, 4, KiB) == algos[-1]


def test_bare_name_applies_to_the_collectives_it_implements(monkeypatch):
    base = baseline()
    monkeypatch.setenv("GPUCOLL_ALGO", "tree")
    assert {c for c in COLLS if "tree" in implementing(c)} == {"all_reduce", "broadcast", "reduce", "gather",
                                                                "scatter"}
    for (coll, p, b), was in base.items():
        want = "tree" if "tree" in implementing(coll) else was
        assert select(coll, p, b) == want, (coll, p, b)


@pytest.mark.parametrize("spec, expected", [
    ("tree,allreduce:ring", {"all_reduce": "ring", "broadcast": "tree", "gather": "tree", "all_gather": None}),
    ("allreduce:ring,tree", {"all_reduce": "ring", "broadcast": "tree"}),
    ("all_reduce:ring", {"all_reduce": "ring"}),
    ("AllReduce:RING", {"all_reduce": "ring"}),
    (" allreduce : ring , broadcast:direct ,", {"all_reduce": "ring", "broadcast": "direct", "reduce": None}),
    ("reducescatter:direct,allgather:twoshot,alltoall:direct", {"reduce_scatter": "direct", "all_gather": "twoshot",
                                                                "all_to_all": "direct", "all_reduce": None}),
    ("gather:tree,scatter:tree,reduce:direct", {"gather": "tree", "scatter": "tree", "reduce": "direct"}),
    ("allreduce:auto", {"all_reduce": None}),
    ("auto", {c: None for c in COLLS}),
    ("", {c: None for c in COLLS}),
    (",,", {c: None for c in COLLS}),
])
def test_env_spellings(monkeypatch, spec, expected):
    """None in `expected`: the same as with no GPUCOLL_ALGO."""
    for p in (2, 3, 8):
        want = {c: (a if a is not None else select(c, p, MiB)) for c, a in expected.items()}
        monkeypatch.setenv("GPUCOLL_ALGO", spec)
        got = {c: select(c, p, MiB) for c in expected}
        monkeypatch.delenv("GPUCOLL_ALGO")
        assert got == want, (spec, p)


@pytest.mark.parametrize("spec, coll, nranks, local_size, fragments", [
    ("allreduce:direct", "all_reduce", 4, 0, ["direct", "does not implement all_reduce"]),
    ("broadcast:ring", "broadcast", 4, 0, ["ring", "does not implement broadcast"]),
    ("allgather:halving_doubling", "all_gather", 3, 0, ["halving_doubling", "power-of-two"]),
    ("reduce_scatter:halving_doubling", "reduce_scatter", 6, 0, ["halving_doubling", "power-of-two"]),
    ("allreduce:hierarchical", "all_reduce", 4, 3, ["hierarchical", "local_size=3 does not divide world size 4"]),
    ("allreduce:nosuch", "all_reduce", 4, 0, ["nosuch", "ring", "auto"]),
    ("nosuch", "scatter", 4, 0, ["nosuch"]),
    ("bogus:ring", "all_reduce", 4, 0, ["bogus", "unknown collective"]),
    ("bogus:ring", "broadcast", 4, 0, ["bogus", "unknown collective"]),
])
def test_env_naming_an_impossible_algorithm_raises(monkeypatch, spec, coll, nranks, local_size, fragments):
    monkeypatch.setenv("GPUCOLL_ALGO", spec)
    with pytest.raises(InvalidArgument) as info:
        select(coll, nranks, KiB, local_size=local_size)
    msg = str(info.value)
    for f in ["GPUCOLL_ALGO"] + fragments:
        assert f in msg, (f, msg)
    # An explicit algorithm still wins over the bad variable.
    ok = next(a for a in implementing(coll)
              if _C.algorithm_unusable(a, COLLS.index(coll), nranks, 0, local_size) is None)
    if "unknown collective" not in msg:
        assert select(coll, nranks, KiB, ok, local_size) == ok


@pytest.mark.parametrize("requested, coll, nranks, local_size, fragments", [
    ("ring", "broadcast", 4, 0, ["algo='ring'", "broadcast", "does not implement"]),
    ("direct", "all_reduce", 4, 0, ["algo='direct'", "does not implement"]),
    ("halving_doubling", "all_gather", 5, 0, ["halving_doubling", "power-of-two"]),
    ("hierarchical", "all_reduce", 4, 3, ["hierarchical", "local_size=3 does not divide world size 4"]),
    ("hierarchical", "all_reduce", 8, 3, ["local_size=3 does not divide world size 8"]),
    ("nosuch", "all_reduce", 4, 0, ["algo must be 'auto' or one of", "ring", "direct", "nosuch"]),
])
def test_explicit_impossible_algorithm_raises_naming_algo(requested, coll, nranks, local_size, fragments):
    with pytest.raises(InvalidArgument) as info:
        select(coll, nranks, KiB, requested, local_size)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert "GPUCOLL_ALGO" not in msg


def test_algorithm_unusable_reasons():
    ar, bc, rs = COLLS.index("all_reduce"), COLLS.index("broadcast"), COLLS.index("reduce_scatter")
    assert "local_size=3 does not divide world size 4" in _C.algorithm_unusable("hierarchical", ar, 4, 0, 3)
    assert _C.algorithm_unusable("hierarchical", ar, 6, 0, 3) is None
    assert "does not implement broadcast" in _C.algorithm_unusable("ring", bc, 4, 0, 0)
    assert "power-of-two" in _C.algorithm_unusable("halving_doubling", rs, 3, 0, 0)
    assert _C.algorithm_unusable("halving_doubling", ar, 3, 0, 0) is None
    assert "root" in _C.algorithm_unusable("tree", bc, 4, 4, 0)
    with pytest.raises(InvalidArgument, match="nosuch"):
        _C.algorithm_unusable("nosuch", ar, 4, 0, 0)


def test_hierarchical_is_usable_for_every_divisor_and_auto_never_picks_an_unusable_one():
    ar = COLLS.index("all_reduce")
    for p in range(1, 17):
        for L in range(1, p + 1):
            usable = _C.algorithm_unusable("hierarchical", ar, p, 0, L) is None
            assert usable == (p % L == 0), (p, L)
            for b in (KiB, 64 * MiB):
                got = select("all_reduce", p, b, local_size=L)
                assert _C.algorithm_unusable(got, ar, p, 0, L) is None, (p, L, b, got)


def _usable_predictions(coll, p, nbytes, local_size=0):
    cid = COLLS.index(coll)
    preds = {a: _C.predict(a, cid, p, nbytes, local_size) for a in implementing(coll)}
    return {a: d for a, d in preds.items() if d["usable"]}


def test_cost_model_8_ranks_all_reduce():
    small = _usable_predictions("all_reduce", 8, KiB)
    assert small[select("all_reduce", 8, KiB)]["steps"] <= 2
    assert select("all_reduce", 8, 64 * MiB) != "oneshot"
    assert small["ring"]["steps"] == 14  # 2(P-1)


@pytest.mark.parametrize("coll", COLLS)
def test_cost_model_fewer_steps_small_fewer_bytes_large(coll):
    """At 1 KiB auto's choice has the fewest steps of the usable algorithms; at 64 MiB (nearly) the fewest bytes
    received by the busiest rank - the model may trade at most one buffer of peer reads for an algorithm that
    writes its result straight to the output (no copy-out pass); at every size it is the model's argmin."""
    for p in (2, 3, 4, 5, 8):
        for local_size in (0, 2) if p % 2 == 0 else (0,):
            small = _usable_predictions(coll, p, KiB, local_size)
            got = select(coll, p, KiB, local_size=local_size)
            assert small[got]["steps"] == min(d["steps"] for d in small.values()), (p, local_size, got, small)
            large = _usable_predictions(coll, p, 64 * MiB, local_size)
            got = select(coll, p, 64 * MiB, local_size=local_size)
            fewest = min(d["bytes_recv"] for d in large.values())
            assert large[got]["bytes_recv"] <= fewest + 64 * MiB, (p, got, large)
            for b in SIZES:
                preds = _usable_predictions(coll, p, b, local_size)
                got = select(coll, p, b, local_size=local_size)
                assert preds[got]["seconds"] == min(d["seconds"] for d in preds.values()), (p, b, got)


# -- a live communicator --------------------------------------------------------------------------------------

def _live_worker(comm):
    import os

    out = {}
    x = np.full(4, comm.rank + 1, np.float32)
    try:
        comm.all_reduce(x)
        out["auto"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["auto"] = f"{type(exc).__name__}: {exc}"
    x = np.full(4, comm.rank + 1, np.float32)
    try:
        comm.all_reduce(x, algo="ring")
        out["explicit"] = x.tolist()
    except Exception as exc:  # noqa: BLE001
        out["explicit"] = f"{type(exc).__name__}: {exc}"
    # The variable is read at every call: fixing it in every rank's environment fixes auto.
    os.environ["GPUCOLL_ALGO"] = "allreduce:tree"
    x = np.full(4, comm.rank + 1, np.float32)
    try:
        comm.all_reduce(x)
        out["fixed"] = x.tolist()
    except Exception as exc:  # noqa: BLE001
        out["fixed"] = f"{type(exc).__name__}: {exc}"
    return out


def test_live_communicator_reads_gpucoll_algo(monkeypatch):
    monkeypatch.setenv("GPUCOLL_ALGO", "allreduce:bogus_algo")
    per_rank = gpucoll.spawn(_live_worker, 2, backend="host", timeout=30.0)
    for r, out in enumerate(per_rank):
        assert out["auto"].startswith("InvalidArgument"), (r, out)
        assert "GPUCOLL_ALGO" in out["auto"] and "bogus_algo" in out["auto"], (r, out)
        assert out["explicit"] == [3.0] * 4, (r, out)
        assert out["fixed"] == [3.0] * 4, (r, out)
