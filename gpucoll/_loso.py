"""How the NCCL model generalises: leave-one-system-out over the published dataset (gpucoll/_published.py).

A calibrate/validate split inside one dataset says how well the model interpolates between points of systems it
was fitted to. A user's machine is a system the fit never saw, so the honest figure is: for each system, refit the
execution model's efficiencies on every *other* system, predict the one left out, and score it
(:func:`loso`). ``python bench/published/accuracy.py`` prints the table; bench/published/loso_table.json keeps it,
and tests/topo/test_loso.py checks the table against the dataset.

The fit starts from, and is held towards, a prior that no published point produced (:data:`PRIOR`): NCCL's own
tuner units (every efficiency 1) and step costs of the order of one flag round trip. Without that, a parameter that
only the left-out system informs (the host's SHM rate when one of the two no-P2P pairs is out) would keep the value the
shipped defaults got from that very system, and the left-out prediction would not be honest.
"""

from __future__ import annotations

import json
import math
import statistics

import numpy as np

from gpucoll import _published as P
from gpucoll._native import _C

FITTED = ["t0_s", "eta_simple", "eta_ll128", "eta_ll", "step_simple_s", "eta_nvls", "step_nvls_s", "shm_host_bw",
          "eta_net", "eta_nvls_tree", "eta_efa"]
# Why each prior: NCCL's tuner tables are in the units Simple achieves (eta 1); a kernel launch plus nccl-tests'
# timing loop is a few microseconds; one pipeline step waits for a flag written by a peer over NVLink/PCIe, about a
# microsecond either way (NCCL's own per-hop latencies in tuning.cc are 0.6-5.7 us); the host stages through its
# memory what a PCIe gen-3 x16 link carries in NCCL's units (12 GB/s): no limit of its own beyond the link.
PRIOR = {"t0_s": 5e-6, "eta_simple": 1.0, "eta_ll128": 1.0, "eta_ll": 1.0, "step_simple_s": 2e-6, "eta_nvls": 1.0,
         "step_nvls_s": 2e-6, "shm_host_bw": 12e9, "eta_net": 1.0, "eta_nvls_tree": 1.0, "eta_efa": 1.0}
PRIOR_SIGMA = 10.0  # in log space: weak; it decides only what the training systems leave open


def scored(doc: dict) -> list:
    """The systems with at least one point that is scored (role calibrate or validate)."""
    return [s for s in doc["systems"] if any(p["role"] != "excluded" for p in s["points"])]


def source_of(system: dict) -> str:
    """One source per repository or thread: Azure's three result pages come from one benchmark script."""
    src = system["source"]
    return src.get("repository") or src.get("url") or src.get("reference")


class Evaluator:
    """Predicts the dataset's scored points for a parameter set, with the topologies built once."""

    def __init__(self, systems: list):
        self.items = []
        topos = {}
        for s in systems:
            for p in s["points"]:
                if p["role"] == "excluded":
                    continue
                nodes = p.get("nodes", s.get("nodes", 1))
                if (s["id"], nodes) not in topos:
                    topo, gpus = P.topology_of(s, nodes)
                    topos[(s["id"], nodes)] = topo, gpus, _C.topo_nccl_path(topo, len(gpus) // nodes, nodes, gpus)
                self.items.append((s, p, nodes, *topos[(s["id"], nodes)]))

    def rows(self, params: dict | None = None, evidence: list | None = None) -> list:
        """One row per point: published and predicted busbw, the error, the path (kind, cc, local) and the
        interval's half-width in log space ("spread"), from `evidence` when given, else the shipped one."""
        doc = {}
        if params:
            doc["nccl_model"] = params
        if evidence is not None:
            doc["nccl_evidence"] = evidence
        tuning = json.dumps(doc) if doc else ""
        out = []
        for s, p, nodes, topo, gpus, path in self.items:
            kw = {"nranks_per_node": len(gpus) // nodes, "nodes": nodes, "gpus": gpus, "tuning": tuning}
            cands = _C.topo_candidates(topo, "all_reduce", p["size"], "float32", custom=False, host=False, **kw)
            c = P._pick(cands, p.get("request", s.get("request", "nccl")), p.get("disable", ()))
            pred = c["busbw"] / 1e9 if c else float("nan")
            spread = math.log(c["busbw_high"] / c["busbw"]) if c and "busbw_high" in c else 0.0
            out.append({"system": s["id"], "class": s["class"], "size": p["size"], "nodes": nodes,
                        "busbw": p["busbw"], "pred": pred, "error": pred / p["busbw"] - 1, "kind": path["kind"],
                        "cc": path["cc"], "local": path["local"], "spread": spread,
                        "algorithm": c["algorithm"] if c else "-", "protocol": c["protocol"] if c else "-"})
        return out

    def residuals(self, params: dict) -> np.ndarray:
        """log(predicted / published), each system weighted as one (a 14-point curve counts as much as one
        point), and the prior's pull on each parameter."""
        rows = self.rows(params)
        n = {}
        for r in rows:
            n[r["system"]] = n.get(r["system"], 0) + 1
        fit = [math.log(r["pred"] / r["busbw"]) / math.sqrt(n[r["system"]]) for r in rows]
        prior = [math.log(params[k] / PRIOR[k]) / PRIOR_SIGMA for k in FITTED]
        return np.array(fit + prior)


def levenberg_marquardt(residuals, start: dict, iters: int = 25) -> dict:
    """Minimise |residuals(params)|^2 over the FITTED parameters, in log space (they stay positive), numeric
    Jacobian, from `start`. Deterministic. Parameters outside FITTED keep the defaults."""
    base = dict(_C.topo_nccl_params(""))
    x = np.log(np.array([start[k] for k in FITTED]))

    def params(v):
        return {**base, **{k: float(math.exp(e)) for k, e in zip(FITTED, v)}}

    lam = 1e-2
    r = residuals(params(x))
    for _ in range(iters):
        J = np.empty((r.size, x.size))
        for j in range(x.size):
            d = np.zeros_like(x)
            d[j] = 1e-4
            J[:, j] = (residuals(params(x + d)) - r) / 1e-4
        g, H = J.T @ r, J.T @ J
        step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-9), -g)
        r_new = residuals(params(x + step))
        if r_new @ r_new < r @ r:
            x, r, lam = x + step, r_new, lam / 3
            if np.max(np.abs(step)) < 1e-4:
                break
        else:
            lam *= 4
    return params(x)


