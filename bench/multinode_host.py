"""CPU all_reduce across "nodes" of this machine: gpucoll's host backend across machines (shared memory inside a node,
gloo between nodes) against torch.distributed's gloo over every rank, in the same run, on the same cluster.

    python bench/multinode_host.py --nodes 2 --ranks-per-node 2 [--sizes 8,65536,4194304] [--iters 200] [--json F]

Needs root (gpucoll.testing.cluster makes the nodes: network namespaces on veth links). Each rank times the two
engines alternately, size by size; the table shows the median per call over ranks and rounds and the ratio
gloo / gpucoll (above 1: gpucoll faster). The "network" is veth between namespaces of one kernel: no wire, no NIC,
so this compares the engines' work per call and what crosses between nodes, not a real fabric.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time

_RANK = r"""
import json, os, sys, time, datetime
import numpy as np, torch, torch.distributed as dist
import gpucoll
sizes, iters, rounds = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
comm = gpucoll.init(backend="host", timeout=60)
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29600", rank=comm.rank,
                        world_size=comm.world_size, timeout=datetime.timedelta(seconds=60))
out = {}
for n in sizes:
    count = max(1, n // 4)
    x = np.ones(count, np.float32)
    t = torch.from_numpy(x.copy())
    for _ in range(3):  # warm both
        comm.all_reduce(x); dist.all_reduce(t)
    times = {"gpucoll": [], "gloo": []}
    for _ in range(rounds):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        times["gpucoll"].append((time.perf_counter() - t0) / iters)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        times["gloo"].append((time.perf_counter() - t0) / iters)
    out[n] = times
print(json.dumps(out), flush=True)
comm.close(); dist.destroy_process_group()
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sizes", default="8,65536,4194304", help="bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=100, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per engine and size")
    p.add_argument("--json", help="write the per-rank times here")
    a = p.parse_args(argv)
    from gpucoll.testing.cluster import Cluster, unavailable

    why = unavailable()
    if why:
        print(f"cannot make the nodes here: {why}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in a.sizes.split(",")]
    started = time.monotonic()
    with Cluster(a.nodes, a.ranks_per_node) as c:
        results = c.run([sys.executable, "-c", _RANK, json.dumps(sizes), str(a.iters), str(a.rounds)],
                        env={"GPUCOLL_STORE_SECRET": secrets.token_hex(32)}, timeout=1800)
    per_rank = []
    for r in results:
        if r.returncode != 0:
            print(f"rank {r.rank} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        per_rank.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{a.nodes} nodes x {a.ranks_per_node} ranks, float32 all_reduce, median us per call "
          f"({a.rounds} rounds x {a.iters} calls, every rank); {time.monotonic() - started:.0f} s")
    print(f"{'bytes':>10} {'gpucoll':>10} {'gloo':>10} {'gloo/gpucoll':>13}")
    table = []
    for n in sizes:
        g = statistics.median(v for rank in per_rank for v in rank[str(n)]["gpucoll"]) * 1e6
        o = statistics.median(v for rank in per_rank for v in rank[str(n)]["gloo"]) * 1e6
        table.append({"bytes": n, "gpucoll_us": g, "gloo_us": o, "ratio": o / g})
        print(f"{n:>10} {g:>10.1f} {o:>10.1f} {o / g:>13.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "iters": a.iters, "rounds": a.rounds,
                       "table": table, "per_rank": per_rank, "machine": os.uname().nodename}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
