"""--compare: the same sizes, datatypes and ops on a peer, in the same invocation, on the same number of ranks.

* gloo: torch.distributed's CPU backend, for host runs (`--compare torch` on a host run means this too, said in a
  note: torch's CPU collectives are gloo's).
* torch: torch.distributed with NCCL on CUDA tensors, for CUDA runs (nccl, custom); ranks share GPUs as gpucoll's
  do (rank r on GPU r % count; NCCL's multi-rank mode when ranks outnumber GPUs).
* nccl: gpucoll's own nccl backend, for --backend custom: NCCL at the same number of ranks (several on one GPU
  need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, as gpucoll.spawn arranges).

The peer runs before gpucoll's run, on its own spawned ranks; gpucoll's table then shows the peer's time and the
ratio peer time / gpucoll time after nccl-tests' columns. torch peers time the slowest rank's loop / iters (as
bench/compare_peers.py), after a stream synchronize on CUDA; the nccl peer is gpucoll-bench's own out-of-place
time for the row.
"""

from __future__ import annotations

import os
import queue
import time

from gpucoll._native import _C
from gpucoll._spawn import free_port
from gpucoll.backends.usable import MULTI_RANK_ENV
from gpucoll.bench import colls, harness
from gpucoll.bench.harness import sizes
from gpucoll.bench.usage import UsageError, resolve_backend

PEERS = ("gloo", "torch", "nccl")
GLOO_COLLS = ("all_reduce", "broadcast", "reduce", "all_gather")
TORCH_NCCL_COLLS = (*GLOO_COLLS, "reduce_scatter", "all_to_all")
_TORCH_DTYPES = {"float": "float32", "half": "float16", "double": "float64"}
_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}  # gloo has no avg


def resolve(peer: str, backend: str) -> tuple[str, str | None]:
    """(the peer that runs, a note for the table or None): --compare torch on a host run is gloo."""
    if peer == "torch" and backend == "host":
        return "gloo", ("--compare torch on the host backend: torch.distributed with gloo (torch's CPU backend); "
                        "with --backend nccl or custom it is torch.distributed with NCCL on CUDA tensors")
    return peer, None


def unavailable(peer: str, coll: str, backend: str, nranks: int = 1) -> str | None:
    """Why --compare `peer` cannot run here on `nranks` local ranks, or None."""
    if peer == "unchecked":  # the same calls with the call check off: the backends that have a switch for it
        return None if backend in ("host", "custom") else (
            f"--compare unchecked measures the cross-rank call check of the host backend and of the custom kernels "
            f"(got --backend {backend}); use --backend host or --backend custom")
    if peer == "nccl":
        if backend != "custom":
            return (f"--compare nccl compares gpucoll's own kernels (--backend custom) with NCCL at the same ranks; "
                    f"with --backend {backend} use " + ("--compare torch" if backend == "nccl" else "--compare gloo"))
        try:
            resolve_backend("nccl")
        except UsageError as e:
            return f"--compare nccl: {e}"
        return None
    if peer == "torch":
        if backend == "host":
            return "--compare torch on the host backend runs gloo: use --compare gloo"
        colls, what = TORCH_NCCL_COLLS, "--compare torch (torch.distributed with NCCL)"
    else:
        if backend != "host":
            return (f"--compare gloo compares with gpucoll's host backend only (got --backend {backend}); use "
                    f"--compare torch for torch.distributed with NCCL on CUDA tensors")
        colls, what = GLOO_COLLS, "--compare gloo"
    if coll not in colls:
        return f"{what} supports {', '.join(colls)}; not {coll}"
    try:
        import torch.distributed as dist
    except ImportError:
        return (f"{what} needs torch: pip install torch (on a machine without a GPU the CPU wheel: pip install torch "
                f"--index-url https://download.pytorch.org/whl/cpu)")
    if not dist.is_available():
        return f"{what}: this torch has no torch.distributed"
    if peer == "gloo" and not dist.is_gloo_available():
        return "--compare gloo: this torch has no gloo backend"
    if peer == "torch" and not dist.is_nccl_available():
        return "--compare torch: this torch has no NCCL backend (a CPU-only torch?): install a CUDA build of torch"
    if peer == "torch":
        return _torch_shares_gpus_problem(nranks)
    return None


def _torch_shares_gpus_problem(nranks: int) -> str | None:
    """Ranks outnumbering GPUs share them through NCCL's multi-rank mode, which the NCCL torch loads (its own
    pinned wheel, maybe older than the one gpucoll loads) must have: else every rank fails its first collective
    with "Duplicate GPU detected"."""
    gpus = int(_C.cuda_probe().get("device_count") or 0)
    if nranks <= gpus:
        return None
    import torch

    try:
        version = tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - cannot tell: let the run say
        return None
    code = version[0] * 10000 + version[1] * 100 + (version[2] if len(version) > 2 else 0)
    if _C.nccl_multi_rank_gpu_supported(code):
        return None
    return (f"--compare torch with {nranks} ranks on {gpus} GPU(s) needs ranks to share a GPU, which torch's NCCL "
            f"{'.'.join(map(str, version))} cannot (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1); use --nranks "
            f"{max(gpus, 1)} or a torch built with a newer NCCL")


def measure(peer: str, p, nranks: int) -> dict:
    """{(type, redop, nbytes): seconds} for every row of p, measured with `peer` on `nranks` ranks."""
    if peer == "nccl":
        return run_gpucoll_nccl(p, nranks)
    return run_torch(p, nranks, "nccl" if peer == "torch" else "gloo")


