"""--plot and `gpucoll-bench report`: busbw and time vs size (log axes), one line per block of rows.

A block is a run's rows for one (collective, backend, algorithm, datatype, op); the peer of --compare is drawn
dashed in black, once per run. A block that ran as "auto" is named after what auto picked ("host:auto→twoshot",
or the picks in size order). Each collective and algorithm has one color, each run (label) and backend one line
style, so one algorithm in two runs is one color twice; runs of different rank counts say theirs in the legend
and the title. Sizes read 1K/1M/1G, times and bandwidths as plain numbers with several labels per axis, and the
legend sits below both panels, where it covers no data, measured to fit the figure's width. matplotlib is imported
here only (Agg backend), i.e. only when a plot is asked for. The plotting functions return the Figure so callers
(and tests) can inspect it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


def _algorithm(rows: list, backend: str = "") -> str:
    """A block's algorithm: "auto→ring" when the rows say what auto ran (in size order when it changed). A pick
    that only repeats the backend ("nccl" on NCCL) is left out, and "custom:oneshot" reads "oneshot" in a custom
    block: the legend names the backend once."""
    algo = str(rows[0].get("algo"))
    picks = []
    for r in sorted(rows, key=lambda r: r["size"]):
        pick = str(r.get("algo_resolved") or "")
        real = r.get("backend") or backend
        if pick == real:
            continue
        if real and pick.startswith(f"{real}:"):
            pick = pick[len(real) + 1:]
        if pick and pick != algo and pick not in picks:
            picks.append(pick)
    return f"{algo}→{','.join(picks)}" if picks else algo


def _blocks(doc: dict, label: str = "", show_coll: bool = False) -> dict:
    """(name) -> {"sizes", "busbw", "time", "peer_busbw", "peer_time", "peer", "style", "color"} for the rows of one
    run. Names carry the collective when the run has several, or `show_coll` (the plot compares runs of different
    ones). "style" is the block's (label, backend) and "color" the rest of its name (collective, algorithm asked,
    type/op): plot_docs draws one color per "color" and one line style per "style"."""
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
        head, coll, b_name, algo_asked, tail = key
        algo = _algorithm(names[key], r.get("backend") or backend)
        name = " ".join(p for p in (head, coll, f"{b_name}:{algo}" if b_name else algo, tail) if p)
        b = out.setdefault(name, {"sizes": [], "busbw": [], "time": [], "peer_sizes": [], "peer_busbw": [],
                                  "peer_time": [], "peer": None, "style": (label, b_name),
                                  "color": (coll, algo_asked, tail)})
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
    """A row's block: (label, collective, backend name, algorithm, type/op), named once all its rows are known."""
    coll = r.get("collective") or doc.get("config", {}).get("collective", "")
    if not show_coll or coll in label.split():  # a label may name it already
        coll = ""
    # Rows of a backend sweep each name theirs; the label keeps two runs of one backend apart (nccl, auto(nccl)).
    b_name = r.get("backend_label") or r.get("backend") or backend
    if b_name and b_name in label.split():
        b_name = ""
    tail = f"{r.get('type')}/{r.get('redop')}" if show_type else ""
    return label, coll, b_name, str(r.get("algo")), tail


def _size_ticks(lo: float, hi: float) -> list:
    """Powers of two within [lo, hi], every 1st, 2nd, 5th or 10th exponent (at most about 9 ticks): steps that divide
    10, so that 1K, 1M and 1G are among them whenever they are in range."""
    e0, e1 = math.ceil(math.log2(max(lo, 1))), math.floor(math.log2(max(hi, 1)))
    step = next((s for s in (1, 2, 5, 10) if (e1 - e0) / s <= 9), 10)
    return [2.0**e for e in range(e0, e1 + 1) if e % step == 0]


MIN_TICKS, MAX_TICKS = 4, 10


