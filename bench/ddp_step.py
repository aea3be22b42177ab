"""Time per DistributedDataParallel training step: gloo (or NCCL on GPUs) against gpucoll, in one run.

    python bench/ddp_step.py                          # CPU ranks: 2 and 4, ~25M parameters
    python bench/ddp_step.py --nranks 2 --steps 20 --json ddp.json
    python bench/ddp_step.py --device cuda            # one rank per GPU: NCCL against gpucoll

A step is forward, backward (DDP all-reduces the gradients in its default 25 MB buckets while backward runs) and an
SGD update, on an MLP of about 25M float32 parameters (100 MB of gradients a step) with a small batch, so that the
step is mostly communication, which is what is compared. Variants, each its own DDP model with the same weights:

* ``gloo`` / ``nccl``: DDP on torch's own process group (the reference);
* ``gpucoll``: DDP on a ``new_group(backend="gpucoll")`` (what ``init_process_group("gpucoll")`` gives);
* ``<ref>+hook``: DDP on torch's group with ``gpucoll.torch.allreduce_hook`` registered.

More rows put the ratio in context: ``no comm`` (the same step on a plain model), ``DDP no comm`` (DDP with a hook
that returns the bucket untouched: the step with DDP's own work, its bucket copies and autograd hooks, but an
all-reduce that costs nothing; the floor no backend can go below) and ``<ref> allreduce`` / ``gpucoll allreduce``
(only the all-reduces a step makes: the model's gradients in 25 MB buffers, in place). The step ratio is
(floor + communication) / (floor + reference communication): on a machine where the floor dominates, it stays near
1 however fast the all-reduce is; ``DDP no comm``'s ratio is the best any backend could reach.

``--bucket-view`` builds every DDP model with ``gradient_as_bucket_view=True`` (the gradients live in the buckets,
which saves DDP's copy into and out of them each step, the same for every variant).

The variants take turns, round by round (``--rounds``), so that a change in the machine's load hits them alike; a
variant's figure is the median over its rounds of the slowest rank's mean step time. The ratio column is
time / reference time: below 1 is faster than torch's backend. The load average (``os.getloadavg``) is printed
before and after: on a shared machine, compare ratios from one run, not times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from gpucoll._help import HelpFormatter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(width: int, depth: int):
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i + 1 < depth:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _no_comm_hook(_state, bucket):
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _worker(rank, n, port, args, results):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(n))
        import datetime

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import gpucoll.torch

        cuda = args.device == "cuda"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        if cuda:
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        ref = "nccl" if cuda else "gloo"
        dist.init_process_group(ref, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=600))
        groups = {ref: None, "gpucoll": dist.new_group(backend="gpucoll"), f"{ref}+hook": None, "DDP no comm": None}
        models = {}
        for name, group in groups.items():
            ddp = DDP(_model(args.width, args.depth).to(device), process_group=group,
                      device_ids=[rank] if cuda else None, gradient_as_bucket_view=args.bucket_view)
            if name.endswith("+hook"):
                ddp.register_comm_hook(None, gpucoll.torch.allreduce_hook)
            elif name == "DDP no comm":
                ddp.register_comm_hook(None, _no_comm_hook)
            models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-6))
        plain = _model(args.width, args.depth).to(device)
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(args.batch, args.width, device=device, generator=g)

        def step(ddp, opt):
            opt.zero_grad(set_to_none=False)
            ddp(x).square().mean().backward()
            opt.step()

        # the all-reduces of one step alone: the gradients in DDP's default 25 MB buckets
        total = sum(p.numel() for p in plain.parameters())
        per_bucket = 25 * 2**20 // 4
        buckets = [torch.ones(min(per_bucket, total - i), device=device) for i in range(0, total, per_bucket)]

        def allreduce_only(group):
            def run_once(_ddp, _opt):
                for b in buckets:
                    dist.all_reduce(b, group=group)
            return run_once

        models["no comm"] = (plain, torch.optim.SGD(plain.parameters(), lr=1e-6))
        calls = {name: step for name in models}
        models[f"{ref} allreduce"] = models["gpucoll allreduce"] = (None, None)
        calls[f"{ref} allreduce"] = allreduce_only(None)
        calls["gpucoll allreduce"] = allreduce_only(groups["gpucoll"])

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times = {name: [] for name in models}
        for name, (ddp, opt) in models.items():
            for _ in range(args.warmup):
                calls[name](ddp, opt)
        for _ in range(args.rounds):
            for name, (ddp, opt) in models.items():
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    calls[name](ddp, opt)
                sync()
                times[name].append((time.perf_counter() - t0) / args.steps)
        # the slowest rank's time for each round
        gathered = [None] * n
        dist.all_gather_object(gathered, times)
        params = total
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", {"params": params, "times": gathered}))
    except BaseException as e:  # noqa: BLE001
        import traceback

        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(n: int, args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, args, results), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if status != "ok":
        raise RuntimeError(payload)
    per_rank = payload["times"]
    out = {"nranks": n, "params": payload["params"], "step_ms": {}}
    for name in per_rank[0]:
        rounds = [max(rank_times[name][i] for rank_times in per_rank) for i in range(args.rounds)]
        out["step_ms"][name] = {"median": statistics.median(rounds) * 1e3, "rounds": [t * 1e3 for t in rounds]}
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--nranks", type=int, nargs="+", default=[2, 4], help="world sizes to run, one after the other")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and gradients live (cuda: gpucoll against nccl; cpu: against gloo)")
    ap.add_argument("--width", type=int, default=2896, help="MLP width (3 layers of 2896: 25.2M parameters)")
    ap.add_argument("--depth", type=int, default=3, help="MLP layers")
    ap.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    ap.add_argument("--steps", type=int, default=5, help="steps timed per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per variant; the median round is reported")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each variant's rounds")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True) for every variant: gradients live in the buckets, which "
                         "saves DDP's two copies of them a step")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds the ranks may take in all")
    ap.add_argument("--json", help="write the figures here")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    ref = "nccl" if args.device == "cuda" else "gloo"
    load_before = os.getloadavg()
    view = ", gradient_as_bucket_view" if args.bucket_view else ""
    print(f"# ddp_step: {args.device} ranks, batch {args.batch}{view}, {args.rounds} rounds x {args.steps} steps; "
          f"{os.cpu_count()} CPUs; load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    report = {"device": args.device, "batch": args.batch, "bucket_view": args.bucket_view, "load_before": load_before,
              "runs": []}
    for n in args.nranks:
        res = run(n, args)
        report["runs"].append(res)
        base = res["step_ms"][ref]["median"]
        print(f"\n{n} ranks, {res['params'] / 1e6:.1f}M parameters ({res['params'] * 4 / 2**20:.0f} MiB of gradients)")
        comm_base = res["step_ms"][f"{ref} allreduce"]["median"]
        print(f"  {'variant':<18} {'ms':>9} {'ratio':>7}   rounds (ms)")
        for name, v in res["step_ms"].items():
            rounds = " ".join(f"{t:.0f}" for t in v["rounds"])
            ratio = "" if name == "no comm" else f"{v['median'] / (comm_base if 'allreduce' in name else base):7.2f}"
            print(f"  {name:<18} {v['median']:9.1f} {ratio:>7}   {rounds}")
        sys.stdout.flush()
    load_after = os.getloadavg()
    report["load_after"] = load_after
    print(f"\n# load average after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