def plan(p, nranks: int) -> list[tuple]:
    """(type, redop, nbytes, send elements, recv elements) for every row gpucoll will print (first algo)."""
    coll = colls.get(p.coll)
    out = []
    for name in p.dtypes:
        dt = colls.DTYPES[name]
        for op in (p.ops if coll.reduces else ["sum"]):
            for size in sizes(p):
                c = coll.counts(size // dt.itemsize, nranks, dt.itemsize)
                out.append((name, op if coll.reduces else "none", max(c.send, c.recv) * dt.itemsize, c.send, c.recv))
    return out


def _torch_rank(rank, nranks, port, backend, env, coll, root, rows, warmup, iters, results):
    os.environ.update(env)  # before torch initialises NCCL in this process
    import torch
    import torch.distributed as dist

    try:
        cuda = backend == "nccl"
        device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks,
                                **({"device_id": device} if cuda else {}))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        out = {}
        for name, op, nbytes, nsend, nrecv in rows:
            tdt = getattr(torch, _TORCH_DTYPES.get(name, name), None)
            if tdt is None or (coll in ("all_reduce", "reduce", "reduce_scatter") and op not in _OPS):
                continue
            red = getattr(dist.ReduceOp, _OPS.get(op, "SUM"))
            x = torch.ones(nsend, dtype=tdt, device=device)
            y = torch.zeros(nrecv, dtype=tdt, device=device)
            call = _torch_call(dist, coll, x, y, red, root)
            try:
                for _ in range(max(1, warmup)):
                    call()
                sync()
            except (RuntimeError, ValueError, TypeError):  # a dtype/op this peer does not support: N/A
                continue
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            sync()
            out[(name, op, nbytes)] = (time.perf_counter() - t0) / iters
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def _torch_call(dist, coll: str, x, y, red, root: int):
    """One call of `coll` through torch.distributed on these tensors (nccl-tests' layouts: y is the output)."""
    calls = {"all_reduce": lambda: dist.all_reduce(x, op=red),
             "broadcast": lambda: dist.broadcast(x, src=root),
             "reduce": lambda: dist.reduce(x, dst=root, op=red),
             "all_gather": lambda: dist.all_gather_into_tensor(y, x),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(y, x, op=red),
             "all_to_all": lambda: dist.all_to_all_single(y, x)}
    return calls[coll]


def run_local_ranks(target, nranks: int, args: tuple, timeout: float, what: str) -> dict:
    """Start `nranks` spawned processes running target(rank, nranks, port, *args, results) on a free loopback
    port; each puts (rank, value, error) on `results`. Returns {rank: value}; the first error is raised."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, nranks, port, *args, results), daemon=True) for r in range(nranks)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        # Short waits, so that a rank that died without reporting (a CUDA or NCCL crash) ends the run at once
        # instead of after the whole timeout, and a timeout says which ranks never reported.
        deadline, dead_since = time.monotonic() + timeout, None
        while len(got) < nranks:
            try:
                rank, value, err = results.get(timeout=0.5)
            except queue.Empty:
                late = [r for r in range(nranks) if r not in got]
                dead = [r for r in late if not procs[r].is_alive()]
                # A rank's last report may still be in the pipe as it exits: a second chance before failing.
                dead_since = (dead_since or time.monotonic()) if dead else None
                if dead_since is not None and time.monotonic() - dead_since > 2.0:
                    raise RuntimeError(f"{what}: rank {dead[0]} exited with code {procs[dead[0]].exitcode} without "
                                       f"reporting") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: ranks {late} did not finish within {timeout:g} s (-T)") from None
                continue
            if err:
                raise RuntimeError(f"{what}: rank {rank}: {err}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return got


def run_torch(p, nranks: int, backend: str) -> dict:
    """{(type, redop, nbytes): seconds} measured with torch.distributed (`backend`: gloo or nccl) on `nranks`
    spawned processes."""
    env = {}
    if backend == "nccl" and nranks > int(_C.cuda_probe().get("device_count") or 0):
        env[MULTI_RANK_ENV] = "1"  # torch's NCCL must allow ranks to share a GPU (NCCL >= 2.30)
    rows = plan(p, nranks)
    # -T bounds one collective; the ranks report once, after every row (a rank that dies is noticed at once).
    got = run_local_ranks(_torch_rank, nranks, (backend, env, p.coll, p.root, rows, p.warmup_iters, p.iters),
                          p.timeout * max(1, len(rows)), f"--compare ({backend} through torch.distributed)")
    keys = set.intersection(*(set(t) for t in got.values()))
    return {k: max(got[r][k] for r in got) for k in keys}


def run_gpucoll_nccl(p, nranks: int) -> dict:
    """{(type, redop, nbytes): seconds}: gpucoll-bench's own out-of-place times on the nccl backend, no check."""
    import copy

    q = copy.deepcopy(p)
    q.backend, q.backend_label, q.compare, q.peer_times = "nccl", "nccl", None, {}
    q.quiet, q.progress, q.check, q.algos, q.algo_all, q.graph = True, False, 0, ["auto"], False, 0
    rows = harness.run_local(harness.run_rank, q, nranks, (q,))[0]["rows"]
    return {(r["type"], r["redop"], r["size"]): r["out_of_place"]["time"] / 1e6 for r in rows
            if r["out_of_place"]["time"] is not None}
