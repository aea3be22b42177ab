"""``python -m gpucoll trace FILE...``: read the flight-recorder dumps of a failed collective (gpucoll/flight_recorder.py
writes one per rank that could still run) and say what happened, with no script of your own.

It merges the ranks' files (ranks that wrote none, being dead or stuck, are described from what the others saw of
them), then prints the failure, where every rank was, the timeline of the last collectives around it (each rank's
arrival after the first rank, its state) and the straggler table over every collective the dumps share (median,
p90 and max lateness, and how often each rank arrived last). ``--plot FILE.png`` draws the ranks as lanes over
time, one bar per operation, so the late or missing rank stands out.

The dumps are merged on the wall clock (trace_merge.py); matplotlib is imported only for --plot (trace_plot.py).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys

from gpucoll._help import HelpFormatter, reader_may_leave
from gpucoll.cli import trace_plot
from gpucoll.cli.trace_merge import TraceFileError, collectives, load, never_came, straggler_rows


def _size(b: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b} B"


def report(docs: list, around: int = 8) -> str:
    first = docs[0]
    world = first["world_size"]
    have = [d["rank"] for d in docs]
    missing = [r for r in range(world) if r not in have]
    failed = next((d["failed"] for d in docs if d["failed"]), None)
    out = [f"{len(docs)} dump(s) of communicator {first['communicator']} ({first['backend']} backend, {world} ranks): "
           f"ranks {', '.join(map(str, have))}" + (f"; no dump from rank(s) {', '.join(map(str, missing))}"
                                                   if missing else "")]
    if failed is None:
        out.append("no failure: dumps of a running job (Communicator.dump_trace)")
    else:
        out.append(f"failed: {failed['op']} #{failed['seq']}")
        for d in docs:
            if d["error"]:
                out.append(f"  rank {d['rank']}: {d['error']['type']}: {d['error']['message'].splitlines()[0]}")
        seen = next(d for d in docs if d["failed"])
        out.append(f"where every rank was (rank {seen['rank']}'s view): {seen['summary']}")
    table = collectives(docs)
    absent_ranks = never_came(docs)
    seqs = sorted(table)
    shown = seqs[-around:] if around > 0 else seqs
    states = next((d["peer_states"] for d in docs if d["failed"] and d.get("peer_states")), None) \
        or first.get("peer_states") or []
    out.append("")
    out.append(f"the last {len(shown)} collectives (numbered among collectives), each rank's arrival after the first "
               f"rank's, in ms (* last to arrive; FAILED / RUNNING: never completed there; - not entered; ? no dump)")
    head = f"  {'#':>6}  {'op':<14} {'size':>10}  {'algo':<18}" + "".join(f"{'rank ' + str(r):>14}" for r in range(world))
    out.append(head)
    for key in shown:
        per_rank = table[key]
        any_e = next(iter(per_rank.values()))
        t0 = min(e["start"] for e in per_rank.values())
        latest = max(per_rank.values(), key=lambda e: e["start"])
        tie = sum(1 for e in per_rank.values() if e["start"] == latest["start"]) > 1
        cells = []
        for r in range(world):
            e = per_rank.get(r)
            if e is None:
                st = states[r] if r < len(states) else None
                if st is not None and st.get("device") and key[1].startswith("nccl:"):
                    st = None  # the custom kernels' states number their own calls, not the NCCL fallback's
                absent = st["entered"] < key[0] if st is not None else failed is not None and r in absent_ranks \
                    and key == (failed["coll_seq"], failed["op"])
                cells.append("-" if absent else "?")
                continue
            cell = f"{(e['start'] - t0) * 1e3:.3f}"
            if e is latest and not tie and len(per_rank) > 1:
                cell += "*"
            if e["state"] in ("failed", "running", "mismatch"):
                cell += " " + e["state"].upper()
            cells.append(cell)
        out.append(f"  {key[0]:>6}  {key[1]:<14} {_size(any_e['bytes']):>10}  {any_e['algo'] or '-':<18}"
                   + "".join(f"{c:>14}" for c in cells))
    n, rows = straggler_rows(docs)
    out.append("")
    if n == 0:
        out.append("stragglers: no collective is in every dump (fewer than 2 dumps?)")
    else:
        out.append(f"stragglers over the {n} collectives every dump holds (lateness against the first to arrive):")
        out.append(f"  {'rank':>4}  {'median ms':>10}  {'p90 ms':>10}  {'max ms':>10}  {'last':>9}")
        for r, med, p90, mx, last in sorted(rows, key=lambda row: (-row[4], -row[1])):
            out.append(f"  {r:>4}  {med * 1e3:>10.3f}  {p90 * 1e3:>10.3f}  {mx * 1e3:>10.3f}  "
                       f"{last:>4} ({100 * last / n:.0f}%)")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gpucoll trace", formatter_class=HelpFormatter,
        description="Merge the flight-recorder dumps that a failed collective wrote (one JSON file per rank; the "
                    "error names them) and print the failure, where every rank was, the timeline of the last "
                    "collectives and the straggler table.",
        epilog="example: python -m gpucoll trace /tmp/gpucoll-trace-host-1a2b3c4d5e6f7a8b-rank*.json --plot hang.png")
    p.add_argument("files", nargs="+", metavar="FILE", help="dumps (gpucoll-trace-*-rank*.json); a pattern is "
                   "expanded here too")
    p.add_argument("--around", type=int, default=8, metavar="N",
                   help="collectives shown before the failure (0: all)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the ranks as lanes over time, one bar per operation (needs matplotlib)")
    return p


@reader_may_leave
def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if args.plot == "-" or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--plot {args.plot!r}: give a PNG file in a folder that exists and is writable")
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install 'gpucoll[bench]' (or matplotlib)")
    paths = []
    for f in args.files:
        paths += sorted(glob.glob(f)) if any(c in f for c in "*?[") else [f]
    if not paths:
        print(f"gpucoll trace: no file matches {' '.join(args.files)}", file=sys.stderr)
        return 2
    try:
        docs = load(paths)
    except TraceFileError as e:
        print(f"gpucoll trace: {e}", file=sys.stderr)
        return 2
    print(report(docs, args.around))
    if args.plot:
        trace_plot.draw(docs, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
