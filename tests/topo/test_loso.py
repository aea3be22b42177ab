"""Leave-one-system-out: how the NCCL model does on systems it was not fitted to (gpucoll/_loso.py).

A full run refits the model once per system (about a minute here), so the table is committed
(bench/published/loso_table.json, written by `python bench/published/accuracy.py --write-table`) and checked here:
it covers exactly the dataset's scored systems and points, one fold recomputed reproduces it, and the targets
hold per class with at least two sources (issue 34). A class with one source cannot be validated by leaving
its system out; the table says so.
"""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from gpucoll import _loso as L
from gpucoll import _published as P

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "bench" / "published" / "loso_table.json"
TARGET_MEDIAN, TARGET_WORST = 0.15, 0.50
# Classes that miss the target today, each with why; the test fails when one meets it, so the list cannot go stale.
KNOWN_MISSES = {
    "multinode": "AWS EFA (p4d) reaches 0.65 of its line rate at 1 GiB and less in between; nothing models why",
}

# Validated path kinds whose left-out intervals are wider than a factor 1.5 at the median, each with why.
KNOWN_WIDE = {
    "shm": "the two no-P2P pairs are of different architectures (2080 Ti sm_75, A40 sm_86): each left out gets the "
           "other's 13% plus the unseen-architecture term, though the host's rate they share does not depend on it",
    "nvlink": "two bridged pairs of different architectures (A100 sm_80, A40 sm_86): each left out gets the "
              "other's width plus the unseen-architecture term",
}

pytestmark = pytest.mark.usefixtures("no_selection_env")


@pytest.fixture(scope="module")
def doc():
    return P.load()


@pytest.fixture(scope="module")
def table():
    return json.loads(TABLE.read_text())["rows"]


def test_table_covers_the_dataset(doc, table):
    want = sorted((s["id"], p["size"], p.get("nodes", s.get("nodes", 1)), p["busbw"])
                  for s in L.scored(doc) for p in s["points"] if p["role"] != "excluded")
    have = sorted((r["system"], r["size"], r["nodes"], r["busbw"]) for r in table)
    assert have == want, "bench/published/loso_table.json is stale: python bench/published/accuracy.py --write-table"
    classes = {s["id"]: s["class"] for s in doc["systems"]}
    assert all(r["class"] == classes[r["system"]] for r in table)


def test_one_fold_reproduces_the_table(doc, table):
    # The fold without the EFA system: the parameter only that system informs stays at its prior, so no
    # value fitted to the left-out system reaches its prediction.
    sid = "aws-p4d-efa-2node"
    rows = L.loso(doc, only=[sid])
    assert rows and all(r["system"] == sid for r in rows)
    assert rows[0]["params"]["eta_efa"] == pytest.approx(L.PRIOR["eta_efa"], rel=0.02)
    want = {(r["size"], r["busbw"]): r["pred"] for r in table if r["system"] == sid}
    for r in rows:
        assert r["pred"] == pytest.approx(want[(r["size"], r["busbw"])], rel=0.02), r


def test_targets_per_class(doc, table):
    stats = L.table(table, doc)
    print("\n" + L.format_loso(table, doc))
    assert set(stats) == set(P.CLASSES)
    for cls, v in stats.items():
        if not v["validated"]:
            continue  # one source: reported as such, not judged
        meets = v["median"] <= TARGET_MEDIAN and v["worst"] <= TARGET_WORST
        assert meets != (cls in KNOWN_MISSES), f"{cls}: {v} ({KNOWN_MISSES.get(cls, 'expected to meet the target')})"


def test_fit_weighs_systems_not_points(doc):
    # A 14-point curve and a one-point system count alike: each system's residuals sum to its mean square.
    systems = [s for s in L.scored(doc) if s["id"] in ("azure-nd-h100-v5", "nccl-tests-175-1node")]
    r = L.Evaluator(systems).residuals(dict(L.PRIOR))
    n = sum(p["role"] != "excluded" for s in systems for p in s["points"])
    assert r.size == n + len(L.FITTED)
    assert len(L.classes(doc)) == len(P.CLASSES)