def value_ticks(lo: float, hi: float) -> list:
    """Labelled ticks for a log axis spanning [lo, hi]: decades (every 2nd, 3rd... beyond MAX_TICKS), else 1-2-5
    or 1-3 of each decade, the first that gives MIN_TICKS to MAX_TICKS; over less than about a decade, where none
    does, evenly spaced round values (0.4, 0.6, ... 1.6), so that every part of the axis has a label. matplotlib's
    own log locator labelled a busbw axis from 0.4 to 1.5 GB/s with "0.5" and "1" only."""
    lo, hi = max(lo, 1e-12), max(hi, 1e-12)
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for subs in ((1,), (1, 2, 5), (1, 3)):
        ticks = [float(f"{s * 10.0**e:.12g}") for e in range(e0, e1 + 1) for s in subs if lo <= s * 10.0**e <= hi]
        if subs == (1,) and len(ticks) > MAX_TICKS:
            step = math.ceil(len(ticks) / MAX_TICKS)
            return [t for t in ticks if round(math.log10(t)) % step == 0]
        if MIN_TICKS <= len(ticks) <= MAX_TICKS:
            return ticks
    from matplotlib.ticker import MaxNLocator

    ticks = (float(f"{t:.12g}") for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi))
    return [t for t in ticks if lo <= t <= hi]


def value_label(v: float) -> str:
    """A tick's number as people write it: 0.05, 2, 150, 20000 (never 2e+04)."""
    return f"{v:.0f}" if v >= 1e4 else f"{v:g}"


def _axes(ax, what: str) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(_size_ticks(*ax.get_xlim())))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.yaxis.set_major_locator(FixedLocator(value_ticks(*ax.get_ylim())))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: value_label(v)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel(what)
    ax.grid(True, which="both", alpha=0.3)


# Line styles of the (label, backend) groups: the first is the one of a plot of one run; "s--" is the peer's.
_STYLES = (("o", "-"), ("^", "--"), ("D", ":"), ("v", "-."), ("P", "-"), ("X", "--"))


def _ranks(n) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _ranks_suffix(docs: list[tuple[str, dict]]) -> list[str]:
    """Per run, " (N ranks)" when the runs do not all have the same rank count, else "": a 4-rank and a 2-rank
    run of one collective compare only when the legend says which is which."""
    counts = [doc.get("environment", {}).get("nranks") for _, doc in docs]
    if len(set(counts)) < 2:
        return [""] * len(docs)
    return [f" ({_ranks('?' if n is None else n)})" for n in counts]


