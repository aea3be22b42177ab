"""--plot and `gpucoll-bench report`: busbw and time vs size (log axes), one line per block of rows.

A block is a run's rows for one (collective, backend, algorithm, datatype, op); the peer of --compare is drawn
dashed in black, once per run. matplotlib is imported here only (Agg backend), i.e. only when a plot is asked
for. The plotting functions return the Figure so callers (and tests) can inspect it.
"""

from __future__ import annotations

import argparse
import json
import sys


def _blocks(doc: dict, label: str = "") -> dict:
    """(name) -> {"sizes", "busbw", "time", "peer_busbw", "peer_time", "peer"} for the rows of one run."""
    backend = doc.get("environment", {}).get("backend", "")
    colls = {r.get("collective") for r in doc.get("results", [])}
    types = {(r.get("type"), r.get("redop")) for r in doc.get("results", [])}
    out: dict = {}
    for r in doc.get("results", []):
        res = r.get("out_of_place") or {}
        if res.get("time") is None or not r.get("size"):
            res = r.get("in_place") or {}
        if res.get("time") is None or not r.get("size"):
            continue
        parts = [label] if label else []
        if len(colls) > 1:
            parts.append(r.get("collective", ""))
        b_name = r.get("backend") or backend  # rows of a backend sweep each name theirs
        parts.append(f"{b_name}:{r.get('algo')}" if b_name else str(r.get("algo")))
        if len(types) > 1:
            parts.append(f"{r.get('type')}/{r.get('redop')}")
        b = out.setdefault(" ".join(p for p in parts if p), {"sizes": [], "busbw": [], "time": [], "peer_sizes": [],
                                                           "peer_busbw": [], "peer_time": [], "peer": None})
        b["sizes"].append(r["size"])
        b["busbw"].append(res.get("bus_bw") or 0.0)
        b["time"].append(res["time"])
        peer = r.get("peer")
        if peer and peer.get("time"):
            b["peer"] = peer.get("name")
            b["peer_sizes"].append(r["size"])
            b["peer_busbw"].append(peer.get("bus_bw") or 0.0)
            b["peer_time"].append(peer["time"])
    return out


def plot_docs(docs: list[tuple[str, dict]], path: str | None = None, title: str | None = None):
    """One figure, two panels (busbw, time) vs size; one solid line per block of each (label, doc), one dashed
    line per block's peer. Writes `path` (PNG) when given and returns the Figure."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax_bw, ax_t = fig.subplots(1, 2)
    n = 0
    drawn_peers = set()
    for label, doc in docs:
        for name, b in _blocks(doc, label).items():
            color = f"C{n % 10}"
            n += 1
            ax_bw.plot(b["sizes"], [max(v, 1e-9) for v in b["busbw"]], "o-", color=color, label=name)
            ax_t.plot(b["sizes"], b["time"], "o-", color=color, label=name)
            # One run measures its peer once for all its blocks (--algo a,b,c): draw each peer series once, in
            # black, instead of one identical dashed line per block.
            key = (label, b["peer"], tuple(b["peer_sizes"]), tuple(b["peer_time"]))
            if b["peer_sizes"] and key not in drawn_peers:
                drawn_peers.add(key)
                peer = f"{b['peer']}" + (f" ({label})" if label else "")
                ax_bw.plot(b["peer_sizes"], [max(v, 1e-9) for v in b["peer_busbw"]], "s--", color="k", label=peer)
                ax_t.plot(b["peer_sizes"], b["peer_time"], "s--", color="k", label=peer)
    for ax, what in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (B)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    if title is None and docs:
        env = docs[0][1].get("environment", {})
        title = f"{docs[0][1].get('program', 'gpucoll-bench')} - {env.get('nranks', '?')} ranks on " \
                f"{env.get('hostname', '?')} ({env.get('cpu', '')})"
    if title:
        fig.suptitle(title)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def report_main(argv: list[str]) -> int:
    """gpucoll-bench report A.json B.json -o cmp.png"""
    p = argparse.ArgumentParser(prog="gpucoll-bench report", description="Compare saved gpucoll-bench --json runs "
                                "in one plot: one line per file x block of rows.")
    p.add_argument("files", nargs="+", help="JSON files written by gpucoll-bench --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    docs = []
    for path in args.files:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"gpucoll-bench report: error: cannot read {path!r}: {e}", file=sys.stderr)
            return 2
        for i, d in enumerate(doc if isinstance(doc, list) else [doc]):  # --check writes a list of runs
            docs.append((path if not isinstance(doc, list) else f"{path}[{i}]", d))
    plot_docs(docs, args.output, args.title)
    print(f"gpucoll-bench report: wrote {args.output}")
    return 0
