"""gpucoll-bench: nccl-tests' command line and table for gpucoll's collectives.

    gpucoll-bench all_reduce --nranks 4 -b 8 -e 64M -f 2
    gpucoll-bench all_gather --nranks 4 --algo all
    torchrun --nproc-per-node 4 -m gpucoll.bench all_reduce -b 8 -e 64M -f 2
    mpiexec -n 4 gpucoll-bench all_reduce -d all -o all

Without --nranks and under a launcher (torchrun, mpirun/mpiexec, srun) every process is one rank and rank 0
prints; otherwise --nranks local ranks are spawned (default 1, run in this process).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import traceback

from gpucoll import config
from gpucoll import errors as gpucoll_errors
from gpucoll._help import reader_may_leave
from gpucoll._native import _C
from gpucoll.backends import nccl
from gpucoll.bench import colls, devmem, harness, launch, peers, report, virtual
from gpucoll.bench.args import parse_args
from gpucoll.bench.check import check_main
from gpucoll.bench.harness import Params, sizes
from gpucoll.bench.plot import plot_docs, report_main
from gpucoll.bench.usage import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_WRONG,
    UsageError,
    launcher,
    resolve_backend,
)
from gpucoll.bootstrap import detect_launch
from gpucoll.errors import Unsupported


def check_backend(p: Params, nranks: int, requested: str) -> None:
    """What depends on the resolved backend and the number of ranks: -G and -z, algorithms (NCCL picks its
    own), ranks per GPU. Raises UsageError; adds notes."""
    where = f"--backend {requested}" + (f" (resolved to {p.backend})" if requested != p.backend else "")
    if p.backend == "host":
        if p.graph:
            raise UsageError(f"-G/--cudagraph captures CUDA graphs and {where} runs on the CPU: drop -G, or use "
                             f"--backend nccl on a machine with a GPU")
        if p.blocking:
            p.notes.append("-z 1: the host backend's collectives return when done: every call blocks already")
        return
    if p.graph and p.blocking:
        raise UsageError("-z 1 synchronizes after every call, which a CUDA graph capture cannot do: use -G or -z")
    if devmem.cuda_lib() == "cupy":
        p.dtypes = _runnable(p.dtypes, p.dtypes_all, "-d", where, p.notes, lambda t: (
            "CuPy has no bfloat16 and torch cannot use the GPU here, so CUDA buffers come from CuPy"
            if t == "bfloat16" else None))
    if p.backend == "custom":
        if p.graph:
            raise UsageError("-G/--cudagraph: capturing virtual ranks (--backend custom) is not supported yet; "
                             "use -G with --backend nccl")
        # Rows the kernels refuse would fail every virtual rank's run: refuse them now, or skip them for "all".
        p.dtypes = _runnable(p.dtypes, p.dtypes_all, "-d", where, p.notes,
                             lambda t: virtual.kernel_problem(colls.DTYPES[t].gpucoll, None))
        if colls.get(p.coll).reduces:
            p.ops = _runnable(p.ops, p.ops_all, "-o", where, p.notes, lambda o: virtual.kernel_problem("float32", o))
        kernels: dict = {}  # kernel -> the first algorithm name that runs it (--algo all lists dbt and tree)

        def algo_why(a: str) -> str | None:
            why = virtual.algo_problem(a)
            if why is None and p.algo_all and a != "auto":
                kernel = _C.custom_algo_name(a)
                if kernels.setdefault(kernel, a) != a:
                    why = f"it runs the {kernel} kernel, as {kernels[kernel]} does"
            return why

        p.algos = _runnable(p.algos, p.algo_all, "--algo", where, p.notes, algo_why)
        return
    if any(a != "auto" for a in p.algos):
        p.notes.append(f"--backend nccl: NCCL picks its own algorithm, so --algo {','.join(p.algos)} runs as auto")
        p.algos = ["auto"]
    if nranks > 1 and launcher() is None:
        try:
            _, env = nccl.spawn_plan(nranks, "nccl")
        except Unsupported as e:
            raise UsageError(str(e)) from None
        if env:
            p.notes.append(f"--nranks {nranks}: ranks share GPUs through NCCL's multi-rank mode ({', '.join(env)}=1)")


def _runnable(values: list[str], from_all: bool, flag: str, where: str, notes: list, problem) -> list[str]:
    """The values of `flag` that `problem(value)` (a reason or None) lets run. A refused value is a UsageError
    when asked for by name, or when nothing is left; from "all" it is skipped with a note."""
    kept = [v for v in values if problem(v) is None]
    refused = [v for v in values if v not in kept]
    if refused and (not from_all or not kept):
        raise UsageError(f"{flag} {refused[0]} cannot run on {where}: {problem(refused[0])}"
                         + (f"; pick from {', '.join(kept)}" if kept else ""))
    if refused:
        notes.append(f"{flag} all on {where}: skipped {', '.join(refused)} ({problem(refused[0])})")
    return kept


def check_world(p: Params, nranks: int) -> None:
    """What can only be checked once the number of ranks is known: the root, the collective's minimum, and each
    algorithm at this world size (gpucoll._C.algorithm_unusable). Raises UsageError saying why; algorithms that
    came from --algo all are dropped with a note instead."""
    coll = colls.get(p.coll)
    if nranks < coll.min_ranks:
        raise UsageError(f"{coll.name} needs at least {coll.min_ranks} ranks (each rank sends to rank+1 and receives "
                         f"from rank-1, another rank); got {nranks}: use --nranks {coll.min_ranks} or more")
    if coll.rooted and p.root >= nranks:
        raise UsageError(f"-r/--root {p.root} is not a rank of this {nranks}-rank run: expected 0 to {nranks - 1}")
    _note_rounded_sizes(p, coll, nranks)
    if coll.coll_id < 0:
        return
    local_size = config.get_int("GPUCOLL_LOCAL_SIZE")
    root = p.root if coll.rooted else 0
    kept = []
    for a in p.algos:
        why = None if a == "auto" else _C.algorithm_unusable(a, coll.coll_id, nranks, root, local_size)
        if why is None:
            kept.append(a)
        elif p.algo_all:
            p.notes.append(f"--algo all: skipped {a} at {nranks} ranks: {why}")
        else:
            raise UsageError(f"--algo {a} cannot run {coll.name} at {nranks} ranks: {why}")
    if not kept:
        raise UsageError(f"no algorithm can run {coll.name} at {nranks} ranks")
    p.algos = kept


def _note_rounded_sizes(p: Params, coll, nranks: int) -> None:
    """A size the collective cannot move exactly (7 bytes of float; a buffer that does not split into nranks
    16-byte-aligned blocks, nccl-tests' rule) runs rounded down, as nccl-tests does: say so instead of silently
    printing another size than the one asked for."""
    rounded = []
    for size in sizes(p):
        for name in p.dtypes:
            dt = colls.DTYPES[name]
            counts = coll.counts(size // dt.itemsize, nranks, dt.itemsize)
            ran = max(counts.send, counts.recv) * dt.itemsize
            if ran != size:
                rounded.append(f"{size} -> {ran} ({dt.name})")
    if rounded:
        unit = ("whole elements, in nranks blocks of whole 16-byte units" if coll.name in (
            "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter") else "whole elements")
        more = f" and {len(rounded) - 4} more" if len(rounded) > 4 else ""
        p.notes.append(f"sizes rounded down to {unit}, as nccl-tests does (bytes asked -> run): "
                       f"{', '.join(rounded[:4])}{more}")


def _fit_memory(p: Params, local_ranks: int) -> None:
    """nccl-tests' "Reducing maxBytes due to memory limitation": each local rank holds two buffers of maxbytes,
    the backend's staging and the check's temporaries; keep them within the available memory. On a GPU backend
    each rank also holds two device twins of maxbytes on its GPU (ranks beyond the GPUs share one; virtual ranks
    all sit on GPU 0): keep them within the smallest GPU, a tenth of it left to NCCL, the kernels' staging and
    the CUDA context (a margin, not a measurement)."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    limit = max(0, avail - (1 << 30)) // (3 * max(1, local_ranks))
    if p.backend in ("nccl", "custom"):
        mems = [int(d.get("total_memory") or 0) for d in (_C.cuda_probe().get("devices") or [])]
        if mems and min(mems) > 0:
            per_gpu = local_ranks if p.backend == "custom" else -(-max(1, local_ranks) // len(mems))
            limit = min(limit, int(min(mems) * 0.9) // (2 * max(1, per_gpu)))
    if p.maxbytes > limit:
        p.maxbytes = max(limit, 0)
        p.minbytes = min(p.minbytes, p.maxbytes)
        p.notes.append(f"Reducing maxBytes to {p.maxbytes} due to memory limitation")


def exit_status(results, min_busbw: float | None = None) -> int:
    """1 when any rank counted a wrong element, either in the cross-rank sum or in its own local count, or when
    rank 0's average busbw (the one printed) is below min_busbw (a message on stderr says so)."""
    for r in results:
        if r and (r.get("errors") or r.get("errors_local") or r.get("wrong_local")):
            return EXIT_WRONG
    if min_busbw is not None and results and results[0] and results[0].get("avg_busbw", 0.0) < min_busbw:
        print(f"gpucoll-bench: FAILED: average busbw {results[0]['avg_busbw']:g} GB/s is below --min-busbw "
              f"{min_busbw:g}", file=sys.stderr)
        return EXIT_WRONG
    return EXIT_OK


def want_progress(p: Params, stream=None) -> bool:
    """A tqdm bar on stderr only when stderr is a terminal, tqdm is installed and the sweep has more than a few
    rows (PROGRESS_MIN_ROWS)."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty or importlib.util.find_spec("tqdm") is None:
        return False
    coll = colls.get(p.coll)
    rows = len(p.algos) * len(p.dtypes) * len(p.ops if coll.reduces else ["sum"]) * len(sizes(p))
    return rows > PROGRESS_MIN_ROWS


PROGRESS_MIN_ROWS = 4


def _peer(p: Params, n: int) -> None:
    """--compare: measure the peer now (same sizes and ranks) into p.peer_times; UsageError when it cannot run."""
    if not p.compare:
        return
    if p.compare == "unchecked":
        if p.backend not in ("host", "custom"):
            raise UsageError("--compare unchecked measures the cross-rank call check of the host backend and of "
                             "the custom kernels; use --backend host or --backend custom")
        p.notes.append("--compare unchecked: the peer column is the same call with the cross-rank call check off "
                       "(a benchmark-only switch; never off in normal use), timed alternately with it on in the "
                       "same ranks: medians of 5 out-of-place timings each; ratio = unchecked / checked")
        return
    peer, note = peers.resolve(p.compare, p.backend)
    why = peers.unavailable(peer, p.coll, p.backend, n)
    if why:
        raise UsageError(why)
    if note:
        p.notes.append(note)
    p.compare = peer
    p.peer_times = peers.measure(peer, p, n)


def _run(p: Params, requested: str) -> list:
    """One backend's run; the results of the ranks in this process (all of them unless under a launcher)."""
    which = launcher()
    if p.nranks is None and which is not None:
        if p.backend == "custom":
            raise UsageError("--backend custom runs P virtual ranks in one process: use --nranks P instead of a "
                             "launcher")
        info = detect_launch()
        check_world(p, info.world_size)
        check_backend(p, info.world_size, requested)
        if p.compare:
            raise UsageError("--compare spawns the peer's ranks itself: use --nranks N instead of a launcher")
        p.launch = which
        if p.backend == "nccl":
            launch.share_gpus(p, info.local_world_size or 1)
        _fit_memory(p, info.local_world_size or 1)
        comm = launch.launcher_comm(p, info)
        try:
            return [harness.run_rank(comm, p)]
        finally:
            comm.close()
    n = p.nranks or 1
    check_world(p, n)
    check_backend(p, n, requested)
    _peer(p, n)
    p.progress = want_progress(p)
    if which is not None:
        p.notes.append(f"--nranks {n} given: {which} launcher variables ignored, running local ranks")
    _fit_memory(p, n)
    return harness.run_local(harness.run_rank, p, n, (p,))


def write_outputs(p: Params, docs: list) -> None:
    """--json, --csv and --plot from rank 0's documents: one per backend, merged into one for a sweep."""
    doc = docs[0] if len(docs) == 1 else report.merge_docs(docs)
    if p.json:
        report.write_json(p.json, doc)
    if p.csv:
        report.write_csv(p.csv, doc)
    if p.plot:
        plot_docs([("", doc)], p.plot)


def _failed(e: BaseException) -> int:
    """One clear line (and details) for a failed run; its exit status."""
    if isinstance(e, UsageError):
        print(f"gpucoll-bench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, KeyboardInterrupt):
        print("gpucoll-bench: interrupted", file=sys.stderr)
        return 130
    if isinstance(e, BrokenPipeError):
        raise e  # rank 0 writes the table: its reader left (`| head`), which main's wrapper ends quietly
    sys.stdout.flush()
    print(f"gpucoll-bench: error: the run failed: {type(e).__name__}: {e}", file=sys.stderr)
    rank = getattr(e, "rank", None)
    if rank is not None:
        print(f"gpucoll-bench: (raised on rank {rank})", file=sys.stderr)
    for note in getattr(e, "__notes__", ()):
        print(note, file=sys.stderr)
    if not isinstance(e, gpucoll_errors.GpucollError) and rank is None:
        traceback.print_exception(e)  # not a collective's error: a bug, show where
    return EXIT_FAILED


def plan_backends(p: Params) -> list[tuple[str, Params]]:
    """(asked, Params) per --backend entry, each resolved (auto: what it resolved to); UsageError for one that
    cannot run here, before anything runs."""
    out = []
    for asked in p.backends:
        q = copy.deepcopy(p)
        q.backend = resolve_backend(asked, p.coll)
        q.backend_label = f"auto({q.backend})" if asked == "auto" else q.backend
        if q.compare and (q.nranks is not None or launcher() is None):
            # A peer that does not fit a later backend of the sweep (--compare gloo with host,nccl) is refused
            # now, not after the earlier backends ran.
            why = peers.unavailable(peers.resolve(q.compare, q.backend)[0], q.coll, q.backend, q.nranks or 1)
            if why:
                raise UsageError(why)
        out.append((asked, q))
    return out


@reader_may_leave
def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["report"]:
        return report_main(args[1:])
    # The health check: `gpucoll-bench --health-check` (or the words `health-check` and `check`). -c/--check is
    # nccl-tests' count of verified iterations wherever it appears, and always takes its number (args.py).
    if args[:1] in (["--health-check"], ["health-check"], ["check"]):
        return check_main(args[1:])
    try:
        p = parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        if not sizes(p):
            raise UsageError("no sizes to run")
        plan = plan_backends(p)
    except UsageError as e:
        return _failed(e)
    status, docs = EXIT_OK, []
    try:
        for asked, q in plan:
            try:
                results = _run(q, asked)
            except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any failure of the run: one clear line
                return _failed(e)
            status = max(status, exit_status(results, q.min_busbw))
            if results and results[0] and results[0].get("doc"):
                docs.append(results[0]["doc"])
    finally:
        launch.close_stores()
    if docs:
        write_outputs(p, docs)
    return status


if __name__ == "__main__":
    sys.exit(main())