def plot_docs(docs: list[tuple[str, dict]], path: str | None = None, title: str | None = None):
    """One figure, two panels (busbw, time) vs size; one line per block of each (label, doc), one color per
    collective and algorithm, one line style per label and backend; one dashed black line per block's peer.
    Writes `path` (PNG) when given and returns the Figure."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)  # a renderer to measure the legend with (_legend)
    ax_bw, ax_t = fig.subplots(1, 2)
    drawn_peers = set()
    styles: dict = {}  # (label, backend) -> index into _STYLES
    colors: dict = {}  # (collective, algorithm asked, type/op) -> color index
    no_busbw = []
    show_coll = len(set().union(*(_collectives(doc) for _, doc in docs))) > 1 if docs else False
    for (label, doc), ranks in zip(docs, _ranks_suffix(docs)):
        for name, b in _blocks(doc, label, show_coll).items():
            name += ranks
            c = colors.setdefault(b["color"], len(colors))
            # More blocks than colors (-d all -o all): the next ten take the next line style, so no two lines
            # look alike.
            marker, line = _STYLES[(styles.setdefault(b["style"], len(styles)) + c // 10) % len(_STYLES)]
            style = {"marker": marker, "linestyle": line, "color": f"C{c % 10}", "label": name}
            # busbw is 0 where the collective moves nothing between ranks (1 rank: nccl-tests' factor (n-1)/n):
            # no point on a log axis rather than one pinned at a fake floor that squashes the rest.
            if not any(v > 0 for v in b["busbw"]):
                no_busbw.append(name)
            ax_bw.plot(b["sizes"], [v if v > 0 else math.nan for v in b["busbw"]], **style)
            ax_t.plot(b["sizes"], b["time"], **style)
            # One run measures its peer once for all its blocks (--algo a,b,c): draw each peer series once, in
            # black, instead of one identical dashed line per block.
            key = (label, b["peer"], tuple(b["peer_sizes"]), tuple(b["peer_time"]))
            if b["peer_sizes"] and key not in drawn_peers:
                drawn_peers.add(key)
                peer = f"{b['peer']}" + (f" ({label})" if label else "")
                ax_bw.plot(b["peer_sizes"], [v if v > 0 else math.nan for v in b["peer_busbw"]], "s--", color="k",
                           label=peer)
                ax_t.plot(b["peer_sizes"], b["peer_time"], "s--", color="k", label=peer)
    for ax, what_axis in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        _axes(ax, what_axis)
    if no_busbw:
        # A legend entry with no line in the busbw panel would look like a plotting bug. Above the panel, where
        # it hides no point.
        ax_bw.set_title(f"no busbw line for {len(no_busbw)} of {len(ax_t.lines) - len(drawn_peers)}: busbw is 0 "
                        f"at 1 rank (nothing crosses ranks)", fontsize="small", loc="left", color="0.3")
    if ax_t.lines:
        _legend(fig, *ax_t.get_legend_handles_labels())
    if title is None and docs:
        title = _title(docs)
    if title:
        fig.suptitle(title)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def _legend(fig, handles, labels) -> None:
    """One legend for both panels (they draw the same lines), below them, where it can hide no point: as many
    columns (up to 4) as fit the figure's width, measured rather than guessed from the labels' lengths (a guess
    let wide legends run off both edges); labels too long for even one column are wrapped. A legend taller than
    a third of the figure makes the figure taller rather than the panels flatter."""
    import textwrap

    room = 0.98 * fig.get_figwidth() * fig.dpi
    renderer = fig.canvas.get_renderer()
    for ncols, size in [(n, s) for n in range(min(len(labels), 4), 0, -1) for s in ("small", "x-small")]:
        legend = fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=size)
        box = legend.get_window_extent(renderer)
        if box.width <= room:
            break
        legend.remove()
    else:
        chars = max(20, int(max(map(len, labels)) * room / box.width))
        labels = ["\n".join(textwrap.wrap(t, chars)) for t in labels]
        legend = fig.legend(handles, labels, loc="outside lower center", ncols=1, fontsize="x-small")
        box = legend.get_window_extent(renderer)
    height = box.height / fig.dpi
    if height > fig.get_figheight() / 3:
        fig.set_figheight(fig.get_figheight() + height)


def _title(docs: list[tuple[str, dict]]) -> str:
    """What the runs share: the program (collective; the health check's runs say that they are one), the rank
    counts, and the machine when all runs agree."""
    envs = [doc.get("environment", {}) for _, doc in docs]
    programs = {doc.get("program", "gpucoll-bench") for _, doc in docs}
    if all((e.get("argv") or [""])[0] == "--health-check" for e in envs):
        programs = {"gpucoll-bench --health-check"}
    title = programs.pop() if len(programs) == 1 else "gpucoll-bench"
    counts = list(dict.fromkeys(e.get("nranks", "?") for e in envs))
    if len(counts) == 1:
        title += f" - {_ranks(counts[0])}"
    else:
        title += f" - {', '.join(map(str, counts[:-1]))} and {counts[-1]} ranks"
    machines = {(e.get("hostname"), _machine(doc)) for e, (_, doc) in zip(envs, docs)}
    if len(machines) == 1:
        host, machine = machines.pop()
        title += f" on {host or '?'} ({machine})"
    return title


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
    # One file: its name in every legend entry would only repeat itself.
    names = _short_names(args.files) if len(args.files) > 1 else [""]
    for path, name in zip(args.files, names):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"gpucoll-bench report: error: cannot read {path!r}: {e}", file=sys.stderr)
            return 2
        # --health-check writes a list of runs, one per collective (and backend): the legend names those.
        docs += [(name, d) for d in (doc if isinstance(doc, list) else [doc])]
    plot_docs(docs, args.output, args.title)
    print(f"gpucoll-bench report: wrote {args.output}")
    return 0


def _short_names(paths: list[str]) -> list[str]:
    """Each file's legend label: its name, or as much of its path as tells it from the others (whole paths made
    legends wider than the figure)."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(paths)
