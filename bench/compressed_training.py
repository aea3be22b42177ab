"""Training under DDP with gpucoll.torch.compressed_hook: does a compressed all-reduce cost accuracy?

    python bench/compressed_training.py                      # 2 and 4 CPU ranks, 300 steps, int8
    python bench/compressed_training.py --nranks 2 --steps 100 --json out.json --plot curves.png

The same small model, data and seeds are trained once per variant:

* ``none``: gpucoll.torch.allreduce_hook (the gradients averaged exactly, in float32);
* ``<fmt>+ef``: compressed_hook with error feedback (the residual of each bucket sent at the next step);
* ``<fmt>``: compressed_hook without it.

The model is a 3-layer MLP classifier (about 70k parameters) on a synthetic task labelled by a fixed random teacher
network; each rank draws its own batches. The figure that counts is the loss on a fixed held-out set after the last
step (``final``), next to the training loss averaged over the last 20 steps; the ratio column is the variant's final
loss over ``none``'s. Step times are not the point here (CPU ranks on a shared machine); bench/ddp_step.py and
gpucoll-bench --compress measure speed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(seed: int, n: int, dim: int, classes: int):
    import torch

    g = torch.Generator().manual_seed(1234)  # the teacher: the same on every rank and in every variant
    w1, w2 = torch.randn(dim, 64, generator=g), torch.randn(64, classes, generator=g)
    gx = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gx)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def _rank(rank: int, world: int, port: int, variant: str, steps: int, out):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpucoll.torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dim, classes, batch = 64, 10, 64
    torch.manual_seed(0)  # the same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, classes))
    ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets: the residuals are kept per bucket
    if variant == "none":
        ddp.register_comm_hook(None, gpucoll.torch.allreduce_hook)
    else:
        fmt, _, ef = variant.partition("+")
        ddp.register_comm_hook(gpucoll.torch.CompressionState(fmt, error_feedback=ef == "ef"),
                               gpucoll.torch.compressed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = _data(100 + rank, steps * batch, dim, classes)
    losses = []
    for step in range(steps):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    xt, yt = _data(999, 4096, dim, classes)
    with torch.no_grad():
        final = float(torch.nn.functional.cross_entropy(model(xt), yt))
        acc = float((model(xt).argmax(dim=1) == yt).float().mean())
    # every rank's model must be the same: DDP keeps them so only if every rank got the same averaged gradients
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.destroy_process_group()
    if rank == 0:
        out.put({"variant": variant, "losses": losses, "final": final, "accuracy": acc, "ranks_identical": same})


def run(world: int, variant: str, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, variant, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"{variant} on {world} ranks: a rank failed ({[p.exitcode for p in procs]})")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nranks", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--compress", default="int8", help="wire format: int8, fp8 or bf16 (default int8)")
    ap.add_argument("--json", help="write every loss curve and figure here")
    ap.add_argument("--plot", help="draw the loss curves (needs matplotlib)")
    args = ap.parse_args(argv)
    variants = ["none", f"{args.compress}+ef", args.compress]
    results = []
    print(f"{'ranks':>5}  {'variant':>10}  {'final':>8}  {'ratio':>7}  {'last20':>8}  {'acc':>6}  same")
    for world in (int(w) for w in args.nranks.split(",")):
        base = None
        for v in variants:
            r = run(world, v, args.steps)
            r["nranks"] = world
            base = r["final"] if v == "none" else base
            r["ratio"] = r["final"] / base
            last = r["losses"][-20:]
            print(f"{world:>5}  {v:>10}  {r['final']:8.4f}  {r['ratio']:7.4f}  {sum(last) / len(last):8.4f}  "
                  f"{r['accuracy']:6.3f}  {r['ranks_identical']}", flush=True)
            results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "compress": args.compress, "runs": results}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        worlds = sorted({r["nranks"] for r in results})
        fig, axes = plt.subplots(2, len(worlds), figsize=(6 * len(worlds), 7), squeeze=False)

        def smooth(v):
            return [sum(v[max(0, i - 9):i + 1]) / len(v[max(0, i - 9):i + 1]) for i in range(len(v))]

        for col, world in enumerate(worlds):
            runs = [r for r in results if r["nranks"] == world]
            base = next(r for r in runs if r["variant"] == "none")["losses"]
            for r in runs:
                label = f"{r['variant']} (held-out {r['final']:.4f})"
                axes[0][col].plot(smooth(r["losses"]), label=label)
                axes[1][col].plot(smooth([a - b for a, b in zip(r["losses"], base)]), label=r["variant"])
            axes[0][col].set_title(f"DDP, {world} CPU ranks: training loss (mean of 10 steps)")
            axes[1][col].set_title(f"{world} ranks: loss minus the uncompressed run's, step by step")
            for ax in axes[:, col]:
                ax.set_xlabel("step")
                ax.legend()
            axes[0][col].set_ylabel("cross-entropy")
            axes[1][col].set_ylabel("difference")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