def fit(systems: list, iters: int = 25, start: dict | None = None) -> dict:
    """The efficiencies fitted to the systems' scored points, held towards PRIOR; starts from `start` (default:
    the prior).

    A parameter that enters the model as a bound (the host's SHM rate caps a ring's bandwidth) has no gradient
    where the bound does not bind: started above every training system's other limits, the fit never finds the
    rate the data asks for (with one no-P2P pair left out, the other pair's 4 GB/s is then put down to nothing).
    So each such parameter, flat at the start, is tried again from a tenth of its start, and the lower cost
    wins; a parameter that no training system informs stays flat from both and keeps the prior's pull."""
    ev = Evaluator(systems)
    start = dict(start or PRIOR)
    best = levenberg_marquardt(ev.residuals, start, iters)
    base = {**dict(_C.topo_nccl_params("")), **start}
    r0 = ev.residuals(base)[:-len(FITTED)]
    flat = [k for k in FITTED if np.array_equal(ev.residuals({**base, k: base[k] * 1.5})[:-len(FITTED)], r0)]
    if flat:
        other = levenberg_marquardt(ev.residuals, {**start, **{k: start[k] / 10 for k in flat}}, iters)
        cost = [float(ev.residuals(x) @ ev.residuals(x)) for x in (best, other)]
        if cost[1] < cost[0]:
            best = other
    return best


def loso(doc: dict | None = None, iters: int = 25, only: list | None = None) -> list:
    """One row per scored point of each left-out system (all of them, or the ids in `only`), predicted by the
    model refitted on every other system. Each row carries the parameters of its fold under "params"."""
    doc = doc or P.load()
    systems = scored(doc)
    out = []
    for s in systems:
        if only and s["id"] not in only:
            continue
        params = fit([o for o in systems if o is not s], iters)
        for r in Evaluator([s]).rows(params):
            out.append({**r, "params": {k: params[k] for k in FITTED}})
    return out


def classes(doc: dict) -> dict:
    """{class: number of distinct sources} over the scored systems."""
    src = {}
    for s in scored(doc):
        src.setdefault(s["class"], set()).add(source_of(s))
    return {c: len(v) for c, v in src.items()}


def table(rows: list, doc: dict, key: str = "class") -> dict:
    """{class or kind: {"systems", "sources", "points", "median", "worst", "validated"}} of |relative error| over
    the points. A class with one source cannot be validated by leaving a system out of it: its row says so."""
    by_id = {s["id"]: s for s in doc["systems"]}
    out = {}
    for c in sorted({r[key] for r in rows}):
        mine = [r for r in rows if r[key] == c]
        ids = sorted({r["system"] for r in mine})
        srcs = {source_of(by_id[i]) for i in ids}
        out[c] = {"systems": len(ids), "sources": len(srcs), "points": len(mine),
                  "median": statistics.median(abs(r["error"]) for r in mine), "worst": max(abs(r["error"]) for r in mine),
                  "validated": len(srcs) >= 2}
    return out


def format_loso(rows: list, doc: dict) -> str:
    lines = [f"{'class':<34} {'systems':>7} {'sources':>7} {'points':>6} {'median |err|':>12} {'worst |err|':>11}"]
    for key in ("class", "kind"):
        for c, v in table(rows, doc, key).items():
            note = "" if v["validated"] else "  one source: cannot be validated"
            lines.append(f"{c:<34} {v['systems']:>7} {v['sources']:>7} {v['points']:>6} {v['median'] * 100:>11.1f}% "
                         f"{v['worst'] * 100:>10.1f}%{note}")
        lines.append("")
    lines.append(f"{'left-out system':<24} {'points':>6} {'median err':>10} {'worst err':>10}")
    for i in dict.fromkeys(r["system"] for r in rows):
        errs = [r["error"] for r in rows if r["system"] == i]
        lines.append(f"{i:<24} {len(errs):>6} {statistics.median(errs) * 100:>+9.1f}% "
                     f"{max(errs, key=abs) * 100:>+9.1f}%")
    return "\n".join(lines)


