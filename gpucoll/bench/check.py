"""gpucoll-bench --health-check: a quick health check of a machine (a CI runner, a new box). Also spelled
gpucoll-bench check. (-c/--check N is nccl-tests' count of verified iterations per row, never the health check.)

A short sweep (-b 1K -e 64K -f 4 -n 5 -w 1 -c 1) of every collective, all collectives in one set of ranks per
backend. Backends: --backend, else the GPU backends gpucoll can run here (nccl, custom), else (no GPU) the host
backend, with a line saying that no GPU was checked and why; --require-gpu makes that case an error (exit 2), as
a GPU runner whose GPU went missing must not pass. The host backend is not in the default on a GPU machine: one
--min-busbw for CPU and GPU lines alike would mean nothing (add it with --backend host,nccl,custom).
Ranks: --nranks, else 2 on the host; on nccl one per GPU, and on a machine with one GPU 2 ranks sharing it through
NCCL's multi-rank mode where the loaded NCCL allows it (else 1); custom: 2 virtual ranks on GPU 0. One summary
line per (backend, collective), and a last line that names the backends checked.

Thresholds: --min-busbw GBS applies to every line; otherwise a tuning file (--tuning FILE, else
GPUCOLL_TUNING_FILE; the JSON gpucoll-tune writes) may hold a "min_busbw" object, looked up most specific first:
"backend:collective@nranks", "backend:collective", "backend", "collective", "default" (GB/s). Files without it
are fine: no threshold.
Exit status: 0 all OK, 1 any #wrong > 0 or a busbw below its threshold, 2 bad usage, 3 a run failed.
--json writes the list of the runs' JSON documents; --plot one plot with a line per collective.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from gpucoll import config
from gpucoll._help import HelpFormatter
from gpucoll._native import _C
from gpucoll.backends import nccl
from gpucoll.bench import colls, harness, report, virtual
from gpucoll.bench.harness import Params
from gpucoll.bench.plot import plot_docs
from gpucoll.bench.usage import EXIT_FAILED, EXIT_OK, EXIT_WRONG, UsageError, resolve_backend
from gpucoll.errors import Unsupported

SWEEP = {"minbytes": 1 << 10, "maxbytes": 64 << 10, "stepfactor": 4, "iters": 5, "warmup_iters": 1, "check": 1}


def gpu_backend_problems() -> dict[str, str | None]:
    """{"nccl": why not or None, "custom": ...}: whether cli.resolve_backend accepts each GPU backend here."""
    out: dict[str, str | None] = {}
    for b in ("nccl", "custom"):
        try:
            out[b] = None if resolve_backend(b) == b else f"--backend {b} resolves to another backend"
        except UsageError as e:
            out[b] = str(e)
    return out


def _no_gpu_reason(problems: dict) -> str:
    """One line for "no GPU backend runs here": the CUDA probe's reason when there is no GPU at all, else each
    backend's."""
    probe = _C.cuda_probe()
    if not probe.get("device_count"):
        return f"no usable CUDA GPU ({probe.get('reason') or 'no device'})"
    return "; ".join(f"{b}: {why.split('; use --backend')[0]}" for b, why in problems.items())


def default_backends() -> tuple[list[str], str | None]:
    """The default backends of --health-check and why no GPU is checked (None when one is): the GPU backends that can
    run here, else the host backend."""
    problems = gpu_backend_problems()
    gpu = [b for b, why in problems.items() if why is None]
    return (gpu, None) if gpu else (["host"], _no_gpu_reason(problems))


def load_thresholds(path: str | None) -> dict:
    """The "min_busbw" object of a tuning file ({} when there is none). Raises ValueError saying what is wrong."""
    if not path:
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"tuning file {path!r} cannot be read: {e}") from None
    table = doc.get("min_busbw", {}) if isinstance(doc, dict) else None
    if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
        raise ValueError(f"tuning file {path!r}: \"min_busbw\" must map keys such as \"nccl:all_reduce\" or "
                         f"\"default\" to GB/s numbers")
    return table


def threshold(table: dict, backend: str, coll: str, nranks: int) -> float | None:
    for key in (f"{backend}:{coll}@{nranks}", f"{backend}:{coll}", backend, coll, "default"):
        if key in table:
            return float(table[key])
    return None


def check_ranks(backend: str, asked: int | None) -> tuple[int, str]:
    """(ranks to run, a note) for `backend`: --nranks when given, else as the module docstring says."""
    if asked is not None:
        return asked, ""
    if backend != "nccl":
        return 2, ""
    gpus = int(_C.cuda_probe().get("device_count") or 0)
    if gpus >= 2:
        return gpus, ""
    try:
        nccl.spawn_plan(2, "nccl")
        return 2, "2 ranks share the GPU (NCCL multi-rank mode)"
    except Unsupported as e:
        return 1, f"1 rank: {str(e).splitlines()[0]}"


