"""The picture of ``python -m gpucoll trace --plot``: one lane per rank over wall-clock time, one bar per operation
of its flight recorder, so a rank that arrives late, or never, stands out at a glance.

Two panels share the lanes, because a hang mixes two time scales: the collectives before the failure take
microseconds to milliseconds, the failed one lasts the whole timeout. The left panel shows the last collectives up to
the failed one's first arrival, the right one the failed collective until the dumps were written. Each collective
keeps one color on every lane, so the eye matches a rank's bar to the same call on the others; a bar that never
completed is hatched in red. A rank that wrote no dump gets an empty lane saying what the others saw of it. Bars are
at least a pixel wide: a 10 us all_reduce on a long axis would otherwise vanish.
"""

from __future__ import annotations

from gpucoll.cli.trace_merge import collectives, entries, never_came

_SHOWN = 12  # collectives in the left panel


def _bars(ax, docs, lo: float, hi: float, t0: float, color_of: dict) -> None:
    min_w = (hi - lo) / 800
    for d in docs:
        written = d["written_realtime_ns"] * 1e-9
        es = sorted(entries(d), key=lambda e: e["start"])
        for i, e in enumerate(es):
            end = e["end"] if e["end"] is not None else written
            # A GPU backend sees an operation end late (NCCL: the watchdog's next poll): up to the lane's next
            # operation, so the bars stay one after the other as the calls were.
            if i + 1 < len(es):
                end = min(end, max(es[i + 1]["start"], e["start"]))
            if end < lo or e["start"] > hi:
                continue
            never = e["state"] in ("failed", "running")
            face = "white" if never else "0.75" if e["op"] == "p2p" else color_of.get((e["coll_seq"], e["op"]), "0.5")
            ax.barh(d["rank"], max(end - e["start"], min_w) * 1e3, left=(e["start"] - t0) * 1e3, height=0.6, color=face,
                    edgecolor="red" if never else face, hatch="//" if never else None, linewidth=1.2 if never else 0)


def draw(docs: list, path: str):
    """Writes the lanes of `docs` (trace_cli.load) to `path` (PNG) and returns the Figure."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    world = docs[0]["world_size"]
    end_all = max(d["written_realtime_ns"] for d in docs) * 1e-9
    table = collectives(docs)
    keys = sorted(table)
    # A running job's dumps (no failure): the last collective stands where the failed one would.
    failed = next((d["failed"] for d in docs if d["failed"]), None) or \
        ({"op": keys[-1][1], "seq": keys[-1][0], "coll_seq": keys[-1][0]} if keys else
         {"op": "-", "seq": 0, "coll_seq": 0})
    fkey = (failed["coll_seq"], failed["op"])
    before = [k for k in keys if k < fkey][-_SHOWN:]
    t_fail = min((e["start"] for e in table.get(fkey, {}).values()), default=end_all)
    t_lo = min((e["start"] for k in before for e in table[k].values()), default=t_fail - 1e-3)
    color_of = {k: f"C{i % 10}" for i, k in enumerate(keys) if f"C{i % 10}" != "C3"}  # C3 is red: kept for failures
    fig = Figure(figsize=(12, 1.6 + 0.5 * world), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    # Times in ms from the failed collective's first arrival: the left panel reads negative, the right positive.
    pad = max(t_fail - t_lo, 1e-6) * 0.05
    for ax, lo, hi in ((left, t_lo - pad, t_fail + pad), (right, t_fail, end_all)):
        # The scale must be set before the bars: _bars sizes its minimum width from it.
        ax.set_xlim((lo - t_fail) * 1e3, (hi - t_fail) * 1e3)
        _bars(ax, docs, lo, hi, t_fail, color_of)
        ax.axvline(0, color="red", linestyle=":", linewidth=1)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel(f"ms from the first arrival at {failed['op']} #{failed['seq']}")
    left.set_title(f"the last {len(before)} collectives before it", fontsize="small")
    right.set_title(f"{failed['op']} #{failed['seq']}, until the dumps", fontsize="small")
    have = {d["rank"] for d in docs}
    absent = never_came(docs)
    states = docs[0].get("peer_states") or []
    for r in range(world):
        if r in have:
            continue
        st = states[r] if r < len(states) else None
        what = "no dump"
        if st is None and r in absent:
            what += f" (a timeout named it as never reaching #{failed['seq']})"
        if st is not None:
            done = "unknown" if st["done"] is None else f"#{st['done']}"
            what += (": dead" if st["exited"] else "") + f" (last completed {done}" + (
                f", never entered #{failed['seq']})" if st["entered"] < failed["seq"] else ")")
        right.text(0.02, r, what, transform=right.get_yaxis_transform(), va="center", fontsize="small", color="0.3")
    left.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    left.set_ylim(world - 0.5, -0.5)
    fig.legend(handles=[Patch(facecolor="white", edgecolor="red", hatch="//", label="never completed")],
               loc="outside lower center", fontsize="small", frameon=False)
    fig.suptitle(f"flight recorder of {docs[0]['communicator']}: one lane per rank, one color per collective",
                 fontsize="medium")
    fig.savefig(path, dpi=100)
    return fig