# ---- intervals (csrc/select/nccl_interval.cc) -------------------------------------------------------------------

def test_shipped_evidence_is_the_tables(doc, table):
    inc = ROOT / "csrc" / "select" / "nccl_evidence.inc"
    assert inc.read_text() == L.evidence_inc(L.evidence(table, doc)), \
        "csrc/select/nccl_evidence.inc is stale: python bench/published/accuracy.py --write-table, then rebuild"


def test_intervals_cover_left_out_systems(doc, table):
    # Each system's interval is built without it (nested), around its left-out prediction.
    cov = L.coverage(table, doc)
    print("\n" + L.format_coverage(cov))
    assert len(cov) == len(table)
    assert sum(r["covered"] for r in cov) >= 0.8 * len(cov)
    ids = dict.fromkeys(r["system"] for r in cov)
    assert sum(all(r["covered"] for r in cov if r["system"] == i) for i in ids) >= 0.8 * len(ids)
    # No wider than needed: where a kind has validated evidence, half its left-out points get an interval
    # within a factor 1.5 (the rest are widened for inputs none of the other systems had). The kinds that
    # cannot be that narrow yet say why, and must stay wide (the list cannot go stale).
    for kind, v in L.table(table, doc, "kind").items():
        if v["validated"]:
            narrow = statistics.median(r["spread"] for r in cov if r["kind"] == kind) < 0.41
            assert narrow != (kind in KNOWN_WIDE), f"{kind}: {KNOWN_WIDE.get(kind, 'expected narrow')}"


def test_interval_widens_beyond_the_evidence():
    from gpucoll import topology as T

    topo = T.load(str(ROOT / "tests" / "fixtures" / "topo" / "h100_8x_nvsmi.txt"))
    topo.set_gpu_model("H100")

    def pick(nbytes, **kw):
        c = next(c for c in T.candidates(topo, "all_reduce", nbytes, custom=False, host=False, **kw)
                 if c["nccl_auto"])
        assert c["busbw_low"] < c["busbw"] < c["busbw_high"] and c["seconds_low"] < c["seconds"] < c["seconds_high"]
        return c

    big, small = pick(1 << 30), pick(4 << 10)
    assert "nvswitch" in big["interval"] and "size outside" in small["interval"]
    assert small["busbw_high"] / small["busbw"] > big["busbw_high"] / big["busbw"]
    two = pick(1 << 30, nranks_per_node=2)  # the published NVSwitch systems ran 4 and 8 GPUs
    assert "2 ranks per node outside 4-8" in two["interval"]
    ev = json.dumps({"nccl_evidence": []})  # no evidence at all: the unseen-kind width, said so
    assert "no published nvswitch system" in pick(1 << 30, tuning=ev)["interval"]


def test_topo_cli_and_explain_show_the_interval(capsys):
    from gpucoll.cli import explain
    from gpucoll.cli import topo as topo_cli

    fix = str(ROOT / "tests" / "fixtures" / "topo" / "h100_8x_nvsmi.txt")
    assert topo_cli.main(["--from-nvidia-smi", fix, "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "busbw range" in out and "NCCL model's interval at 1 GiB: 13 published nvswitch" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 GiB"))
    lo, hi = row.split()[7].split("-")
    assert float(lo) < float(row.split()[6]) < float(hi)
    assert topo_cli.main(["--from-nvidia-smi", fix, "--gpu", "H100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nccl_interval"] and any("busbw_high" in r for r in doc["rows"] if r["backend"] == "nccl")
    assert explain.main(["explain", "all_reduce", "--nranks", "8", "--bytes", "64M", "--topology", fix,
                         "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "# NCCL on this topology (1 node(s) x 8): nvls/Simple" in out and "interval" in out