def _check_rank(comm, plist: list) -> list[dict]:
    return [harness.run_rank(comm, p) for p in plist]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpucoll-bench --health-check", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--nranks", type=int, default=None, help="ranks per backend (default: 2 on the host; on nccl "
                    "one per GPU, 2 sharing a single GPU where NCCL allows; custom: 2 virtual ranks)")
    ap.add_argument("--backend", default=None, help="comma list of host, nccl, custom (default: the GPU backends "
                    "that can run here, else host)")
    ap.add_argument("--require-gpu", action="store_true", help="exit status 2 unless a GPU backend is checked (for GPU "
                    "runners: a missing or broken GPU must not pass as a host-only check)")
    ap.add_argument("--min-busbw", type=float, default=None, metavar="GBS",
                    help="fail a line whose average busbw (GB/s) is below this (default: the tuning file's table)")
    ap.add_argument("--tuning", default=None, metavar="FILE", help="tuning JSON with a min_busbw object (default: "
                    "GPUCOLL_TUNING_FILE)")
    ap.add_argument("--json", "-J", default=None, metavar="FILE",
                    help="write the runs' JSON documents as one list; - writes it to stdout (the lines go to stderr)")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="one plot with a line per checked collective")
    ap.add_argument("--colls", default=",".join(colls.names()), metavar="LIST",
                    help="comma-separated collectives (default: all)")
    ap.add_argument("-T", "--timeout", type=float, default=120.0, help="seconds a collective may wait for peers")
    ap.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return ap


def _parse(argv: list[str]):
    ap = _parser()
    args = ap.parse_args(argv)
    names = [colls.canonical(c.strip()) for c in args.colls.split(",") if c.strip()]
    bad = [c for c in names if c not in colls.names()]
    if bad or (args.nranks is not None and args.nranks < 1):
        ap.error(f"unknown collective(s) {', '.join(bad)}" if bad else "--nranks must be >= 1")
    if args.tuning is None:
        args.tuning = config.get("GPUCOLL_TUNING_FILE").strip() or None
    try:
        args.table = load_thresholds(args.tuning)
    except ValueError as e:
        ap.error(str(e))
    args.no_gpu = None  # why no GPU backend is checked (when none is), said before the lines and in the summary
    if args.backend:
        try:
            backends = [resolve_backend(b.strip()) for b in args.backend.split(",") if b.strip()]
        except UsageError as e:
            ap.error(str(e))
        if not backends:
            ap.error("--backend: expected a comma list of host, nccl, custom")
        if not {"nccl", "custom"} & set(backends):
            args.no_gpu = f"--backend {args.backend} checks no GPU backend"
    else:
        backends, args.no_gpu = default_backends()
    if args.require_gpu and args.no_gpu:
        ap.error(f"--require-gpu: {args.no_gpu}")
    return args, names, list(dict.fromkeys(backends))


def check_main(argv: list[str]) -> int:
    try:
        args, names, backends = _parse(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    # --json -: the JSON is stdout's; the lines go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        if args.no_gpu and not args.backend:
            print(f"check: no GPU backend can run here, checking the host backend only: {args.no_gpu}")
        status, docs = _run_checks(args, names, backends, argv)
        if args.plot and docs:
            # Labelled by backend: one line style per backend, one color per collective (plot_docs).
            plot_docs([(d["environment"]["backend"], d) for d in docs], args.plot)
        checked = ", ".join(backends) + (" only: no GPU checked" if args.no_gpu else "")
        print(f"check: {'OK' if status == EXIT_OK else 'FAILED'} ({len(docs)} runs; backends: {checked})")
    if args.json:
        report.write_json(args.json, docs)
    return status


def _run_checks(args, names: list[str], backends: list[str], argv: list[str]) -> tuple[int, list]:
    """Each backend's sweep, one line per (backend, collective); (exit status, the runs' JSON documents)."""
    status, docs = EXIT_OK, []
    for backend in backends:
        n, note = check_ranks(backend, args.nranks)
        if note:
            print(f"check {backend:6s} {note}")
        plist = []
        for name in names:
            why = None
            if n < colls.get(name).min_ranks:
                why = f"needs {colls.get(name).min_ranks} ranks"
            elif backend == "custom" and name == "sendrecv":
                why = "virtual ranks have no point-to-point operations"
            elif backend == "custom" and not virtual.runs(name):
                # Virtual ranks issue only what gpucoll.testing.VirtualRanks implements (all_reduce): any other
                # collective would fail the whole backend's run, every line with it.
                why = "virtual ranks (gpucoll's own kernels) do not run it"
            if why:
                print(f"check {backend:6s} {name:15s} SKIP  {why}")
                continue
            low = args.min_busbw if args.min_busbw is not None else threshold(args.table, backend, name, n)
            plist.append(Params(coll=name, backend=backend, backend_label=backend, nranks=n, quiet=True,
                                timeout=args.timeout, inject_error=args.inject_error, min_busbw=low, average=0,
                                argv=["--health-check", *argv], **SWEEP))
        if not plist:
            continue
        try:
            per_rank = harness.run_local(_check_rank, plist[0], n, (plist,))
        except Exception as e:  # noqa: BLE001 - one clear line
            print(f"check {backend:6s} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            status = EXIT_FAILED
            continue
        for i, p in enumerate(plist):
            res = [r[i] for r in per_rank]
            wrong = max(r["errors"] for r in res) or sum(r["errors_local"] for r in res)
            bw = res[0]["avg_busbw"]
            low = p.min_busbw is not None and bw < p.min_busbw
            ok = not wrong and not low
            why = "" if ok else (f"  #wrong {wrong}" if wrong else "") + (f"  busbw < {p.min_busbw:g}" if low else "")
            print(f"check {backend:6s} {p.coll:15s} {'OK  ' if ok else 'FAIL'}  avg busbw {bw:8.3f} GB/s  "
                  f"{len(res[0]['rows'])} rows  {n} ranks{why}")
            if not ok:
                status = max(status, EXIT_WRONG)
            docs.append(res[0]["doc"])
    return status, docs