def write_table(rows: list, path) -> None:
    """The rows as bench/published/loso_table.json keeps them: one per left-out point, rounded for diffs."""
    keep = ("system", "class", "kind", "cc", "local", "size", "nodes", "busbw", "pred", "error", "algorithm",
            "protocol")
    out = [{k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keep} for r in rows]
    with open(path, "w") as f:
        f.write('{"format": "gpucoll-loso", "rows": [\n')
        f.write(",\n".join(json.dumps(r) for r in out))
        f.write("\n]}\n")


def _weighted_quantile(values: list, weights: list, q: float) -> float:
    order = sorted(range(len(values)), key=values.__getitem__)
    total, acc = sum(weights), 0.0
    for i in order:
        acc += weights[i]
        if acc >= q * total:
            return values[i]
    return values[order[-1]]


def evidence(rows: list, doc: dict, without: str = "") -> list:
    """What the left-out predictions say per path kind (cost.h NcclEvidence), from the rows of every system but
    `without`: the 90th percentile of |log(predicted / published)|, each system weighted as one, and the inputs
    the kind's systems span. This is what nccl_evidence.inc holds (without nothing left out)."""
    by_id = {s["id"]: s for s in doc["systems"]}
    out = []
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind and r["system"] != without]
        if not mine:
            continue
        n = {}
        for r in mine:
            n[r["system"]] = n.get(r["system"], 0) + 1
        errs = [abs(math.log(r["pred"] / r["busbw"])) for r in mine]
        out.append({"kind": kind, "systems": len(n), "sources": len({source_of(by_id[i]) for i in n}),
                    "half_width": round(max(0.03, _weighted_quantile(errs, [1 / n[r["system"]] for r in mine], 0.9)),
                                        4),
                    "ccs": sorted({r["cc"] for r in mine}), "min_local": min(r["local"] for r in mine),
                    "max_local": max(r["local"] for r in mine), "max_nodes": max(r["nodes"] for r in mine),
                    "min_bytes": min(r["size"] for r in mine), "max_bytes": max(r["size"] for r in mine)})
    return out


def coverage(rows: list, doc: dict) -> list:
    """The intervals scored on left-out systems: each system's points get the interval built from every other
    system's evidence (nested: the system never informs its own interval), around its left-out prediction.
    Returns the rows with "spread" (log half-width) and "covered"."""
    systems = {s["id"]: s for s in scored(doc)}
    out = []
    for sid in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == sid]
        widths = Evaluator([systems[sid]]).rows(evidence=evidence(rows, doc, without=sid))
        for r, w in zip(mine, widths):
            assert (r["size"], r["nodes"]) == (w["size"], w["nodes"])
            out.append({**r, "spread": w["spread"], "covered": abs(math.log(r["pred"] / r["busbw"])) <= w["spread"]})
    return out


def format_coverage(cov: list) -> str:
    """Coverage (points and systems alike) and width, per path kind and overall."""
    lines = [f"{'path kind':<10} {'points':>6} {'covered':>8} {'systems covered':>16} {'median +-':>10}"]
    for kind in [*sorted({r['kind'] for r in cov}), "all"]:
        mine = [r for r in cov if kind in ("all", r["kind"])]
        ids = dict.fromkeys(r["system"] for r in mine)
        per_sys = statistics.mean(statistics.mean(r["covered"] for r in mine if r["system"] == i) for i in ids)
        width = statistics.median(math.exp(r["spread"]) - 1 for r in mine)
        lines.append(f"{kind:<10} {len(mine):>6} {statistics.mean(r['covered'] for r in mine) * 100:>7.0f}% "
                     f"{per_sys * 100:>15.0f}% {width * 100:>9.0f}%")
    return "\n".join(lines)


def evidence_inc(ev: list) -> str:
    """csrc/select/nccl_evidence.inc's text: the shipped evidence as C++ initialisers."""
    lines = ["// Written by bench/published/accuracy.py --write-table (bench/published/loso_table.json); do not edit.",
             "// {kind, systems, sources, half_width (log), compute capabilities, min/max ranks per node, max nodes,",
             "//  min/max bytes}"]
    for e in ev:
        ccs = ", ".join(str(c) for c in e["ccs"])
        lines.append(f'{{"{e["kind"]}", {e["systems"]}, {e["sources"]}, {e["half_width"]}, {{{ccs}}}, '
                     f'{e["min_local"]}, {e["max_local"]}, {e["max_nodes"]}, {int(e["min_bytes"])}.0, '
                     f'{int(e["max_bytes"])}.0}},')
    return "\n".join(lines) + "\n"
