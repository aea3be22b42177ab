"""gpucoll-bench's collective plugins: nccl-tests' sizes, bus-bandwidth factors, roots, in-place layouts and exact
checks for every collective, and --algo for several algorithms.

Spawning ranks costs 0.5-2 s per run, so there is one spawned run per collective (3 ranks: odd sizes catch
chunking bugs) and each asserts much: the table, the JSON, the root and the bandwidth arithmetic. Everything that
needs no ranks (counts, factors, names, algorithm checks) runs in this process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from gpucoll.bench import cli, colls
from gpucoll.bench.harness import Params

pytestmark = pytest.mark.spawns

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
ROW_RE = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)" + r"\s+(\S+)" * 8 + "$")
BLOCKED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
# nccl-tests' busbw factors (/work/shared/FACTS.md), written out independently of the plugins.
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
           "reduce": lambda n: 1.0, "sendrecv": lambda n: 1.0}


def nccl_counts(coll: str, size: int, itemsize: int, n: int) -> tuple[int, int]:
    """(size column, count column) as nccl-tests prints them (src/<coll>.cu GetCollByteCount, then
    max(sendBytes, recvBytes) and paramcount)."""
    count = size // itemsize
    if coll not in BLOCKED:
        return count * itemsize, count
    base = (count // n) & ~(16 // itemsize - 1)
    return base * n * itemsize, base


def bench(*args, timeout=60):
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", *args]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)


def rows(text):
    return [m.groups() for m in map(ROW_RE.match, text.splitlines()) if m]


@pytest.fixture
def no_launcher(monkeypatch):
    for v in LAUNCHER_VARS:
        monkeypatch.delenv(v, raising=False)


# -- no ranks ----------------------------------------------------------------------------------------------
def test_every_collective_is_registered_with_gpucoll_numbering():
    from gpucoll import _C

    assert colls.names() == ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
                             "gather", "scatter", "sendrecv"]
    coll_names = list(_C.coll_names())
    for name in colls.names():
        t = colls.get(name)
        assert t.name == name
        assert t.coll_id == (coll_names.index(name) if name in coll_names else -1)
        assert (t.rooted, t.reduces) == (name in ROOTED, name in REDUCING)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_counts_and_in_place_offsets_follow_nccl_tests(n):
    for name in colls.names():
        t = colls.get(name)
        for itemsize in (1, 2, 4, 8):
            for size in (0, 8, 48, 1000, 4096, 65536 + 24):
                c = t.counts(size // itemsize, n, itemsize)
                assert (max(c.send, c.recv) * itemsize, c.param) == nccl_counts(name, size, itemsize, n), name
                # In place, input and output fit in the receive buffer at nccl-tests' offsets for every rank.
                for r in range(n):
                    assert c.send_inplace_offset * r + c.send <= max(c.send, c.recv)
                    assert c.recv_inplace_offset * r + c.recv <= max(c.send, c.recv)
    ag = colls.get("all_gather").counts(1000, 4, 4)
    assert (ag.send, ag.recv, ag.send_inplace_offset, ag.recv_inplace_offset) == (248, 992, 248, 0)
    rs = colls.get("reduce_scatter").counts(1000, 4, 4)
    assert (rs.send, rs.recv, rs.send_inplace_offset, rs.recv_inplace_offset) == (992, 248, 0, 248)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_bus_bandwidth_factors(n):
    for name in colls.names():
        algbw, busbw = colls.get(name).get_bw(1000, 4, 1e-3, n)
        moved = 1000 * 4 * (n if name in BLOCKED else 1)  # nccl-tests' algbw: the whole buffer over the time
        assert math.isclose(algbw, moved / 1e-3 / 1e9), name
        assert math.isclose(busbw, algbw * FACTORS[name](n), abs_tol=1e-12), name


@pytest.mark.parametrize("spelling, name", [
    ("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("all_gather_perf", "all_gather"),
    ("sendrecv_perf", "sendrecv"), ("Broadcast", "broadcast"), ("all-gather", "all_gather")])
def test_nccl_tests_spellings(spelling, name):
    assert cli.parse_args([spelling]).coll == name


def test_op_and_root_apply_only_where_they_mean_something():
    p = cli.parse_args(["all_gather", "-o", "all", "-r", "1"])
    assert any("does not reduce: -o is ignored" in note for note in p.notes)
    assert any("has no root: -r is ignored" in note for note in p.notes)
    assert cli.parse_args(["reduce", "-o", "all"]).ops == list(colls.OPS)
    quiet = cli.parse_args(["all_gather"])  # nothing asked for, nothing to say
    assert not any("ignored" in note for note in quiet.notes)
    assert cli.parse_args(["gather"]).root == 0 and cli.parse_args(["scatter", "-r", "2"]).root == 2


def test_algo_all_keeps_the_algorithms_usable_at_the_world_size():
    from gpucoll import _C

    p = cli.parse_args(["all_gather", "--algo", "all"])
    assert p.algo_all and p.algos == [a for a in _C.algorithm_names() if _C.algorithm_supports(a, 3)]
    assert any("skipped" in note and "tree" in note for note in p.notes)  # tree has no all_gather
    cli.check_world(p, 3)
    assert p.algos == [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, 3, 3, 0, 0) is None]
    assert "halving_doubling" not in p.algos and "ring" in p.algos
    assert any("skipped halving_doubling at 3 ranks" in note and "power-of-two" in note for note in p.notes)
    q = cli.parse_args(["all_gather", "--algo", "all"])
    cli.check_world(q, 4)
    assert "halving_doubling" in q.algos


def test_algo_that_cannot_serve_the_collective_is_refused(no_launcher, capsys):
    # Refused before any rank starts: no spawn.
    assert cli.main(["broadcast", "--algo", "ring", "--nranks", "3", "-b", "8", "-e", "8"]) == 2
    err = capsys.readouterr().err
    assert "--algo ring cannot run broadcast" in err and "ring does not implement broadcast" in err
    assert cli.main(["all_gather", "--algo", "ring,halving_doubling", "--nranks", "3", "-b", "8", "-e", "8"]) == 2
    err = capsys.readouterr().err
    assert "--algo halving_doubling cannot run all_gather at 3 ranks" in err and "power-of-two" in err
    assert cli.main(["sendrecv", "--algo", "ring", "--nranks", "2"]) == 2
    assert "point-to-point" in capsys.readouterr().err


def test_roots_and_world_size_are_checked_before_running(no_launcher, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["gather", "--nranks", "3", "-r", "3"])
    assert "-r/--root 3 is not a rank of 3" in capsys.readouterr().err
    with pytest.raises(cli.UsageError, match="not a rank of this 2-rank run"):
        cli.check_world(Params(coll="scatter", root=2), 2)
    cli.check_world(Params(coll="all_gather", root=5), 2)  # not rooted: -r ignored
    assert cli.main(["sendrecv", "-b", "8", "-e", "8"]) == 2  # one rank: nobody to send to
    assert "sendrecv needs at least 2 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("coll", ["all_gather", "broadcast", "reduce_scatter"])
def test_wrong_result_fails_the_run_for_other_collectives(coll, no_launcher, capsys):
    # One rank in this process: --inject-error flips one bit of the checked output after each checked call.
    rc = cli.main([coll, "-b", "64", "-e", "512", "-f", "8", "-n", "1", "--inject-error"])
    out = capsys.readouterr().out
    assert rc == 1
    got = rows(out)
    assert len(got) == 2 and all(r[8] == "1" and r[12] == "1" for r in got)
    assert "# Out of bounds values : 4 FAILED\n" in out


# -- spawned runs: every collective at 3 ranks -------------------------------------------------------------
def _extra(coll):
    if coll == "all_gather":
        # The host backend's algorithms (on a GPU machine auto is NCCL, which has one); -o all: ignored, one "none"
        # row per size.
        return ["--backend", "host", "--algo", "all", "-o", "all"]
    if coll in ("reduce", "reduce_scatter"):
        return ["-o", "sum,max"]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("coll", colls.names())
def test_every_collective_at_three_ranks(coll, tmp_path):
    from gpucoll import _C

    out = tmp_path / "r.json"
    res = bench(coll, "--nranks", "3", "-b", "8", "-e", "4K", "-f", "8", "-d", "int8,float", "-r", "2", "-n", "3",
                "--json", str(out), *_extra(coll))
    assert res.returncode == 0, res.stdout + res.stderr
    t = colls.get(coll)
    refused = f"# {coll} in place not run: gpucoll refuses nccl-tests' in-place layout" in res.stdout
    if coll == "all_gather":
        algos = [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, t.coll_id, 3, 0, 0) is None]
        assert len(algos) >= 2 and "halving_doubling" not in algos
        assert "skipped halving_doubling at 3 ranks" in res.stdout
    else:
        algos = ["auto"]
    assert re.findall(r"^# Algorithm: (\w+)(?: \(.*\))?$", res.stdout, re.MULTILINE) == algos  # auto says its pick
    ops = ["sum", "max"] if coll in ("reduce", "reduce_scatter") else ["sum"] if coll == "all_reduce" else ["none"]
    want = [(*nccl_counts(coll, size, isz, 3), dtype, op)
            for _ in algos for dtype, isz in (("int8", 1), ("float", 4)) for op in ops for size in (8, 64, 512, 4096)]
    got = rows(res.stdout)
    assert [(int(r[0]), int(r[1]), r[2], r[3]) for r in got] == want
    for r in got:
        assert r[4] == ("2" if coll in ROOTED else "-1")
        assert r[8] == "0", r  # out of place: checked, exact
        if r[9] == "N/A":  # in place not run: only where gpucoll refused nccl-tests' layout, and said so
            assert refused and r[12] == "N/A" and int(r[1]) > 0, r
        else:
            assert r[12] == ("0" if t.in_place_checked else "N/A"), r
    assert "# Out of bounds values : 0 OK\n" in res.stdout

    doc = json.loads(out.read_text())
    assert doc["config"]["collective"] == coll and doc["out_of_bounds"] == {"count": 0, "okay": True}
    assert [row["algo"] for row in doc["results"]] == [a for a in algos for _ in range(len(want) // len(algos))]
    for row, text in zip(doc["results"], got):
        assert row["collective"] == coll
        assert (row["size"], row["count"], row["redop"], row["root"]) == (int(text[0]), int(text[1]), text[3],
                                                                          int(text[4]))
        for place in ("out_of_place", "in_place"):
            m = row[place]
            if m["time"] is None:
                continue
            assert m["time"] > 0
            moved = row["count"] * (4 if row["type"] == "float" else 1) * (3 if coll in BLOCKED else 1)
            assert math.isclose(m["alg_bw"], moved / (m["time"] * 1e-6) / 1e9, rel_tol=1e-9)
            assert math.isclose(m["bus_bw"], m["alg_bw"] * FACTORS[coll](3), rel_tol=1e-9, abs_tol=1e-15)
