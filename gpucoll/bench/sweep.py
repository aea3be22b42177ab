"""A benchmark sweep that ends on time: what gpucoll-tune --calibrate measures (gpucoll/cli/calibrate.py).

gpucoll-bench runs the sizes it is given, however long they take; a calibration has a wall-time budget instead
and must spend it where the fit needs it. Two phases, on every rank in step (rank 0's clock decides, and each
decision reaches the others through the communicator, so every rank runs the same calls):

1. probe: sizes from the smallest up by a factor, one call each, until a call takes more than LARGEST_CALL_SHARE
   of the budget, the probe has used PROBE_SHARE of it, or the largest size is reached. On a GPU this reaches
   the bandwidth regime; on a slow machine (the emulated device) it stops where a call gets too costly to repeat.
2. rounds: every probed size again, out of place, with enough iterations per row that each row takes about the
   same time, round after round while another round fits before the deadline. A size's time is the median of
   its rounds: a busy machine disturbs some rounds, and the median ignores them where a mean would not.

Rows are the benchmark's own measurement (harness._Rank.bench: nccl-tests' timed loop, mean over ranks), and the
document is gpucoll-bench's --json format, so gpucoll-tune fits it as it fits any benchmark run; each row also
keeps its rounds ("samples_us").
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from gpucoll.bench import colls, harness, report
from gpucoll.bench.colls import DTYPES

PROBE_SHARE = 0.3  # of the budget, at most, for the probe: the rounds need the rest for the medians
# A size whose one call takes longer than this share of the budget is the last one probed: each round repeats
# every size, and a size that costs a tenth of the rounds' time leaves too few rounds for the others' medians.
# On a GPU every size up to 256 MiB stays far below it (milliseconds against a 60 s budget's 0.1 s); the emulated
# device reaches it near 64 MiB.
LARGEST_CALL_SHARE = 1 / 600
ROUNDS = 7  # rows are sized so that this many rounds fill the time left: a median of 7 ignores 3 disturbed ones
MAX_ITERS = 50  # per row: beyond this the noise of a row is no longer the calls' own


class _SweepRank(harness._Rank):
    """One rank of the sweep: harness._Rank's buffers and timed loop, a deadline instead of a size list."""

    def __init__(self, comm, p: harness.Params, deadline: float):
        super().__init__(comm, p)
        self.deadline = deadline  # time.time() on rank 0's clock

    def _rank0(self, value: float) -> float:
        """Rank 0's value on every rank (the others add 0), so a decision taken on rank 0's clock is everyone's."""
        return float(self._sum([value if self.rank == 0 else 0.0])[0])

    def _left(self) -> float:
        return self._rank0(self.deadline - time.time())

    def _measure(self, dt, op: str, algo: str, size: int, iters: int) -> tuple[int, float, int | None]:
        """(bytes moved, seconds per call, #wrong or None) of one out-of-place row of `iters` calls."""
        counts = self.coll.counts(size // dt.itemsize, self.n, dt.itemsize)
        self.p.iters = iters
        us, _algbw, _busbw, wrong = self.bench(dt, op, algo, counts, in_place=False)
        return max(counts.send, counts.recv) * dt.itemsize, us * 1e-6, wrong

    def sweep(self) -> dict:
        p = self.p
        dt, op = DTYPES[p.dtypes[0]], p.ops[0] if self.coll.reduces else "sum"
        started = time.time()
        budget = self._left()
        # probe: one call per size (after the warmup call), checked where -c asks for it
        probed: dict = {a: {} for a in p.algos}  # algo -> {bytes: seconds per call}
        wrong = 0
        for algo in p.algos:
            for size in harness.sizes(p):
                nbytes, sec, bad = self._measure(dt, op, algo, size, 1)
                probed[algo][nbytes] = sec
                wrong += bad or 0
                spent = budget - self._left()
                if sec > budget * LARGEST_CALL_SHARE or spent > budget * PROBE_SHARE * (p.algos.index(algo) + 1) \
                        / len(p.algos):
                    break
        p.check = 0  # the rounds only time: the probe checked every size
        # rounds: each row's iterations sized so that ROUNDS rounds fill what is left
        samples: dict = {(a, b): [] for a in p.algos for b in probed[a]}
        left = self._left()
        rows = len(samples)
        row_s = max(left / (ROUNDS * rows), 1e-6) if rows else 0.0
        iters = {(a, b): int(min(MAX_ITERS, max(1, row_s // max(probed[a][b], 1e-9)))) for a, b in samples}
        round_s = sum(iters[k] * probed[k[0]][k[1]] for k in samples)
        rounds, slowest = 0, round_s
        # Another round only where the slowest so far, half again, still fits: on a busy machine one round can take
        # twice another, and the budget is a bound, not a target.
        while samples and (rounds == 0 or self._left() > 1.5 * slowest):
            t0 = time.time()
            for (algo, nbytes), got in samples.items():
                got.append(self._measure(dt, op, algo, nbytes, iters[(algo, nbytes)])[1])
            rounds += 1
            slowest = max(slowest if rounds > 1 else 0.0, self._rank0(time.time() - t0))
        return {"rows": self._rows(dt, op, samples, iters), "rounds": rounds, "wrong": wrong,
                "elapsed_s": time.time() - started, "doc_started": started, "past_deadline_s": -self._left()}

    def _rows(self, dt, op: str, samples: dict, iters: dict) -> list[dict]:
        coll, p = self.coll, self.p
        op_name = op if coll.reduces else "none"
        root = p.root if coll.rooted else -1
        out = []
        for (algo, nbytes), got in samples.items():
            median = statistics.median(got)
            count = coll.counts(nbytes // dt.itemsize, self.n, dt.itemsize).param
            row = report.json_row(nbytes, count, dt.name, op_name, root, algo, iters[(algo, nbytes)], coll.name)
            row["backend"] = self.comm.backend
            resolved = self._resolved(dt, algo, nbytes)
            if resolved is not None:
                row["algo_resolved"] = resolved
            row["backend_label"] = p.backend_label or self.comm.backend
            row["emulated"] = bool(getattr(self.mem, "emulated", False))
            algbw, busbw = coll.get_bw(count, dt.itemsize, median, self.n)
            row["out_of_place"] = report.json_result(median * 1e6, algbw, busbw, None)
            row["in_place"] = report.json_result(None, None, None, None)
            row["samples_us"] = [round(s * 1e6, 3) for s in got]
            out.append(row)
        return out


def run_rank(comm, p: harness.Params, deadline: float) -> dict:
    """gpucoll.spawn / virtual-rank entry: the sweep on this rank; rank 0 returns the gpucoll-bench document."""
    r = _SweepRank(comm, p, deadline)
    ranks = r.rank_info()
    got = r.sweep()
    if r.rank != 0:
        return {"rank": r.rank, "doc": None}
    r.rows = got["rows"]
    doc = r._json_doc(ranks, got["wrong"], 0.0, {}, got["doc_started"])
    doc["sweep"] = {"rounds": got["rounds"], "elapsed_s": round(got["elapsed_s"], 3),
                    "past_deadline_s": round(got["past_deadline_s"], 3),
                    "statistic": "median of the rounds' per-call times (samples_us), out of place"}
    return {"rank": 0, "doc": doc}


def rounds_spread(doc: dict) -> float:
    """The largest relative spread (max - min) / median of any row's rounds: how steady the machine was."""
    spreads = [(max(s) - min(s)) / statistics.median(s) for r in doc.get("results", [])
               if len(s := r.get("samples_us") or []) > 1]
    return float(np.max(spreads)) if spreads else 0.0


def supported(coll: str) -> bool:
    return colls.get(coll).coll_id >= 0
