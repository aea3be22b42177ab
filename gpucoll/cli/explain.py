"""See the algorithms: ``python -m gpucoll explain all_reduce --nranks 8 --bytes 1M [--steps]``.

For every registered algorithm that implements the collective it prints the steps, the bytes the busiest rank
sends and receives (from the schedule checker, the same counts the cost model uses), the model's predicted
time on the host backend, and which one ``algo="auto"`` picks. ``--steps`` prints the schedule itself: at
every step, which rank reads (receives) which chunk from whom, and whether it copies or reduces it.

With GPUCOLL_TUNING_FILE set, an algorithm that the file fits on the host backend (``host:<algorithm>@SHM``, written
by gpucoll-tune from gpucoll-bench runs) is priced by that fit, as gpucoll's topology-aware model prices the host
backend; its row says "tuned".
"""

from __future__ import annotations

import argparse
import json
import sys

from gpucoll import _C, config, topology
from gpucoll._help import HelpFormatter, reader_may_leave
from gpucoll.bench.colls import canonical, names
from gpucoll.errors import GpucollError, InvalidArgument

COLLS = tuple(_C.coll_names())  # the core's collectives, in the order of their ids
BLOCKED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")

COLUMNS = ("# steps: synchronised steps of the schedule per piece; sent/rank, recv/rank: bytes the busiest rank sends "
           "and receives for the whole call; predicted: time per call")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fit_at(fit: dict, nbytes: int) -> tuple[float, float]:
    """A fit's (a_s, b_s_per_byte) for a call of nbytes: its "pieces" by size where it has them (cost.h Fit::at)."""
    a, b = fit["a_s"], fit["b_s_per_byte"]
    for piece in fit.get("pieces", []):
        if nbytes >= piece["from_bytes"]:
            a, b = piece["a_s"], piece["b_s_per_byte"]
    return a, b


