"""What a call costs before it reaches the native code: the public API against its own native call and MPICH.

    python bench/dispatch_overhead.py                         # 2 ranks, 8 B float32 all_reduce, 5 rounds
    python bench/dispatch_overhead.py --rounds 9 --calls 20000 --json out.json
    python bench/dispatch_overhead.py --contend 2              # with 2 busy processes beside the ranks
    python bench/dispatch_overhead.py --torch                  # also dist.all_reduce through the torch backend
    GPUCOLL_CUDA=emulate python bench/dispatch_overhead.py --backend nccl --calls 2000   # the NCCL path (or a GPU)

Host backend, P ranks (gpucoll.spawn), in place, sum. In each round every rank times, one after the other in the
same processes, `calls` calls of
- public: `comm.all_reduce(x)`;
- general: `comm.all_reduce(x, x)`, in place through out=, which takes the general Python path (resolve, checks,
  backend, algorithm by name) that the host backend's one-call path (HostComm.all_reduce_array) skips;
- native: the call the general one ends in (`impl.run(name, ...)` with the same arguments, the algorithm chosen
  once before the loop), which is what the Python layers cost on top of;
with --torch also
- torch: `dist.all_reduce(t)` on a CPU tensor through gpucoll's torch backend (its own process group over the same
  ranks), the call a PyTorch job makes;
then MPICH through mpi4py (`comm.Allreduce(IN_PLACE, x)`, launched with the mpich wheel's mpiexec) runs the same
rounds in its own ranks, between gpucoll's rounds. Reported per variant: the best and the median round (the
slowest rank's time per call), and the ratios public/native and public/MPICH of the medians. On a shared 2-core
machine the other tenants move every figure: compare ratios from one run, and run it twice.

--contend K starts K processes that spin on the CPU for the whole measurement (data-loader workers and other jobs
make such contention ordinary): ranks that sleep in a wait lose the CPU to them, ranks that spin do not.

--backend nccl or custom times the same public, general and native variants on CUDA memory (a DeviceArray; a GPU,
or the emulated device with GPUCOLL_CUDA=emulate), native being the binding the paths end in (NcclComm's of
ncclAllReduce; CustomComm.run_all_reduce with the selector's algorithm, chosen once). The
clock is the calling thread's CPU time: what a call costs its caller while the device (on the emulated device, its
worker threads) runs behind it. Emulated figures are ratios of CPU work, not GPU timings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from gpucoll._spawn import free_port


def _time(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _torch_all_reduce(comm, port: int, nbytes: int):
    """`dist.all_reduce(t)` through gpucoll's torch backend (a process group of its own over the same ranks)."""
    import datetime

    import torch
    import torch.distributed as dist

    import gpucoll.torch  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("gpucoll", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.world_size, timeout=datetime.timedelta(seconds=120))
    t = torch.full((max(1, nbytes // 4),), float(comm.rank + 1))
    dist.all_reduce(t)
    ok = bool((t == comm.world_size * (comm.world_size + 1) / 2).all())
    return (lambda: dist.all_reduce(t)), ok


def _gpucoll_rank(comm, rounds: int, calls: int, nbytes: int, torch_port: int = 0) -> dict:
    from gpucoll import _buffers
    from gpucoll._native import _C

    x = np.full(max(1, nbytes // 4), comm.rank + 1, np.float32)
    comm.all_reduce(x)
    ok = bool((x == comm.world_size * (comm.world_size + 1) / 2).all())
    ops = comm._ops  # the host backend object (gpucoll/backends/host.py)
    buf = _buffers.resolve(x, "x", writable=True)
    name = ops._select(0, "auto", buf.nbytes)
    impl, local = ops.impl, ops.local_size

    def native():
        impl.run(name, 0, buf.ptr, buf.ptr, buf.count, buf.dtype, _C.RedOp.sum, 0, local, None, True)

    def public():
        comm.all_reduce(x)

    def general():
        comm.all_reduce(x, x)  # in place through out=: the general Python path the one-call path skips

    variants = [("public", public), ("general", general), ("native", native)]
    if torch_port:
        torch_call, torch_ok = _torch_all_reduce(comm, torch_port, nbytes)
        variants.append(("torch", torch_call))
        ok = ok and torch_ok
    out = {key: [] for key, _ in variants}
    out["ok"] = ok
    for _ in range(rounds):
        for key, fn in variants:
            for _ in range(max(10, calls // 20)):
                fn()
            comm.barrier()
            out[key].append(_time(fn, calls))
    return out


def _cpu_time(fn, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls * 1e6


def _gpu_rank(comm, rounds: int, calls: int, nbytes: int) -> dict:
    """--backend nccl or custom: the same three variants on a DeviceArray (CUDA memory), timed in this thread's CPU
    time, which is what a call costs its caller while the device works behind it (on the emulated device its worker
    threads)."""
    from gpucoll import _buffers
    from gpucoll._device_array import DeviceArray
    from gpucoll._native import _C

    dev = int(comm.device.split(":")[1])
    x = DeviceArray.from_host(np.full(max(1, nbytes // 4), comm.rank + 1, np.float32), device=dev)
    comm.all_reduce(x)
    ok = bool((x.to_host() == comm.world_size * (comm.world_size + 1) / 2).all())
    buf = _buffers.resolve(x, "x", writable=True)
    native_comm = comm._ops.impl  # the binding the paths end in: NcclComm, or CustomComm
    if comm.backend == "nccl":
        def native():
            native_comm.collective(0, buf.ptr, buf.ptr, buf.count, buf.dtype, _C.RedOp.sum, 0, 0, False, None)
    else:
        algo = comm._ops.algorithm_for(0, buf.nbytes, "float32", "auto")  # the selector's answer, once
        if not algo.startswith("custom"):
            raise SystemExit(f"the selector gives this size to {algo}: pick a smaller --bytes for --backend custom")
        algo = algo.split(":")[1] if ":" in algo else "auto"

        def native():
            native_comm.run_all_reduce(buf.ptr, buf.ptr, buf.count, buf.dtype, _C.RedOp.sum, False, algo, 0)

    def public():
        comm.all_reduce(x)

    def general():
        comm.all_reduce(x, x)  # in place through out=: the general Python path

    out = {"public": [], "general": [], "native": []}
    for _ in range(rounds):
        for key, fn in (("public", public), ("general", general), ("native", native)):
            for _ in range(max(10, calls // 20)):
                fn()
            comm.barrier()
            out[key].append(_cpu_time(fn, calls))
            comm.barrier()
    x.to_host()  # waits for the calls on the legacy default stream
    out["ok"] = ok
    return out


def _mpi_worker(rounds: int, calls: int, nbytes: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x = np.full(max(1, nbytes // 4), comm.rank + 1, np.float32)
    comm.Allreduce(MPI.IN_PLACE, x)
    ok = bool((x == comm.size * (comm.size + 1) / 2).all())
    times = []
    for _ in range(rounds):
        for _ in range(max(10, calls // 20)):
            comm.Allreduce(MPI.IN_PLACE, x)
        comm.Barrier()
        times.append(_time(lambda: comm.Allreduce(MPI.IN_PLACE, x), calls))
    rows = comm.gather({"mpich": times, "ok": ok}, root=0)
    if comm.rank == 0:
        print(json.dumps(rows))


def _mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def run_mpich(nranks: int, rounds: int, calls: int, nbytes: int) -> dict:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return {"skipped": "mpi4py not installed (pip install mpi4py mpich)"}
    exe = _mpiexec()
    if exe is None:
        return {"skipped": "no mpiexec found (pip install mpich)"}
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import dispatch_overhead as d; d._mpi_worker({rounds}, {calls}, {nbytes})")
    p = subprocess.run([exe, "-n", str(nranks), sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, check=False)
    if p.returncode != 0:
        return {"skipped": f"mpiexec exited {p.returncode}: {(p.stderr or p.stdout).strip()[-500:]}"}
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    return {"mpich": [max(r["mpich"][i] for r in rows) for i in range(rounds)], "ok": all(r["ok"] for r in rows)}


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(10000):
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--contend", type=int, default=0, help="busy processes beside the ranks")
    ap.add_argument("--torch", action="store_true",
                    help="also time dist.all_reduce(t) on a CPU tensor through gpucoll's torch backend")
    ap.add_argument("--backend", choices=("host", "nccl", "custom"), default="host",
                    help="nccl, custom: CUDA memory (a GPU, or GPUCOLL_CUDA=emulate), CPU time of the calling thread, "
                         "no MPICH")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import gpucoll

    stop = mp.get_context("spawn").Event()
    spinners = [mp.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.contend)]
    for p in spinners:
        p.start()
    try:
        torch_port = free_port() if a.torch else 0
        if a.backend in ("nccl", "custom"):
            per_rank = gpucoll.spawn(_gpu_rank, a.nranks, args=(a.rounds, a.calls, a.bytes), backend=a.backend,
                                     timeout=600.0)
            mpich = {"skipped": f"--backend {a.backend} compares with its own native call only"}
        else:
            per_rank = gpucoll.spawn(_gpucoll_rank, a.nranks, args=(a.rounds, a.calls, a.bytes, torch_port),
                                     backend="host", timeout=600.0)
            mpich = run_mpich(a.nranks, a.rounds, a.calls, a.bytes)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    keys = ("public", "general", "native") + (("torch",) if a.torch else ())
    rows = {k: [max(r[k][i] for r in per_rank) for i in range(a.rounds)] for k in keys}
    if "mpich" in mpich:
        rows["mpich"] = mpich["mpich"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {"backend": a.backend, "clock": "wall" if a.backend == "host" else "thread CPU",
              "nranks": a.nranks, "bytes": a.bytes, "calls": a.calls, "rounds": a.rounds, "contend": a.contend,
              "load_avg": os.getloadavg(), "ok": all(r["ok"] for r in per_rank) and mpich.get("ok", True),
              "us_per_call": rows, "median_us": med, "best_us": {k: min(v) for k, v in rows.items()},
              "public_over_native": med["public"] / med["native"], "general_over_native": med["general"] / med["native"],
              "public_over_mpich": med["public"] / med["mpich"] if "mpich" in med else None,
              "torch_over_mpich": med["torch"] / med["mpich"] if "torch" in med and "mpich" in med else None,
              "mpich": mpich.get("skipped", "measured")}
    for k, v in rows.items():
        print(f"{k:7s} median {med[k]:7.2f} us   best {min(v):7.2f} us per call")
    print(f"public / native {report['public_over_native']:.2f}"
          + (f"   public / MPICH {report['public_over_mpich']:.2f}" if report["public_over_mpich"] else
             f"   MPICH: {report['mpich']}")
          + (f"   torch / MPICH {report['torch_over_mpich']:.2f}" if report["torch_over_mpich"] else "")
          + f"   (ok: {report['ok']}, load {os.getloadavg()[0]:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
