"""The text table and the JSON document of gpucoll-bench.

The table reproduces nccl-tests' output (src/util.cu in NVIDIA/nccl-tests 2.19: writeResultHeader,
writeBenchmarkLinePreamble, writeBenchmarkLineBody, writeResultFooter) with the same printf formats, so tools
and eyes that read all_reduce_perf output read ours. Only the lines that describe the devices differ: ours
describe processes on a host. The JSON follows nccl-tests' -J layout (config, results with out_of_place and
in_place objects holding time, alg_bw, bus_bw, nwrong; out_of_bounds; average_bus_bandwidth) and adds an
"environment" object and each row's algorithm.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence

# printf-style formats on purpose in this file: they are nccl-tests' own, so the columns match by construction.
# nccl-tests' header, column for column (non-per-iteration mode, no timestamps: tsPad 0, tsLbl "").
_HDR_TITLE = "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n"
_HDR_COLS = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s\n"
_ROW_PREAMBLE = "%12li  %12li  %8s  %6s  %6s"
_ROW_BODY = "  %7s  %6s  %6s  %6g"
_ROW_BODY_NOCHECK = "  %7s  %6s  %6s    N/A"


def header_lines() -> list[str]:
    """The three lines nccl-tests prints before the rows (after a lone "#")."""
    return [
        "#\n",
        _HDR_TITLE % ("", "", "", "", ""),
        _HDR_COLS % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                     "busbw", "#wrong", 0, ""),
        _HDR_COLS % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "",
                     0, ""),
    ]


def float_str(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: the most decimals (2, 1, 0) that fit `width`, else scientific notation."""
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        text = fmt % (width, value)
        if len(text) <= width:
            return text
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def row_preamble(nbytes: int, count: int, type_name: str, op_name: str, root: int) -> str:
    return _ROW_PREAMBLE % (nbytes, count, type_name, op_name, "%6i" % root)  # noqa: UP031 - nccl-tests' printf format


def row_body(time_us: float, algbw: float, busbw: float, wrong: int | None) -> str:
    t, a, b = float_str(time_us, 7), float_str(algbw, 6), float_str(busbw, 6)
    if wrong is None:
        return _ROW_BODY_NOCHECK % (t, a, b)
    return _ROW_BODY % (t, a, b, float(wrong))


def row_body_not_run() -> str:
    """A placement the collective refused (ours: nccl-tests never prints one): N/A in every column."""
    return _ROW_BODY_NOCHECK % ("N/A", "N/A", "N/A")


def footer_lines(errors: int, avg_busbw: float, program: str, per_algo: dict[str, float] | None = None,
                 min_busbw: float | None = None) -> list[str]:
    lines = []
    if per_algo and len(per_algo) > 1:
        # Extra lines (ours) before nccl-tests' two, so parsers that look for "Avg bus bandwidth" still find one.
        for algo, bw in per_algo.items():
            lines.append("# %-20s : %g\n" % (f"Avg busbw {algo}", bw))  # noqa: UP031 - nccl-tests' printf format
    lines += [
        "# %-20s : %d %s\n" % ("Out of bounds values", errors, "FAILED" if errors else "OK"),  # noqa: UP031 - nccl-tests' printf format
        # nccl-tests prints "%g %s" with an empty verdict when NCCL_TESTS_MIN_BW is unset: a trailing space.
        # With a minimum (--min-busbw, nccl-tests' NCCL_TESTS_MIN_BW) the verdict is OK or FAILED as in nccl-tests.
        "# %-20s : %g %s\n" % ("Avg bus bandwidth", avg_busbw,  # noqa: UP031 - nccl-tests' printf format
                               "" if min_busbw is None else ("FAILED" if avg_busbw < min_busbw else "OK")),
        "#\n",
        f"# Collective test concluded: {program}\n",
    ]
    return lines


def preamble_lines(program: str, version: str, params, nranks: int, backend: str, algos: Sequence[str],
                   ranks: Sequence[dict], devices: str = "cpu") -> list[str]:
    """nccl-tests' lines before the table. `devices` says what a rank runs on: "cpu", "cuda" or "cuda (emulated)".
    nccl-tests' "nGpus" (GPUs per process) stays where ranks hold a GPU, and "nRanks N devices KIND" follows: its
    "nGpus 1" alone said that CPU ranks had a GPU each and gave no rank count."""
    step = f"{params.stepfactor}(factor)" if params.stepfactor > 1 else f"{params.stepbytes}(bytes)"
    gpus = "nGpus 1 " if devices.startswith("cuda") else ""
    lines = [
        f"# gpucoll-bench (gpucoll {version}, nccl-tests format) backend: {backend} algo: {','.join(algos)}\n",
        f"# Collective test starting: {program}\n",
        (f"# nThread 1 {gpus}nRanks {nranks} devices {devices} minBytes {params.minbytes} maxBytes {params.maxbytes} "
         f"step: {step} warmup iters: "
         f"{params.warmup_iters} iters: {params.iters} agg iters: 1 validation: {params.check} graph: "
         f"{getattr(params, 'graph', 0)} unalign: 0\n"),
        "#\n",
        "# Using devices\n",
    ]
    for r in ranks:
        lines.append("#  Rank %2d Group %2d Pid %6d on %10s device %s\n"  # noqa: UP031 - nccl-tests' printf format
                     % (r["rank"], 0, r["pid"], r["hostname"], r["device"]))
    return lines


