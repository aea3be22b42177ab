"""See the algorithms: ``python -m gpucoll.algo explain all_reduce --nranks 8 --bytes 1M [--steps]``.

For every registered algorithm that implements the collective it prints the steps, the bytes the busiest rank
sends and receives (from the schedule checker, the same counts the cost model uses), the model's predicted
time on the host backend, and which one ``algo="auto"`` picks. ``--steps`` prints the schedule itself: at
every step, which rank reads (receives) which chunk from whom, and whether it copies or reduces it.
"""

from __future__ import annotations

import argparse
import sys

from gpucoll.errors import GpucollError

COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
BLOCKED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def explain(coll: str, nranks: int, nbytes: int, *, local_size: int = 0, root: int = 0, steps: bool = False,
            out=sys.stdout) -> dict:
    """Print (and return as a dict) the comparison of every algorithm for one call."""
    from gpucoll import _C

    if coll not in COLLS:
        raise GpucollError(f"collective must be one of {', '.join(COLLS)}; got {coll!r}")
    cid = COLLS.index(coll)
    cp = _C.cost_params()
    print(f"# {coll}: {nranks} ranks, {_human(nbytes)}"
          + (f", local_size {local_size}" if local_size else "")
          + (f", root {root}" if coll in ("broadcast", "reduce", "gather", "scatter") else ""), file=out)
    print(f"# host cost model: a = {cp['a'] * 1e6:.1f} us per step, b = {cp['b'] * 1e9:.3f} ns per byte, "
          f"{cp['cores']} cores (terms scale by ranks/cores when ranks outnumber cores)", file=out)
    try:
        chosen = _C.select_algorithm(cid, nranks, nbytes, local_size, "auto")
    except GpucollError as exc:
        chosen = None
        print(f"# auto: {exc}", file=out)
    header = f"{'algorithm':>18} {'steps':>6} {'sent/rank':>12} {'recv/rank':>12} {'predicted':>12}  note"
    print(header, file=out)
    rows = {}
    for name in _C.algorithm_names():
        pred = _C.predict(name, cid, nranks, nbytes, local_size)
        if not pred["usable"]:
            if _C.algorithm_supports(name, cid):
                print(f"{name:>18} {'-':>6} {'-':>12} {'-':>12} {'-':>12}  cannot run: {pred['reason']}", file=out)
            rows[name] = {"usable": False, "reason": pred["reason"]}
            continue
        note = "<- auto" if name == chosen else ""
        print(f"{name:>18} {pred['steps']:>6} {_human(pred['bytes_sent']):>12} {_human(pred['bytes_recv']):>12} "
              f"{pred['seconds'] * 1e6:>9.1f} us  {note}", file=out)
        rows[name] = dict(pred)
    if steps:
        for name, row in rows.items():
            if row.get("usable"):
                _print_steps(name, cid, nranks, root, local_size, out)
    return {"collective": coll, "nranks": nranks, "bytes": nbytes, "auto": chosen, "algorithms": rows}


def _print_steps(name: str, cid: int, nranks: int, root: int, local_size: int, out) -> None:
    from gpucoll import _C

    per_rank = [_C.schedule_ops(name, cid, nranks, root, local_size, r) for r in range(nranks)]
    nsteps = len(per_rank[0]["steps"])
    print(f"\n## {name}: {nsteps} steps, buffer in {per_rank[0]['nchunks']} chunks, result in "
          f"{per_rank[0]['result']}", file=out)
    for t in range(nsteps):
        moves = []
        for r in range(nranks):
            for peer, src, dst, action, space in per_rank[r]["steps"][t]:
                arrow = "+=" if action == "reduce" else "<-"
                where = "" if space == "work" else " (out)"
                if peer == r:
                    moves.append(f"r{r}: [{dst}]{where} {arrow} own[{src}]")
                else:
                    moves.append(f"r{peer}->r{r}: chunk {src}{' reduce' if action == 'reduce' else ''}{where}")
        print(f"  step {t}: " + "; ".join(moves), file=out)


def main(argv=None) -> int:
    from gpucoll import _C

    parser = argparse.ArgumentParser(prog="python -m gpucoll.algo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="compare the algorithms for one collective call")
    p.add_argument("collective", choices=COLLS)
    p.add_argument("--nranks", type=int, default=8)
    p.add_argument("--bytes", default="1M", help="message size: for blocked collectives the whole buffer (P*n)")
    p.add_argument("--local-size", type=int, default=0, help="ranks per node, for hierarchical")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--steps", action="store_true", help="print every algorithm's step-by-step schedule")
    args = parser.parse_args(argv)
    try:
        nbytes = _C.parse_bytes(args.bytes)
        if args.nranks < 1:
            parser.error("--nranks must be >= 1")
        if not 0 <= args.root < args.nranks:
            parser.error(f"--root must be in [0, {args.nranks}), got {args.root}")
        if args.local_size < 0:
            parser.error(f"--local-size must be >= 0 (0: one node), got {args.local_size}")
        explain(args.collective, args.nranks, nbytes, local_size=args.local_size, root=args.root, steps=args.steps)
    except GpucollError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
