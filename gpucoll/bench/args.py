"""gpucoll-bench's command line: the nccl-tests flags, gpucoll's own options, their parsing into Params and the
checks that need nothing but the arguments (split from cli.py, which runs what this parses)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from gpucoll._help import HelpFormatter
from gpucoll._native import _C
from gpucoll.bench import colls
from gpucoll.bench.harness import Params
from gpucoll.bench.report import size_label

BACKENDS = ("host", "nccl", "custom", "auto")

_EPILOG = f"""\
sizes:       byte counts with optional K, M, G suffixes: 8, 64K, 1M, 2G
datatypes:   {', '.join(colls.DTYPES)}, or all; comma lists work too
             (bfloat16 needs torch: NumPy has no bfloat16)
ops:         {', '.join(colls.OPS)}, or all
collectives: {', '.join(colls.names())}
             (nccl-tests' spellings work too: allreduce, allgather, reducescatter, alltoall)
algorithms:  --algo a,b runs one block of rows per algorithm; --algo all runs every algorithm that can serve
             the collective at this world size (the others are listed as skipped)
exit status: 0 all results correct, 1 wrong results (#wrong > 0) or average busbw below --min-busbw,
             2 bad usage or setup, 3 the run failed
more:        gpucoll-bench report A.json B.json -o cmp.png   (compare saved --json runs in one plot)
             gpucoll-bench --health-check [options]   (every collective, a short sweep each; see the health check
             options above and gpucoll-bench --health-check --help)
"""

# -c/--check given without a number. nccl-tests' -c takes one, and so does ours wherever it appears: a flag whose
# meaning changed with whether a number follows it (the health check before, a count after) read as one option
# in --help and behaved as two. The health check has its own name, --health-check.
_CHECK_WITHOUT_COUNT = object()
CHECK_TAKES_A_NUMBER = ("-c/--check takes a number N (nccl-tests' verified iterations per row; 0: no check); the "
                        "health check of every collective is gpucoll-bench --health-check")


def check_without_count(argv: list[str]) -> bool:
    """Whether argv has -c/--check with no number after it. Looked for before argparse runs, so that
    `gpucoll-bench --check` (no collective) gets the same one line as `gpucoll-bench all_reduce --check` rather
    than argparse's complaint about the missing collective."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return False
        if arg in ("-c", "--check"):
            try:
                int(argv[i + 1], 0)
            except (IndexError, ValueError):
                return True
    return False


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: its usage block lists every flag and the nine collectives (ten lines)
    and buried the one line that says what was wrong."""

    def error(self, message):
        if message.endswith("required: collective"):
            message += f" (one of {', '.join(colls.names())}; {self.prog} --help lists the options)"
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(HelpFormatter):
    def _format_args(self, action, default_metavar):
        # -c's nargs="?" is only there to catch a missing number (_CHECK_WITHOUT_COUNT): the number is required.
        if action.const is _CHECK_WITHOUT_COUNT:
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


def _size(what: str):
    def parse(text: str) -> int:
        try:
            return int(_C.parse_bytes(text.strip()))
        except Exception:  # noqa: BLE001 - gpucoll's InvalidArgument or anything else: one clear message
            raise argparse.ArgumentTypeError(f"invalid size {text!r} for {what}: expected a byte count such as "
                                             f"8, 64K, 1M or 2G") from None
    return parse


def _int(what: str, minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: expected an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: must be >= {minimum}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: expected a positive number of seconds")
    return value


class _Selection(list):
    """Parsed -d/-o values; `from_all` says whether "all" was asked for (then unavailable ones are skipped)."""

    from_all = False


def _choices(kind: str, valid, aliases=None):
    def parse(text: str) -> list[str]:
        out = _Selection()
        for item in (t.strip().lower() for t in text.split(",")):
            if item == "all":
                out.extend(valid)
                out.from_all = True
                continue
            item = (aliases or {}).get(item, item)
            if item not in valid:
                raise argparse.ArgumentTypeError(f"unknown {kind} {item!r}: expected one of {', '.join(valid)} or all")
            out.append(item)
        unique = _Selection(dict.fromkeys(out))  # dedupe, keep order
        unique.from_all = out.from_all
        return unique
    return parse


def _backends(text: str) -> list[str]:
    """--backend a,b,...: each of BACKENDS at most once, in the order given."""
    out = [b.strip().lower() for b in text.split(",") if b.strip()]
    bad = [b for b in out if b not in BACKENDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown backend {(bad or [text])[0]!r}: expected one of "
                                         f"{', '.join(BACKENDS)}, or a comma list of them")
    return list(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpucoll-bench", description="Benchmark and check gpucoll collectives with nccl-tests' flags and "
                "table.", epilog=_EPILOG, formatter_class=_HelpFormatter)
    d = Params()
    p.add_argument("collective", type=colls.canonical, choices=colls.names(), help="the collective to run")
    p.add_argument("-b", "--minbytes", type=_size("-b/--minbytes"), default=d.minbytes,
                   help=f"min size in bytes (default: {size_label(d.minbytes)})")
    p.add_argument("-e", "--maxbytes", type=_size("-e/--maxbytes"), default=d.maxbytes,
                   help=f"max size in bytes (default: {size_label(d.maxbytes)})")
    p.add_argument("-i", "--stepbytes", type=_size("-i/--stepbytes"), default=d.stepbytes,
                   help=f"increment size, used when -f is 1 (default: {size_label(d.stepbytes)})")
    p.add_argument("-f", "--stepfactor", type=_int("step factor", 1), default=d.stepfactor,
                   help="increment factor (above 1 it wins over -i)")
    p.add_argument("-n", "--iters", type=_int("iteration count", 1), default=d.iters, help="timed iterations")
    p.add_argument("-w", "--warmup_iters", type=_int("warmup iteration count", 0), default=d.warmup_iters,
                   help="warmup iterations")
    p.add_argument("-c", "--check", type=_int("check count", 0), default=d.check, nargs="?",
                   const=_CHECK_WITHOUT_COUNT, metavar="N",
                   help="nccl-tests' -c: verified iterations per row (0: no check, #wrong shows N/A); always a number "
                        "(the health check is --health-check)")
    p.add_argument("-d", "--datatype", type=_choices("datatype", list(colls.DTYPES), colls.ALIASES),
                   default=d.dtypes, help="datatype(s), nccl-tests names, or all")
    p.add_argument("-o", "--op", type=_choices("op", list(colls.OPS)), default=None,
                   help=f"reduction op(s) or all, for the reducing collectives (default: {d.ops[0]})")
    p.add_argument("-r", "--root", type=_int("root", 0), default=None,
                   help=f"root rank of the rooted collectives (default: {d.root})")
    p.add_argument("-a", "--average", type=int, choices=range(4), default=d.average,
                   help="time shown: 0 rank 0's, 1 mean over ranks (as nccl-tests), 2 min, 3 max")
    p.add_argument("-G", "--cudagraph", type=_int("graph launch count", 0), default=d.graph, metavar="N",
                   help="capture the -n calls in a CUDA graph and time N launches of it (CUDA backends)")
    p.add_argument("-z", "--blocking", type=int, choices=(0, 1), default=d.blocking,
                   help="1: synchronize the stream after every call (the host backend always blocks)")
    p.add_argument("--nranks", type=_int("rank count", 1), default=None,
                   help="spawn this many local ranks (default: one rank per process under a launcher, else 1)")
    p.add_argument("--backend", type=_backends, default=["auto"],
                   help="comma list of host, nccl, custom, auto (auto: nccl when a GPU and NCCL are usable, else "
                        "host); each runs as its own block of rows")
    p.add_argument("--algo", default="auto", help="comma-separated algorithms, each run as its own block of rows: "
                   f"auto, all, or {', '.join(_C.algorithm_names())}")
    p.add_argument("-J", "--json", metavar="FILE", default=None, help="also write every row, the run parameters "
                   "and the environment as JSON; - writes it to stdout (the table then goes to stderr)")
    p.add_argument("--csv", metavar="FILE", default=None, help="also write every row as CSV (the environment in "
                   "'# ' comment lines before the header); - writes it to stdout (the table then goes to stderr)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw busbw and time vs size (needs matplotlib)")
    p.add_argument("--min-busbw", type=float, default=None, metavar="GBS",
                   help="exit status 1 when the average busbw (GB/s) is below this")
    p.add_argument("--compare", choices=("gloo", "torch", "nccl", "unchecked", "none"), default=None,
                   help="also time this peer on the same sizes; adds its time and the ratio peer/gpucoll. "
                        "'unchecked' (host and custom backends; for measuring the cross-rank call check only): the same calls "
                        "with the check off, alternating with the check on in the same ranks, medians of 5 each. "
                        "'none' (with --compress): the same calls uncompressed, alternating likewise")
    p.add_argument("--compress", choices=("int8", "fp8", "bf16"), default=None,
                   help="all_reduce only: run all_reduce(x, compress=FMT) (floating datatypes, sum or avg; host "
                        "backend); the check counts elements outside the error bound (docs/compression.md) and the "
                        "table adds the largest error measured")
    p.add_argument("-T", "--timeout", type=_positive_float, default=d.timeout,
                   help="seconds a collective may wait for peers before failing")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # tests: corrupt one element
    h = p.add_argument_group("health check", (
        "  gpucoll-bench --health-check [options], without a collective: a short sweep of every collective on the\n"
        "  backends this machine can run, one OK/FAIL line each (it also takes --nranks, --backend, --min-busbw,\n"
        "  --json, --plot and -T)"))
    h.add_argument("--health-check", action="store_true", help="run the health check (the first argument)")
    h.add_argument("--colls", metavar="LIST", help="comma-separated collectives to check (default: all)")
    h.add_argument("--require-gpu", action="store_true", help="exit status 2 unless a GPU backend is checked")
    h.add_argument("--tuning", metavar="FILE", help="tuning JSON whose min_busbw table sets each line's threshold "
                   "(default: GPUCOLL_TUNING_FILE)")
    return p


def parse_args(argv: list[str] | None = None) -> Params:
    """argv -> Params. Bad usage exits through argparse (status 2) with the reason."""
    parser = build_parser()
    if check_without_count(list(sys.argv[1:] if argv is None else argv)):
        parser.error(CHECK_TAKES_A_NUMBER)
    args = parser.parse_args(argv)
    if args.check is _CHECK_WITHOUT_COUNT:  # an abbreviation (--che) that check_without_count does not know
        parser.error(CHECK_TAKES_A_NUMBER)
    misplaced = [flag for flag, v in (("--health-check", args.health_check), ("--colls", args.colls),
                                      ("--require-gpu", args.require_gpu), ("--tuning", args.tuning)) if v]
    if misplaced:
        parser.error(f"{', '.join(misplaced)} belong to the health check, which runs every collective: "
                     f"gpucoll-bench --health-check [options], without {args.collective}")
    if args.minbytes > args.maxbytes:
        parser.error(f"invalid sizes: -b/--minbytes {args.minbytes} > -e/--maxbytes {args.maxbytes}")
    if args.stepfactor <= 1 and args.stepbytes == 0:
        parser.error("-i/--stepbytes must be above 0 when -f/--stepfactor is 1")
    coll = colls.get(args.collective)
    notes = []
    algos, algo_all = _parse_algos(parser, coll, args.algo, notes)
    if args.json == "-" and args.csv == "-":
        parser.error("--json - and --csv - would both write to stdout: give one of them a file")
    if args.plot == "-":
        parser.error("--plot writes a PNG file: give it a file name")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and path != "-":
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                parser.error(f"{flag} {path!r}: folder {folder!r} does not exist or is not writable")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'gpucoll[bench]' (or matplotlib)")
    dtypes = args.datatype
    dtypes_all = getattr(dtypes, "from_all", False)
    if "bfloat16" in dtypes and importlib.util.find_spec("torch") is None:
        if getattr(dtypes, "from_all", False):
            dtypes = [t for t in dtypes if t != "bfloat16"]
            notes.append("bfloat16 skipped: NumPy has no bfloat16 and torch is not installed")
        else:
            parser.error("-d bfloat16 needs torch (NumPy has no bfloat16); install torch or pick another datatype")
    if args.op is not None and not coll.reduces:
        notes.append(f"{coll.name} does not reduce: -o is ignored")
    if args.root is not None and not coll.rooted:
        notes.append(f"{coll.name} has no root: -r is ignored")
    if args.root is not None and coll.rooted and args.nranks is not None and args.root >= args.nranks:
        parser.error(f"-r/--root {args.root} is not a rank of {args.nranks} (--nranks): expected 0 to {args.nranks - 1}")
    if args.compress is not None:
        if coll.name != "all_reduce":
            parser.error(f"--compress applies to all_reduce; got {coll.name}")
        bad = [t for t in dtypes if t not in ("float", "float32", "half", "float16", "bfloat16")]
        if bad:
            parser.error(f"--compress needs floating data (float, half, bfloat16); got -d {','.join(bad)}")
        if any(op not in ("sum", "avg") for op in (args.op or ["sum"])):
            parser.error(f"--compress reduces with sum or avg; got -o {','.join(args.op)}")
        if algos != ["auto"]:
            parser.error("--compress runs its own two-shot schedule: leave --algo auto")
    if args.compare == "none" and args.compress is None:
        parser.error("--compare none compares compressed calls with uncompressed ones: add --compress FMT")
    d = Params()
    return Params(compress=args.compress, coll=args.collective, minbytes=args.minbytes, maxbytes=args.maxbytes, stepbytes=args.stepbytes,
                  stepfactor=args.stepfactor, iters=args.iters, warmup_iters=args.warmup_iters, check=args.check,
                  dtypes=list(dtypes), ops=list(args.op or d.ops), dtypes_all=dtypes_all,
                  ops_all=getattr(args.op, "from_all", False), root=d.root if args.root is None else args.root,
                  algos=algos, algo_all=algo_all, average=args.average,
                  json=args.json, csv=args.csv, plot=args.plot, min_busbw=args.min_busbw, compare=args.compare,
                  timeout=args.timeout, backend=args.backend[0], backends=list(args.backend), nranks=args.nranks,
                  table_to_stderr="-" in (args.json, args.csv),
                  graph=args.cudagraph, blocking=args.blocking,
                  inject_error=args.inject_error, argv=list(sys.argv[1:] if argv is None else argv), notes=notes)


def _parse_algos(parser, coll, text: str, notes: list) -> tuple[list[str], bool]:
    """--algo a,b,c or all -> (algorithms, whether "all" was asked for). A named algorithm that does not implement
    the collective is a usage error that says why; "all" keeps those that implement it (world-size checks come
    later, in check_world, once the number of ranks is known)."""
    known = list(_C.algorithm_names())
    asked = list(dict.fromkeys(a.strip().lower() for a in text.split(",") if a.strip())) or ["auto"]
    algos, algo_all = [], False
    for a in asked:
        if a == "all":
            algo_all = True
            if coll.coll_id < 0:
                notes.append(f"{coll.name} is point-to-point and has no algorithms: --algo all runs auto")
                algos.append("auto")
                continue
            algos += [k for k in known if _C.algorithm_supports(k, coll.coll_id)]
            skipped = [k for k in known if not _C.algorithm_supports(k, coll.coll_id)]
            if skipped:
                notes.append(f"--algo all: skipped {_and(skipped)}, which {'does' if len(skipped) == 1 else 'do'} "
                             f"not implement {coll.name}")
            continue
        if a != "auto" and a not in known:
            parser.error(f"unknown --algo {a!r}: expected auto, all or one of {', '.join(known)}")
        if a != "auto" and coll.coll_id < 0:
            parser.error(f"--algo {a}: {coll.name} is point-to-point and has no algorithms (use --algo auto)")
        if a != "auto" and not _C.algorithm_supports(a, coll.coll_id):
            why = _C.algorithm_unusable(a, coll.coll_id, 2, 0, 0) or f"{a} does not implement {coll.name}"
            parser.error(f"--algo {a} cannot run {coll.name}: {why}")
        algos.append(a)
    return list(dict.fromkeys(algos)), algo_all


def _and(names: list[str]) -> str:
    """["a"] -> "a", ["a", "b", "c"] -> "a, b and c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