def tuning_fits() -> tuple[str, dict]:
    """(path, fits) of GPUCOLL_TUNING_FILE, ("", {}) when unset. A file that cannot be read or parsed raises
    InvalidArgument naming it (the C++ core's parser checks it, as the selector would)."""
    path = config.get("GPUCOLL_TUNING_FILE").strip()
    if not path:
        return "", {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgument(f"GPUCOLL_TUNING_FILE={path}: cannot read it: {e}") from None
    try:
        _C.topo_check_tuning(text)
    except GpucollError as e:
        raise InvalidArgument(f"GPUCOLL_TUNING_FILE={path}: {e}") from None
    return path, json.loads(text).get("fits", {})


def explain(coll: str, nranks: int, nbytes: int, *, local_size: int = 0, root: int = 0, steps: bool = False,
            out=None, topo=None) -> dict:
    """Print (and return as a dict) the comparison of every algorithm for one call (to stdout by default). With
    `topo` (a gpucoll topology), NCCL's pick on it is priced too, with the NCCL model's interval."""
    out = sys.stdout if out is None else out
    name = canonical(coll)
    if name not in COLLS and name in names():
        # gpucoll-bench's names are explain's too; the point-to-point ones have nothing to compare.
        print(f"# {name}: point-to-point (each rank sends to one peer and receives from another, as gpucoll-bench "
              f"runs it): no algorithm to choose, so nothing to compare. explain compares the algorithms of "
              f"{', '.join(COLLS)}.", file=out)
        return {"collective": name, "nranks": nranks, "bytes": nbytes, "auto": None, "algorithms": {},
                "tuning_file": ""}
    if name not in COLLS:
        raise InvalidArgument(f"collective must be one of {', '.join(names())}; got {coll!r}")
    coll = name
    if coll in BLOCKED and nbytes % nranks:
        lower = nbytes - nbytes % nranks
        raise InvalidArgument(f"{coll} splits its {nbytes}-byte buffer into {nranks} equal blocks, one per rank: "
                              f"{nbytes} is not a multiple of {nranks} (try {lower or nranks} or {lower + nranks})")
    cid = COLLS.index(coll)
    cp = _C.cost_params()
    path, fits = tuning_fits()
    print(f"# {coll}: {nranks} ranks, {_human(nbytes)}"
          + (f", local_size {local_size}" if local_size else "")
          + (f", root {root}" if coll in ("broadcast", "reduce", "gather", "scatter") else ""), file=out)
    print(f"# host cost model: a = {cp['a'] * 1e6:.1f} us per step, b = {cp['b'] * 1e9:.3f} ns per byte, "
          f"{cp['cores']} cores (terms scale by ranks/cores when ranks outnumber cores)", file=out)
    if path:
        print(f"# GPUCOLL_TUNING_FILE={path}: rows marked tuned are priced by its host:<algorithm>@SHM fit (steps x a "
              f"+ bytes x b); auto on the host backend picks by the model above", file=out)
    print(COLUMNS, file=out)
    try:
        chosen = _C.select_algorithm(cid, nranks, nbytes, local_size, "auto")
    except GpucollError as exc:
        chosen = None
        print(f"# auto: {exc}", file=out)
    print(f"{'algorithm':>18} {'steps':>6} {'sent/rank':>12} {'recv/rank':>12} {'predicted':>12}  note", file=out)
    rows = {}
    for algo in _C.algorithm_names():
        pred = _C.predict(algo, cid, nranks, nbytes, local_size)
        if not pred["usable"]:
            rows[algo] = {"usable": False, "reason": pred["reason"]}
            continue
        row = dict(pred, model="default")
        fit = fits.get(f"host:{algo}@SHM")
        terms = _C.topo_model_terms("custom", algo, coll, nranks, local_size or nranks) if fit else None
        if terms is not None:
            a, b = fit_at(fit, nbytes)
            row["seconds"] = terms[0] * a + terms[1] * nbytes * b
            row["model"] = "tuned"
            if fit.get("poor"):  # kept by gpucoll-tune --keep-poor-fits
                row["model"] = f"tuned (poor fit: {_quality(fit)})"
        rows[algo] = row
    usable = {a: r for a, r in rows.items() if r.get("usable")}
    cheapest = min(usable, key=lambda a: usable[a]["seconds"]) if usable else None
    # With a tuning file the cheapest row need not be auto's pick: say so on that row and why, not only in the
    # header (a reader compares the numbers and takes auto for broken).
    tuned_apart = path and chosen in usable and cheapest != chosen and "tuned" in (
        usable[cheapest]["model"] + usable[chosen]["model"])
    for algo, row in rows.items():
        if not row.get("usable"):
            if _C.algorithm_supports(algo, cid):
                print(f"{algo:>18} {'-':>6} {'-':>12} {'-':>12} {'-':>12}  cannot run: {row['reason']}", file=out)
            continue
        notes = [row["model"] if row["model"] != "default" else "", "<- auto" if algo == chosen else "",
                 "cheapest with the tuning file, not auto's pick (see below)" if tuned_apart and algo == cheapest
                 else ""]
        print(f"{algo:>18} {row['steps']:>6} {_human(row['bytes_sent']):>12} {_human(row['bytes_recv']):>12} "
              f"{row['seconds'] * 1e6:>9.1f} us  {'; '.join(n for n in notes if n)}".rstrip(), file=out)
    if tuned_apart:
        print(f"# {cheapest} is cheapest by the tuning file's fits, yet auto picks {chosen}: auto on the host backend "
              f"prices the algorithms by the host cost model in the header, never by GPUCOLL_TUNING_FILE (the "
              f"file's fits price the choice between backends, as gpucoll-topo shows). To run {cheapest} on the "
              f"host backend, pass algo=\"{cheapest}\".", file=out)
    nccl = _nccl_on(topo, coll, nranks, nbytes, local_size, out) if topo is not None else None
    if steps:
        for algo, row in rows.items():
            if row.get("usable"):
                _print_steps(algo, cid, nranks, root, local_size, out)
    return {"collective": coll, "nranks": nranks, "bytes": nbytes, "auto": chosen, "algorithms": rows,
            "tuning_file": path, "nccl": nccl}


def _nccl_on(topo, coll: str, nranks: int, nbytes: int, local_size: int, out) -> dict | None:
    """NCCL's own pick for the call on the topology (gpucoll's NCCL model), with its interval: how far the model
    missed on published machines it had not seen, widened where this one lies beyond them."""
    local = local_size or nranks
    nodes = max(1, nranks // local)
    if nodes > 1 and topo.num_hosts == 1:  # one host's wiring stands for every node, as in gpucoll-topo --nodes
        topo = topology.replicate(topo, nodes)
    cands = topology.candidates(topo, coll, nbytes, "float32", local, nodes, custom=False, host=False)
    pick = next((c for c in cands if c["nccl_auto"]), None)
    if pick is None:
        print(f"# NCCL on this topology: no candidate ({'; '.join(c['reason'] for c in cands if c['reason'])})",
              file=out)
        return None
    rng = (f" (interval {pick['seconds_low'] * 1e6:.1f}-{pick['seconds_high'] * 1e6:.1f} us: {pick['interval']})"
           if "seconds_high" in pick else "")
    print(f"# NCCL on this topology ({nodes} node(s) x {local}): {pick['algorithm']}/{pick['protocol']} "
          f"{pick['seconds'] * 1e6:.1f} us, busbw {pick['busbw'] / 1e9:.1f} GB/s{rng}", file=out)
    return pick


def _quality(fit: dict) -> str:
    """A fit's R^2 and worst relative error as gpucoll-tune prints them ("R^2 0.39, max err 88%")."""
    parts = []
    if "r2" in fit:
        parts.append(f"R^2 {fit['r2']:.2f}")
    if "max_rel_error" in fit:
        parts.append(f"max err {fit['max_rel_error'] * 100:.0f}%")
    return ", ".join(parts) or "no quality recorded"


def _print_steps(name: str, cid: int, nranks: int, root: int, local_size: int, out) -> None:
    per_rank = [_C.schedule_ops(name, cid, nranks, root, local_size, r) for r in range(nranks)]
    nsteps = len(per_rank[0]["steps"])
    print(f"\n## {name}: {_plural(nsteps, 'step')}, buffer in {_plural(per_rank[0]['nchunks'], 'chunk')}, result in "
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


def _collective(text: str) -> str:
    name = canonical(text)
    if name not in names():
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(names())})")
    return name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpucoll.algo", formatter_class=HelpFormatter,
                                     description="See the algorithms: python -m gpucoll.algo explain all_reduce "
                                                 "--nranks 8 --bytes 1M [--steps]")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="compare the algorithms for one collective call",
                       description="Compare every algorithm for one collective call: " + COLUMNS[2:] + ".",
                       formatter_class=HelpFormatter)
    p.add_argument("collective", type=_collective, help=f"{', '.join(names())}, also spelled as gpucoll-bench and "
                   f"nccl-tests take them (allreduce, all-gather, all_reduce_perf); the point-to-point ones (sendrecv) "
                   f"have no algorithm to choose")
    p.add_argument("--nranks", type=int, default=8, help="number of ranks")
    p.add_argument("--bytes", default="1M", help="message size (K, M, G suffixes: powers of 1024); for all_gather, "
                                                 "reduce_scatter, all_to_all, gather and scatter the whole buffer: "
                                                 "nranks blocks")
    p.add_argument("--local-size", type=int, default=0, help="ranks per node, for hierarchical (0: one node)")
    p.add_argument("--root", type=int, default=0, help="root rank of broadcast, reduce, gather and scatter")
    p.add_argument("--steps", action="store_true", help="print every algorithm's step-by-step schedule")
    p.add_argument("--topology", metavar="FILE", help="also price NCCL's pick on this wiring (nvidia-smi topo -m "
                   "text, NCCL_TOPO_DUMP_FILE XML or gpucoll JSON), with the NCCL model's interval")
    p.add_argument("--gpu", metavar="MODEL", help="with --topology: the GPU model, as gpucoll-topo --gpu takes it")
    return parser


@reader_may_leave
def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        nbytes = _C.parse_bytes(args.bytes)
        if args.nranks < 1:
            parser.error("--nranks must be >= 1")
        if not 0 <= args.root < args.nranks:
            parser.error(f"--root must be in [0, {args.nranks}), got {args.root}")
        if args.local_size < 0:
            parser.error(f"--local-size must be >= 0 (0: one node), got {args.local_size}")
        topo = None
        if args.topology:
            try:
                topo = topology.load(args.topology)
            except OSError as exc:  # only here: a closed stdout raises OSError too, and reader_may_leave ends it
                parser.error(f"--topology: {exc}")
            if args.gpu:
                topo.set_gpu_model(args.gpu)
        explain(args.collective, args.nranks, nbytes, local_size=args.local_size, root=args.root, steps=args.steps,
                topo=topo)
        sys.stdout.flush()
    except GpucollError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def explain_main(argv=None) -> int:
    """``python -m gpucoll explain ...``: the explain subcommand under the package's own command line."""
    return main(["explain", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
