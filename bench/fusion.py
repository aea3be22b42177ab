"""Tensor fusion (issue 32): many small all-reduces, one call each against one coalesced call, against one large one.

    python bench/fusion.py                                   # 4 ranks, 1000 x 1 KiB float32, 7 rounds
    python bench/fusion.py --nranks 2 --arrays 1000 --bytes 1024 --rounds 9 --json out.json

Host backend, P ranks (gpucoll.spawn), float32, sum, in place. In each round every rank times, one after the other in
the same processes:
- separate: `arrays` all-reduces of `bytes` each, one `comm.all_reduce(a)` per array (today's way: the baseline);
- coalesced: the same arrays in one `comm.all_reduce_coalesced(arrays)`;
- views: the same sizes as consecutive views of one buffer (the zero-copy path: no staging copy);
- one: a single `comm.all_reduce(x)` of `arrays * bytes` (what fusion should approach).
A round's time is its slowest rank's (each variant runs `reps` times between barriers). Reported: the best and the
median round of each, and the ratios of the best rounds coalesced/one (target <= 1.5) and separate/one. Every result
is checked exactly (integer-valued inputs). On the 2-core machine 4 ranks oversubscribe the cores: the ratios from
one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def _rank(comm, rounds: int, n_arrays: int, nbytes: int, reps: int) -> dict:
    P, r = comm.world_size, comm.rank
    n = max(1, nbytes // 4)
    arrays = [np.full(n, r + 1, np.float32) for _ in range(n_arrays)]
    flat = np.full(n * n_arrays, r + 1, np.float32)
    views = [flat[i * n:(i + 1) * n] for i in range(n_arrays)]
    one = np.full(n * n_arrays, r + 1, np.float32)

    def separate():
        for a in arrays:
            comm.all_reduce(a)

    def coalesced():
        comm.all_reduce_coalesced(arrays)

    def coalesced_views():
        comm.all_reduce_coalesced(views)

    def single():
        comm.all_reduce(one)

    variants = [("separate", separate), ("coalesced", coalesced), ("views", coalesced_views), ("one", single)]
    out = {k: [] for k, _ in variants}
    ok = True
    for _ in range(rounds):
        for key, fn in variants:
            for a in (*arrays, flat, one):
                a.fill(r + 1)
            fn()  # warm, and the checked call
            want = float(P * (P + 1) // 2)
            ok = ok and all(bool((a == want).all()) for a in ({"separate": arrays, "coalesced": arrays,
                                                               "views": [flat], "one": [one]}[key]))
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[key].append((time.perf_counter() - t0) / reps * 1e3)
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nranks", type=int, default=4)
    ap.add_argument("--arrays", type=int, default=1000)
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import gpucoll

    per_rank = gpucoll.spawn(_rank, a.nranks, args=(a.rounds, a.arrays, a.bytes, a.reps), backend="host",
                             timeout=600.0)
    keys = ("separate", "coalesced", "views", "one")
    rows = {k: [max(r[k][i] for r in per_rank) for i in range(a.rounds)] for k in keys}
    best = {k: min(v) for k, v in rows.items()}
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {"backend": "host", "dtype": "float32", "nranks": a.nranks, "arrays": a.arrays, "bytes_each": a.bytes,
              "rounds": a.rounds, "reps": a.reps, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
              "ok": all(r["ok"] for r in per_rank), "ms_per_call": rows, "best_ms": best, "median_ms": med,
              "coalesced_over_one": best["coalesced"] / best["one"], "views_over_one": best["views"] / best["one"],
              "separate_over_one": best["separate"] / best["one"],
              "separate_over_coalesced": best["separate"] / best["coalesced"],
              "target": "coalesced_over_one <= 1.5 (issue 32)"}
    for k in keys:
        print(f"{k:9s} best {best[k]:8.3f} ms   median {med[k]:8.3f} ms")
    print(f"coalesced/one {report['coalesced_over_one']:.2f}  views/one {report['views_over_one']:.2f}  "
          f"separate/one {report['separate_over_one']:.1f}  ok={report['ok']}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
