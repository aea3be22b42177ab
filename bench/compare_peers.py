"""gpucoll's host allreduce against the CPU peers, same sizes, same rank count, one invocation.

    python bench/compare_peers.py                     # 4 ranks, 64K 1M 64M float32
    python bench/compare_peers.py --nranks 2 --sizes 8K,1M --json peers.json

Peers: torch.distributed with gloo (needs torch: `pip install torch==2.13.0` here, the CPU wheel) and, when
mpi4py and an mpiexec are installed (`pip install mpi4py mpich`), MPI run through mpiexec from this script.
A peer that is not installed is skipped with the reason.

Every peer runs the same measurement: float32 sum allreduce in place (gloo only has in place), one checked
call (rank r contributes r + 1 everywhere), then buffers of zeros, `warmup` calls, a barrier and `iters`
timed calls. A rank's time is its loop time / iters; the table shows the slowest rank's, and busbw =
size / time * 2(n-1)/n as in nccl-tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np

from gpucoll._help import HelpFormatter


def _iters_for(nbytes: int):
    """(warmup, iters) giving each size about a second on the slowest peer here (gloo, 2 cores)."""
    if nbytes <= 256 << 10:
        return 10, 200
    if nbytes <= 4 << 20:
        return 5, 50
    return 2, 10


def _plan(sizes, iters, warmup):
    out = []
    for s in sizes:
        w, n = _iters_for(s)
        out.append((s, warmup if warmup is not None else w, iters if iters is not None else n))
    return out


def _check(x: np.ndarray, nranks: int, who: str) -> None:
    want = nranks * (nranks + 1) / 2
    if x.size and not np.all(x == want):
        raise RuntimeError(f"{who}: allreduce result wrong ({x[:4]} ..., want {want})")


# -- gpucoll --------------------------------------------------------------------------------------------
def _gpucoll_rank(comm, plan, algo="auto"):
    times = []
    for nbytes, warmup, iters in plan:
        x = np.full(nbytes // 4, comm.rank + 1, np.float32)
        comm.all_reduce(x, algo=algo)
        _check(x, comm.world_size, f"gpucoll:{algo}")
        x[:] = 0
        for _ in range(warmup):
            comm.all_reduce(x, algo=algo)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, algo=algo)
        times.append((time.perf_counter() - t0) / iters)
    return times


def run_gpucoll(nranks, plan, timeout, algo="auto"):
    import gpucoll

    per_rank = gpucoll.spawn(_gpucoll_rank, nranks, args=(plan, algo), backend="host", timeout=timeout)
    return [max(t[i] for t in per_rank) for i in range(len(plan))]


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """One core copying nbytes (NumPy copyto), best of `repeats`: the machine's per-core copy roofline."""
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


# -- gloo -----------------------------------------------------------------------------------------------
def _gloo_rank(rank, nranks, port, plan, results):
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
        times = []
        for nbytes, warmup, iters in plan:
            x = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
            dist.all_reduce(x)
            _check(x.numpy(), nranks, "gloo")
            x.zero_()
            for _ in range(warmup):
                dist.all_reduce(x)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            times.append((time.perf_counter() - t0) / iters)
        dist.destroy_process_group()
        results.put((rank, times, None))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def run_gloo(nranks, plan, timeout):
    from gpucoll.bench.peers import run_local_ranks

    got = run_local_ranks(_gloo_rank, nranks, (plan,), timeout, "gloo")
    return [max(got[r][i] for r in got) for i in range(len(plan))]