class Printer:
    """Writes table text on the printing rank only, a whole line at a time, flushed (nccl-tests' stdout is
    line-buffered on a terminal), so a long run shows each row as soon as it is measured. With a progress bar
    (`bar`, tqdm on stderr) on the same terminal, the bar is cleared before each line and redrawn after: a row
    written next to it would land on the bar's line."""

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None
        self._pending = ""

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        self._pending += text
        done, newline, self._pending = self._pending.rpartition("\n")
        if not newline:
            return
        if self.bar is not None:
            self.bar.clear()
        self.stream.write(done + newline)
        self.stream.flush()
        if self.bar is not None:
            self.bar.refresh()

    def lines(self, lines: Sequence[str]) -> None:
        self.write("".join(lines))


def size_label(n: float) -> str:
    """1024 -> "1K", 3 << 20 -> "3M": a byte count as gpucoll-bench's -b/-e take it (the plots' x axis, --help)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def json_row(nbytes: int, count: int, type_name: str, op_name: str, root: int, algo: str, iters: int,
             collective: str = "") -> dict:
    return {"size": nbytes, "count": count, "type": type_name, "redop": op_name, "root": root,
            "collective": collective, "algo": algo, "actual_iterations": iters, "experiment_name": ""}


def json_result(time_us: float | None, algbw: float | None, busbw: float | None, wrong: int | None) -> dict:
    """One placement's numbers; all None when it was not run."""
    return {"time": time_us, "alg_bw": algbw, "bus_bw": busbw, "nwrong": None if wrong is None else float(wrong)}


def merge_docs(docs: list[dict]) -> dict:
    """One document for a sweep of backends (--backend a,b): the first run's config and environment, every run's
    rows (each row names its backend and label), devices tagged with both, and the totals over the runs (keyed by
    label). environment.backend is the comma-joined list; environment.backends, backend_labels and environments
    keep each run's."""
    import copy

    out = copy.deepcopy(docs[0])
    envs = [d.get("environment", {}) for d in docs]
    backends = [e.get("backend", "") for e in envs]
    # Keys by label ("auto(nccl)" next to "nccl"): two runs of one backend in a sweep must not overwrite each other.
    labels = [e.get("backend_label") or b for e, b in zip(envs, backends)]
    out["environment"]["backend"] = ",".join(backends)
    out["environment"]["backends"] = backends
    out["environment"]["backend_labels"] = labels
    out["environments"] = envs
    out["results"] = [r for d in docs for r in d.get("results", [])]
    out["devices"] = [dict(dev, backend=b, backend_label=lb) for d, b, lb in zip(docs, backends, labels)
                      for dev in d.get("devices", [])]
    errors = sum(d.get("out_of_bounds", {}).get("count", 0) for d in docs)
    out["out_of_bounds"] = {"count": errors, "okay": errors == 0}
    bws = [d.get("average_bus_bandwidth", {}) for d in docs]
    per = {f"{lb}:{a}": v for lb, bw in zip(labels, bws) for a, v in bw.get("per_algo", {}).items()}
    avg = sum(bw.get("bandwidth", 0.0) for bw in bws) / len(bws)
    oks = [bw.get("okay") for bw in bws]
    out["average_bus_bandwidth"] = {"bandwidth": avg, "per_algo": per, "per_backend": dict(zip(labels, (
        bw.get("bandwidth", 0.0) for bw in bws))), "min": bws[0].get("min"),
        "okay": "unchecked" if "unchecked" in oks else all(oks)}
    return out


@contextlib.contextmanager
def _output(path: str, newline: str | None = None):
    """A text file to write `path` through: "-" is stdout; a file is written to a temporary name and renamed, so a
    reader never sees half of it."""
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline=newline) as f:
        yield f
    os.replace(tmp, path)


def write_json(path: str, doc) -> None:
    """`doc` as indented JSON to `path` ("-": stdout)."""
    with _output(path) as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


# -- extras (ours, after nccl-tests' columns so its column set is unchanged) ----------------------------------
_PEER_HDR = "  %9s  %6s"


def header_lines_peer(peer: str) -> list[str]:
    """header_lines() with the peer's time and the ratio (peer time / gpucoll out-of-place time) appended after
    nccl-tests' last column."""
    base = header_lines()
    return [base[0], base[1].rstrip("\n") + "\n",
            base[2].rstrip("\n") + (_PEER_HDR % (f"{peer}", "ratio")) + "\n",
            base[3].rstrip("\n") + (_PEER_HDR % ("(us)", "")) + "\n"]


def row_peer(peer_time_us: float | None, ratio: float | None) -> str:
    return _PEER_HDR % ("N/A" if peer_time_us is None else float_str(peer_time_us, 9),
                        "N/A" if ratio is None else float_str(ratio, 6))


_ERR_HDR = "  %9s"


def with_max_error(lines: list[str]) -> list[str]:
    """The header lines with --compress's column: the largest |error| of the checked calls."""
    return [lines[0], lines[1], lines[2].rstrip("\n") + _ERR_HDR % "maxerr" + "\n", lines[3].rstrip("\n") + _ERR_HDR % "" + "\n"]


def row_max_error(value: float | None) -> str:
    return _ERR_HDR % ("N/A" if value is None else f"{value:9.3g}")


def flat_row(row: dict) -> dict:
    """A JSON row flattened for CSV: nested placement/peer objects become dotted columns."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.{k}"] = v
        else:
            out[key] = value
    return out


def write_csv(path: str, doc: dict) -> None:
    """Every row of `doc` as CSV. The run's environment (doc["environment"], gpucoll info included) is in "# "
    comment lines before the header line (pandas: read_csv(path, comment="#"))."""
    import csv

    rows = [flat_row(r) for r in doc.get("results", [])]
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with _output(path, newline="") as f:
        f.write(f"# program: {doc.get('program', '')}\n")
        f.writelines(f"# environment.{key}: {json.dumps(value, sort_keys=True)}\n" for key, value in doc.get("environment", {}).items())
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def read_csv_rows(path: str) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))
