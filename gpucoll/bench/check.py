"""gpucoll-bench --check: a quick health check of a machine (a CI runner, a new box).

A short sweep (-b 1K -e 64K -f 4 -n 5 -w 1 -c 1) of every collective on every backend available here
(available_backends(): host always; the GPU backends when gpucoll can run them on this machine's GPUs), all
collectives in one set of --nranks spawned ranks (default 2). One summary line per (backend, collective).
Exit status: 0 all OK, 1 any #wrong > 0 or an average busbw below --min-busbw, 2 bad usage, 3 a run failed.
--json writes the list of the runs' JSON documents; --plot one plot with a line per collective.
"""

from __future__ import annotations

import argparse
import sys

from gpucoll.bench import colls
from gpucoll.bench.harness import Params

SWEEP = dict(minbytes=1 << 10, maxbytes=64 << 10, stepfactor=4, iters=5, warmup_iters=1, check=1)


def available_backends() -> list[str]:
    """The backends gpucoll-bench can run on this machine (cli.resolve_backend accepts them)."""
    from gpucoll.bench.cli import UsageError, resolve_backend

    out = ["host"]
    for b in ("nccl", "custom"):
        try:
            if resolve_backend(b) == b:
                out.append(b)
        except UsageError:
            pass
    return out


def _check_rank(comm, plist: list) -> list[dict]:
    from gpucoll.bench import harness

    return [harness.run_rank(comm, p) for p in plist]


def check_main(argv: list[str]) -> int:
    import gpucoll
    from gpucoll.bench import report
    from gpucoll.bench.cli import EXIT_FAILED, EXIT_OK, EXIT_WRONG

    ap = argparse.ArgumentParser(prog="gpucoll-bench --check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--min-busbw", type=float, default=None, metavar="GBS")
    ap.add_argument("--json", "-J", default=None, metavar="FILE")
    ap.add_argument("--plot", default=None, metavar="FILE.png")
    ap.add_argument("--colls", default=",".join(colls.names()), help="comma-separated collectives (default all)")
    ap.add_argument("-T", "--timeout", type=float, default=120.0)
    ap.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
        names = [colls.canonical(c.strip()) for c in args.colls.split(",") if c.strip()]
        bad = [c for c in names if c not in colls.names()]
        if bad or args.nranks < 1:
            ap.error(f"unknown collective(s) {', '.join(bad)}" if bad else "--nranks must be >= 1")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    status, docs = EXIT_OK, []
    for backend in available_backends():
        plist = []
        for name in names:
            if args.nranks < colls.get(name).min_ranks:
                print(f"check {backend:6s} {name:15s} SKIP  needs {colls.get(name).min_ranks} ranks")
                continue
            plist.append(Params(coll=name, backend=backend, nranks=args.nranks, quiet=True, timeout=args.timeout,
                                inject_error=args.inject_error, min_busbw=args.min_busbw, launch="spawn",
                                argv=["--check", *argv], **SWEEP))
        try:
            per_rank = gpucoll.spawn(_check_rank, args.nranks, args=(plist,), backend=backend, timeout=args.timeout)
        except Exception as e:  # noqa: BLE001 - one clear line
            print(f"check {backend:6s} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            status = EXIT_FAILED
            continue
        for i, p in enumerate(plist):
            res = [r[i] for r in per_rank]
            wrong = max(r["errors"] for r in res) or sum(r["errors_local"] for r in res)
            bw = res[0]["avg_busbw"]
            low = args.min_busbw is not None and bw < args.min_busbw
            ok = not wrong and not low
            why = "" if ok else (f"  #wrong {wrong}" if wrong else "") + (f"  busbw < {args.min_busbw:g}" if low else "")
            print(f"check {backend:6s} {p.coll:15s} {'OK  ' if ok else 'FAIL'}  avg busbw {bw:8.3f} GB/s  "
                  f"{len(res[0]['rows'])} rows{why}")
            if not ok:
                status = max(status, EXIT_WRONG)
            docs.append(res[0]["doc"])
    if args.json:
        import json
        import os

        with open(args.json + ".tmp", "w") as f:
            json.dump(docs, f, indent=2)
        os.replace(args.json + ".tmp", args.json)
    if args.plot and docs:
        from gpucoll.bench.plot import plot_docs

        plot_docs([(d["config"]["collective"], d) for d in docs], args.plot, title="gpucoll-bench --check")
    print(f"check: {'OK' if status == EXIT_OK else 'FAILED'} ({len(docs)} runs)")
    _ = report
    return status
