"""--plot and `gpucoll-bench report`: busbw and time vs size (log axes), one line per block of rows.

A block is a run's rows for one (collective, backend, algorithm, datatype, op); the peer of --compare is drawn
dashed in black, once per run. A block that ran as "auto" is named after what auto picked ("host:auto→twoshot",
or the picks in size order). Sizes read 1K/1M/1G, times and bandwidths as plain numbers, and the legend sits below
both panels, where it covers no data. matplotlib is imported here only (Agg backend), i.e. only when a plot is
asked for. The plotting functions return the Figure so callers (and tests) can inspect it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from gpucoll._help import HelpFormatter
from gpucoll.bench.report import size_label


def _machine(doc: dict) -> str:
    """The GPU model of a run on CUDA devices (its devices' "cuda:N NAME [backend]"), else the CPU model."""
    for dev in doc.get("devices", []):
        text = str(dev.get("device", ""))
        if text.startswith("cuda:"):
            return text.split(" ", 1)[-1].rsplit(" [", 1)[0]
    return doc.get("environment", {}).get("cpu", "")


def _collectives(doc: dict) -> set:
    return {r.get("collective") or doc.get("config", {}).get("collective") for r in doc.get("results", [])}


def _algorithm(rows: list) -> str:
    """A block's algorithm: "auto→ring" when the rows say what auto ran (in size order when it changed)."""
    algo = str(rows[0].get("algo"))
    picks = []
    for r in sorted(rows, key=lambda r: r["size"]):
        pick = r.get("algo_resolved")
        if pick and pick != algo and pick not in picks:
            picks.append(pick)
    return f"{algo}→{','.join(picks)}" if picks else algo


def _blocks(doc: dict, label: str = "", show_coll: bool = False) -> dict:
    """(name) -> {"sizes", "busbw", "time", "peer_busbw", "peer_time", "peer"} for the rows of one run. Names
    carry the collective when the run has several, or `show_coll` (the plot compares runs of different ones)."""
    backend = doc.get("environment", {}).get("backend", "")
    show_coll = show_coll or len(_collectives(doc)) > 1
    types = {(r.get("type"), r.get("redop")) for r in doc.get("results", [])}
    out: dict = {}
    names: dict = {}  # the rows of each block, to name its algorithm from all of them
    for r in doc.get("results", []):
        names.setdefault(_block_key(r, doc, label, show_coll, backend, len(types) > 1), []).append(r)
    for r in doc.get("results", []):
        res = r.get("out_of_place") or {}
        if res.get("time") is None or not r.get("size"):
            res = r.get("in_place") or {}
        if res.get("time") is None or not r.get("size"):
            continue
        key = _block_key(r, doc, label, show_coll, backend, len(types) > 1)
        head, b_name, _, tail = key
        algo = _algorithm(names[key])
        name = " ".join(p for p in (head, f"{b_name}:{algo}" if b_name else algo, tail) if p)
        b = out.setdefault(name, {"sizes": [], "busbw": [], "time": [], "peer_sizes": [], "peer_busbw": [],
                                  "peer_time": [], "peer": None})
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


def _block_key(r: dict, doc: dict, label: str, show_coll: bool, backend: str, show_type: bool) -> tuple:
    """A row's block: (label and collective, backend name, algorithm, type/op), named once all its rows are known."""
    head = [label] if label else []
    coll = r.get("collective") or doc.get("config", {}).get("collective", "")
    if show_coll and coll not in label.split():  # a label may name it already (the health check's do)
        head.append(coll)
    # Rows of a backend sweep each name theirs; the label keeps two runs of one backend apart (nccl, auto(nccl)).
    b_name = r.get("backend_label") or r.get("backend") or backend
    if b_name and b_name in label.split():
        b_name = ""
    tail = f"{r.get('type')}/{r.get('redop')}" if show_type else ""
    return " ".join(p for p in head if p), b_name, str(r.get("algo")), tail


def _size_ticks(lo: float, hi: float) -> list:
    """Powers of two within [lo, hi], every 1st, 2nd, 5th or 10th exponent (at most about 9 ticks): steps that divide
    10, so that 1K, 1M and 1G are among them whenever they are in range."""
    e0, e1 = math.ceil(math.log2(max(lo, 1))), math.floor(math.log2(max(hi, 1)))
    step = next((s for s in (1, 2, 5, 10) if (e1 - e0) / s <= 9), 10)
    return [2.0**e for e in range(e0, e1 + 1) if e % step == 0]


def _axes(ax, what: str) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(_size_ticks(*ax.get_xlim())))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    # Decades, with 2 and 5 between them when the data spans little, evenly spaced values when it spans less than
    # a factor of 3: every panel has several labelled ticks, as plain numbers (0.01, 0.2, 50, 102), rather than
    # 10^-2 or a single label.
    lo, hi = (max(v, 1e-12) for v in ax.get_ylim())
    if hi / lo < 3:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    else:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if hi / lo > 1e4 else (1.0, 2.0, 5.0), numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel(what)
    ax.grid(True, which="both", alpha=0.3)


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
    show_coll = len(set().union(*(_collectives(doc) for _, doc in docs))) > 1 if docs else False
    for label, doc in docs:
        for name, b in _blocks(doc, label, show_coll).items():
            color = f"C{n % 10}"
            n += 1
            # busbw is 0 where the collective moves nothing between ranks (1 rank: nccl-tests' factor (n-1)/n):
            # no point on a log axis rather than one pinned at a fake floor that squashes the rest.
            ax_bw.plot(b["sizes"], [v if v > 0 else math.nan for v in b["busbw"]], "o-", color=color, label=name)
            ax_t.plot(b["sizes"], b["time"], "o-", color=color, label=name)
            # One run measures its peer once for all its blocks (--algo a,b,c): draw each peer series once, in
            # black, instead of one identical dashed line per block.
            key = (label, b["peer"], tuple(b["peer_sizes"]), tuple(b["peer_time"]))
            if b["peer_sizes"] and key not in drawn_peers:
                drawn_peers.add(key)
                peer = f"{b['peer']}" + (f" ({label})" if label else "")
                ax_bw.plot(b["peer_sizes"], [v if v > 0 else math.nan for v in b["peer_busbw"]], "s--", color="k",
                           label=peer)
                ax_t.plot(b["peer_sizes"], b["peer_time"], "s--", color="k", label=peer)
    for ax, what in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        _axes(ax, what)
    if ax_t.lines:
        # One legend for both panels (they draw the same lines), outside them: it can never hide a point. As many
        # columns as fit the figure's width with the longest label.
        handles, labels = ax_t.get_legend_handles_labels()
        ncols = max(1, min(len(labels), 4, 140 // (max(len(t) for t in labels) + 8)))
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize="small")
    if title is None and docs:
        # What the runs share: the program (collective), rank count and machine, each only when all runs agree.
        envs = [doc.get("environment", {}) for _, doc in docs]
        programs = {doc.get("program", "gpucoll-bench") for _, doc in docs}
        title = programs.pop() if len(programs) == 1 else "gpucoll-bench"
        if len({e.get("nranks") for e in envs}) == 1:
            title += f" - {envs[0].get('nranks', '?')} ranks"
        machines = {(e.get("hostname"), _machine(doc)) for e, (_, doc) in zip(envs, docs)}
        if len(machines) == 1:
            host, what = machines.pop()
            title += f" on {host or '?'} ({what})"
    if title:
        fig.suptitle(title)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucoll-bench report", formatter_class=HelpFormatter,
                                description="Compare saved gpucoll-bench --json runs in one plot: one line per file x "
                                            "block of rows.")
    p.add_argument("files", nargs="+", help="JSON files written by gpucoll-bench --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None, help="the plot's title (default: what the runs share: program, ranks, "
                                                 "machine)")
    return p


def report_main(argv: list[str]) -> int:
    """gpucoll-bench report A.json B.json -o cmp.png"""
    p = _report_parser()
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
