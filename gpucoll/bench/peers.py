"""--compare: the same sizes, datatypes and ops on a peer library, in the same invocation.

gloo (torch.distributed, CPU) runs here as `nranks` spawned processes, before gpucoll's run; gpucoll's table then
shows the peer's time and the ratio peer time / gpucoll time after nccl-tests' columns. torch and nccl peers
time GPU buffers and need a GPU (and gpucoll's GPU backends): refused with a clear message on a CPU machine.
Times are the slowest rank's loop time / iters (as bench/compare_peers.py).
"""

from __future__ import annotations

import time

PEERS = ("gloo", "torch", "nccl")
GLOO_COLLS = ("all_reduce", "broadcast", "reduce", "all_gather")
_TORCH_DTYPES = {"float": "float32", "half": "float16", "double": "float64"}
_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX"}  # gloo has no avg


def unavailable(peer: str, coll: str, backend: str) -> str | None:
    """Why --compare `peer` cannot run here, or None."""
    if peer in ("torch", "nccl"):
        return (f"--compare {peer} needs a GPU (it times torch.distributed's NCCL on CUDA tensors) and gpucoll "
                f"benchmarks the {backend} backend here; use --compare gloo to compare with a CPU peer")
    if backend != "host":
        return f"--compare gloo compares with gpucoll's host backend only (got --backend {backend})"
    if coll not in GLOO_COLLS:
        return f"--compare gloo supports {', '.join(GLOO_COLLS)}; not {coll}"
    try:
        import torch.distributed as dist
    except ImportError:
        return "--compare gloo needs torch (pip install torch)"
    if not dist.is_available() or not dist.is_gloo_available():
        return "--compare gloo: this torch has no gloo backend"
    return None


def plan(p, nranks: int) -> list[tuple]:
    """(type, redop, nbytes, send elements, recv elements) for every row gpucoll will print (first algo)."""
    from gpucoll.bench import colls
    from gpucoll.bench.harness import sizes

    coll = colls.get(p.coll)
    out = []
    for name in p.dtypes:
        dt = colls.DTYPES[name]
        for op in (p.ops if coll.reduces else ["sum"]):
            for size in sizes(p):
                c = coll.counts(size // dt.itemsize, nranks, dt.itemsize)
                out.append((name, op if coll.reduces else "none", max(c.send, c.recv) * dt.itemsize, c.send, c.recv))
    return out


def _gloo_rank(rank, nranks, port, coll, root, rows, warmup, iters, results):
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
        out = {}
        for name, op, nbytes, nsend, nrecv in rows:
            tdt = getattr(torch, _TORCH_DTYPES.get(name, name), None)
            if tdt is None or (coll in ("all_reduce", "reduce") and op not in _OPS):
                continue
            red = getattr(dist.ReduceOp, _OPS.get(op, "SUM"))
            x = torch.ones(nsend, dtype=tdt)
            y = torch.zeros(nrecv, dtype=tdt)
            call = {"all_reduce": lambda: dist.all_reduce(x, op=red),
                    "broadcast": lambda: dist.broadcast(x, src=root),
                    "reduce": lambda: dist.reduce(x, dst=root, op=red),
                    "all_gather": lambda: dist.all_gather_into_tensor(y, x)}[coll]
            try:
                for _ in range(max(1, warmup)):
                    call()
            except (RuntimeError, ValueError, TypeError):  # a dtype/op this peer does not support: N/A
                continue
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            out[(name, op, nbytes)] = (time.perf_counter() - t0) / iters
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def run_local_ranks(target, nranks: int, args: tuple, timeout: float, what: str) -> dict:
    """Start `nranks` spawned processes running target(rank, nranks, port, *args, results) on a free loopback
    port; each puts (rank, value, error) on `results`. Returns {rank: value}; the first error is raised."""
    import torch.multiprocessing as tmp

    from gpucoll._spawn import free_port

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, nranks, port, *args, results), daemon=True) for r in range(nranks)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < nranks:
            rank, value, err = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if err:
                raise RuntimeError(f"{what}: rank {rank}: {err}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return got


def run_gloo(p, nranks: int) -> dict:
    """{(type, redop, nbytes): seconds} measured with torch.distributed gloo on `nranks` spawned processes."""
    got = run_local_ranks(_gloo_rank, nranks, (p.coll, p.root, plan(p, nranks), p.warmup_iters, p.iters),
                          p.timeout, "--compare gloo")
    keys = set.intersection(*(set(t) for t in got.values()))
    return {k: max(got[r][k] for r in got) for k in keys}