# -- MPI ------------------------------------------------------------------------------------------------
def _mpi_worker(plan):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    times = []
    for nbytes, warmup, iters in plan:
        x = np.full(nbytes // 4, rank + 1, np.float32)
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        _check(x, n, "mpi")
        x[:] = 0
        for _ in range(warmup):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        times.append((time.perf_counter() - t0) / iters)
    every = comm.gather(times, root=0)
    if rank == 0:
        print("MPI_RESULT " + json.dumps([max(t[i] for t in every) for i in range(len(plan))]), flush=True)


def _mpiexec():
    """The mpiexec next to this Python (the mpich wheel's) first, then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def mpi_unavailable():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install mpi4py mpich)"
    if _mpiexec() is None:
        return "no mpiexec found (pip install mpich)"
    return None


def run_mpi(nranks, plan, timeout):
    exe = _mpiexec()
    version = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    cmd = [exe, "-n", str(nranks)]
    env = dict(os.environ)
    if "Open MPI" in version or "OpenRTE" in version:  # Open MPI refuses root and > cores without these
        cmd += ["--oversubscribe"]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd += [sys.executable, os.path.abspath(__file__), "--_mpi-worker", json.dumps(plan)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("MPI_RESULT "):
            return json.loads(line[len("MPI_RESULT "):])
    raise RuntimeError(f"mpiexec exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-800:]}")


# -- table ----------------------------------------------------------------------------------------------
def _busbw(nbytes, sec, n):
    return nbytes / sec / 1e9 * (2.0 * (n - 1) / n) if sec > 0 else 0.0


def _size_str(n):
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--nranks", type=int, default=4, help="ranks of every peer")
    ap.add_argument("--sizes", default="64K,1M,64M", help="comma-separated byte sizes (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup calls per size (default: by size)")
    ap.add_argument("--peers", default="gpucoll,gloo,mpi", help="which to run, comma-separated")
    ap.add_argument("--algos", default="auto",
                    help="gpucoll algorithms to run, comma-separated, or 'all' (each becomes its own column)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each peer's ranks may take")
    ap.add_argument("--json", metavar="FILE", help="write every measurement and the environment here")
    ap.add_argument("--_mpi-worker", dest="mpi_worker", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.mpi_worker:
        _mpi_worker([tuple(x) for x in json.loads(args.mpi_worker)])
        return 0

    from gpucoll import _C, __version__

    sizes = [int(_C.parse_bytes(s.strip())) for s in args.sizes.split(",") if s.strip()]
    plan = _plan(sizes, args.iters, args.warmup)
    n = args.nranks
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if algos == ["all"]:
        algos = ["auto"] + [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, 0, n, 0, 0) is None]
    if "gpucoll" in peers:
        i = peers.index("gpucoll")
        peers[i:i + 1] = ["gpucoll" if a == "auto" else f"gpucoll:{a}" for a in algos]
    results, skipped, versions = {}, {}, {"gpucoll": __version__}
    for peer in peers:
        if peer == "gloo":
            try:
                import torch

                versions["torch"] = torch.__version__
            except ImportError:
                skipped[peer] = "torch not installed (pip install torch==2.13.0)"
                continue
        if peer == "mpi":
            reason = mpi_unavailable()
            if reason:
                skipped[peer] = reason
                continue
            from mpi4py import MPI

            versions["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        if peer.startswith("gpucoll:"):
            runner = functools.partial(run_gpucoll, algo=peer.split(":", 1)[1])
        else:
            runner = {"gpucoll": run_gpucoll, "gloo": run_gloo, "mpi": run_mpi}[peer]
        t0 = time.time()
        try:
            results[peer] = runner(n, plan, args.timeout)
        except Exception as e:  # noqa: BLE001 - one failing peer must not hide the others
            skipped[peer] = f"failed: {type(e).__name__}: {e}"
            continue
        print(f"# {peer}: done in {time.time() - t0:.1f} s", file=sys.stderr)

    ran = [p for p in peers if p in results]
    print(f"# float32 sum allreduce in place, {n} ranks, time per call = slowest rank's mean; "
          f"{platform.node()}, {os.cpu_count()} cores")
    for peer, why in skipped.items():
        print(f"# {peer} skipped: {why}")
    head = f"{'size':>8} {'iters':>6}"
    for p in ran:
        head += f" {p + ' ms':>12} {'busbw GB/s':>10}"
    for p in ran:
        if p != "gpucoll" and "gpucoll" in results:
            head += f" {p + '/gpucoll':>13}"
    print(head)
    rows = []
    for i, (nbytes, warmup, iters) in enumerate(plan):
        line = f"{_size_str(nbytes):>8} {iters:>6}"
        row = {"size": nbytes, "warmup": warmup, "iters": iters}
        for p in ran:
            sec = results[p][i]
            row[p] = {"time_ms": sec * 1e3, "busbw": _busbw(nbytes, sec, n)}
            line += f" {sec * 1e3:>12.3f} {row[p]['busbw']:>10.2f}"
        for p in ran:
            if p != "gpucoll" and "gpucoll" in results:
                ratio = results[p][i] / results["gpucoll"][i]
                row[f"ratio_{p}_over_gpucoll"] = ratio
                line += f" {ratio:>13.2f}"
        print(line)
        rows.append(row)
    # The roofline: an allreduce must at least read every rank's input and write every rank's output, i.e.
    # copy P buffers, spread over the machine's cores. Measured here, in the same run.
    cores = os.cpu_count() or 1
    print(f"# memory roofline ({cores} cores): one core copying the buffer, and the lower bound P copies / cores")
    for i, (nbytes, _, _) in enumerate(plan):
        t_copy = memcpy_seconds(nbytes)
        t_min = n * t_copy / min(cores, n)
        line = (f"# {_size_str(nbytes):>6}: memcpy {t_copy * 1e3:.3f} ms ({2 * nbytes / t_copy / 1e9:.1f} GB/s "
                f"read+write), bound {t_min * 1e3:.3f} ms;")
        best = {p: results[p][i] for p in ran if p.startswith("gpucoll")}
        if best:
            who = min(best, key=best.get)
            line += f" best gpucoll ({who}) at {t_min / best[who] * 100:.0f}% of the bound"
        rows[i]["memcpy_ms"] = t_copy * 1e3
        rows[i]["roofline_ms"] = t_min * 1e3
        print(line)
    if args.json:
        doc = {"nranks": n, "dtype": "float32", "op": "sum", "in_place": True, "time": "slowest rank's mean",
               "hostname": platform.node(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
               "versions": versions, "skipped": skipped, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if "gpucoll" in results or "gpucoll" not in peers else 1


if __name__ == "__main__":
    sys.exit(main())
