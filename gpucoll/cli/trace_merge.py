"""Reading flight-recorder dumps (gpucoll/flight_recorder.py writes them): one per rank, merged on the wall clock.

Each dump's CLOCK_MONOTONIC entries are put on the wall clock with the offset that dump measured, so ranks on one
machine line up exactly and ranks on several as well as their clocks agree. Used by ``python -m gpucoll trace``
(trace_cli.py) and its picture (trace_plot.py).
"""

from __future__ import annotations

import json
import statistics

from gpucoll.flight_recorder import FORMAT, start_ns


class TraceFileError(Exception):
    pass


def load(paths: list) -> list:
    """The dumps, one per rank (the newest where a rank appears twice), sorted by rank."""
    by_rank = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceFileError(f"{path}: not readable as a flight-recorder dump: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise TraceFileError(f"{path}: not a gpucoll flight-recorder dump (no \"format\": \"{FORMAT}\")")
        doc["path"] = path
        old = by_rank.get(doc["rank"])
        if old is None or doc["written_realtime_ns"] > old["written_realtime_ns"]:
            by_rank[doc["rank"]] = doc
    keys = {d["communicator"] for d in by_rank.values()}
    if len(keys) > 1:
        raise TraceFileError(f"the files come from {len(keys)} communicators ({', '.join(sorted(keys))}): give the "
                             f"files of one")
    return [by_rank[r] for r in sorted(by_rank)]


def entries(doc: dict) -> list:
    """A dump's entries with wall-clock times (start, end; end None while it ran). A backend that cannot see when
    an operation starts on its device (NCCL) gives its enqueue time as its start."""
    t = doc["trace"]
    off = t["realtime_ns"] - t["monotonic_ns"]
    out = []
    for e in t["entries"]:
        e = dict(e, start=(start_ns(e) + off) * 1e-9, end=(e["end_ns"] + off) * 1e-9 if e["end_ns"] else None)
        out.append(e)
    return out


def collectives(docs: list) -> dict:
    """{(coll_seq, op): {rank: entry}} over every collective in the dumps: collectives are numbered alike on every
    rank (coll_seq; NCCL's seq counts sends and receives too, which ranks make in different numbers), point-to-point
    batches are not, so they stay out."""
    table: dict = {}
    for d in docs:
        for e in entries(d):
            if e["op"] != "p2p":
                table.setdefault((e["coll_seq"], e["op"]), {})[d["rank"]] = e
    return table


def straggler_rows(docs: list) -> tuple:
    """(collectives measured, rows): per rank its median, p90 and max lateness against the first to arrive, and
    how many times it arrived last, over the collectives every dump holds."""
    ranks = [d["rank"] for d in docs]
    late = {r: [] for r in ranks}
    last = dict.fromkeys(ranks, 0)
    n = 0
    for per_rank in collectives(docs).values():
        if len(per_rank) != len(ranks) or len(ranks) < 2:
            continue
        n += 1
        first = min(e["start"] for e in per_rank.values())
        arrivals = sorted((e["start"], r) for r, e in per_rank.items())
        for r, e in per_rank.items():
            late[r].append(e["start"] - first)
        if arrivals[-1][0] > arrivals[-2][0]:
            last[arrivals[-1][1]] += 1
    rows = []
    for r in ranks:
        xs = sorted(late[r])
        if not xs:
            continue
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        rows.append((r, statistics.median(xs), p90, xs[-1], last[r]))
    return n, rows


def never_came(docs: list) -> set:
    """The ranks a timeout named as never having reached the failed operation: the only word a GPU backend has on
    the ranks that wrote no dump."""
    return {r for d in docs if d["error"] and d["error"]["type"] == "CollectiveTimeout" for r in d["error"]["ranks"]}
