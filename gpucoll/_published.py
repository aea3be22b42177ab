"""The NCCL model held against published nccl-tests results (tests/fixtures/published/nccl_allreduce.json).

Each system of the dataset names its wiring (a topology fixture plus what the source states: GPU model, CPU
vendor, NIC rate, the GPUs used, P2P switched off by NCCL_P2P_DISABLE), its layout and what NCCL was asked for
(``request``: ``nccl`` for NCCL's own choice, ``nccl:nvls`` for NCCL_ALGO=NVLS, ...). :func:`evaluate` predicts every point with the topology cost
model and :func:`summary` gives the median and worst relative busbw error per class and role, which
tests/topo/test_published_nccl.py asserts and ``python bench/published/accuracy.py`` prints.

Only the public model API is used (topology value, candidates), so the same code measures an older build.
"""

from __future__ import annotations

import json
import pathlib
import statistics

from gpucoll import topology as T
from gpucoll._native import _C

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
DATASET = FIXTURES / "published" / "nccl_allreduce.json"
CLASSES = ("nvswitch", "pcie", "multinode")


def load(path=None) -> dict:
    with open(path or DATASET) as f:
        return json.load(f)


def topology_of(system: dict, nodes: int):
    """The system's wiring as a topology value: the fixture, with what the source states applied, replicated to
    `nodes` hosts. Returns (topology, gpus of the layout in rank order)."""
    spec = system["topology"]
    topo = T.load(str(FIXTURES / spec["fixture"]))
    if spec.get("gpu_model") and hasattr(topo, "set_gpu_model"):
        topo.set_gpu_model(spec["gpu_model"])
    d = T.to_dict(topo)
    if "cpu_vendor" in spec:
        for h in d["hosts"]:
            h["cpu_vendor"] = spec["cpu_vendor"]
            if not spec["cpu_vendor"]:
                h.pop("cpu_vendor")
    if "nics" in spec:
        d["nics"] = [n for i, n in enumerate(d["nics"]) if i in spec["nics"]]
    if spec.get("nic_gbps"):
        for n in d["nics"]:
            n["speed_gbps"] = spec["nic_gbps"]
    if spec.get("net_transport"):
        for n in d["nics"]:
            n["transport"] = spec["net_transport"]
    local = spec.get("gpus") or list(range(system["ranks_per_node"]))
    if spec.get("p2p") == "disabled":
        _disable_p2p(d, local, system["id"])
    topo = T.from_json(json.dumps(d))
    if nodes > 1:
        topo = T.replicate(topo, nodes)
    per_host = len(T.to_dict(topo)["gpus"]) // max(nodes, 1)
    return topo, [n * per_host + g for n in range(nodes) for g in local]


def _disable_p2p(d: dict, gpus: list, sid: str) -> None:
    """NCCL_P2P_DISABLE=1 as the pairs' P2P status: NCCL then stages every hop through host memory (SHM), as on
    boards whose driver reports no P2P. A pair joined by NVLink cannot be stated this way: nvidia-smi shows NV#
    for it and hides the PCIe path its staged bytes would take, so such a system needs that path from its source."""
    used = set(gpus)
    for link in d["links"]:
        if link["a"] in used and link["b"] in used:
            if link["class"] == "NVL":
                raise ValueError(f"{sid}: p2p disabled between GPUs {link['a']} and {link['b']}, which the fixture "
                                 "joins by NVLink: their PCIe path is not known")
            link["p2p"] = "unsupported"


def _pick(cands: list, request: str, disable=()):
    """What NCCL runs for the request: among the usable NCCL candidates it admits (NCCL_ALGO narrows the choice),
    the one NCCL's tuner ranks first. A build without tuner estimates takes the fastest."""
    algo = request.split(":", 1)[1] if ":" in request else ""
    ok = [c for c in cands if c["backend"] == "nccl" and c["usable"] and (not algo or c["algorithm"] == algo)
          and c["algorithm"] not in disable]
    if not ok:
        return None
    return min(ok, key=lambda c: c.get("tuner_seconds", c["seconds"]))


def evaluate(doc: dict | None = None, tuning: str = "") -> list:
    """One row per point: the published and the predicted busbw, the relative error, NCCL's pick."""
    doc = doc or load()
    rows = []
    for s in doc["systems"]:
        for p in s["points"]:
            nodes = p.get("nodes", s.get("nodes", 1))
            topo, gpus = topology_of(s, nodes)
            kw = {"nranks_per_node": len(gpus) // nodes, "nodes": nodes, "gpus": gpus, "tuning": tuning}
            cands = _C.topo_candidates(topo, "all_reduce", p["size"], "float32", custom=False, host=False, **kw)
            c = _pick(cands, p.get("request", s.get("request", "nccl")), p.get("disable", ()))
            pred = c["busbw"] / 1e9 if c else float("nan")
            rows.append({"system": s["id"], "class": s["class"], "role": p["role"], "size": p["size"],
                         "nodes": nodes, "busbw": p["busbw"], "pred": pred, "error": pred / p["busbw"] - 1,
                         "algorithm": c["algorithm"] if c else "-", "protocol": c["protocol"] if c else "-",
                         "confidence": c.get("confidence", "") if c else "", "reason": p.get("reason", "")})
    return rows


def summary(rows: list) -> dict:
    """{(class, role): {"n", "median", "worst"}} of |relative error|, roles calibrate and validate."""
    out = {}
    for cls in CLASSES:
        for role in ("calibrate", "validate"):
            errs = [abs(r["error"]) for r in rows if r["class"] == cls and r["role"] == role]
            if errs:
                out[(cls, role)] = {"n": len(errs), "median": statistics.median(errs), "worst": max(errs)}
    return out


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def format_table(rows: list, points: bool = True) -> str:
    lines = []
    if points:
        lines.append(f"{'system':<22} {'role':<9} {'nodes':>5} {'size':>8} {'published':>9} {'model':>8} {'error':>7}  "
                     f"NCCL pick")
        for r in rows:
            lines.append(f"{r['system']:<22} {r['role']:<9} {r['nodes']:>5} {_size(r['size']):>8} {r['busbw']:>9.2f} "
                         f"{r['pred']:>8.2f} {r['error'] * 100:>+6.1f}%  {r['algorithm']}/{r['protocol']}")
    lines.append(f"{'class':<10} {'role':<9} {'points':>6} {'median |err|':>13} {'worst |err|':>12}")
    for (cls, role), v in summary(rows).items():
        lines.append(f"{cls:<10} {role:<9} {v['n']:>6} {v['median'] * 100:>12.1f}% {v['worst'] * 100:>11.1f}%")
    return "\n".join(lines)
