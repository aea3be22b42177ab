"""Fit the host backend's cost model (a per step, b per byte) from measured allreduce times.

    python bench/calibrate_host.py --nranks 2,4 --sizes 4K,64K,1M,16M

Every algorithm runs at every size; each measurement gives one equation
    t = c + a * X + b * Y
where X (synchronisations: pieces * (steps + 1), times ranks/cores when oversubscribed) and Y (bytes moved per
rank, likewise scaled) come from the model itself (gpucoll._C.predict, i.e. the schedule checker's counts),
and c is the fixed per-call cost that all algorithms share. A least-squares fit gives a and b; the defaults in
csrc/select/selector.cc come from this script. It prints the fit, its quality, and how often the model's
choice was the measured best.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import gpucoll
from gpucoll import _C
from gpucoll._help import HelpFormatter


def _measure(comm, sizes, algos):
    out = {}
    for algo in algos:
        for nbytes in sizes:
            x = np.ones(max(nbytes // 4, 1), dtype=np.float32)
            for _ in range(3):
                comm.all_reduce(x, algo=algo)
            iters = max(5, min(300, int(2e7 // max(nbytes, 1))))
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x, algo=algo)
            dt = (time.perf_counter() - t0) / iters
            # The slowest rank's time is the collective's time.
            buf = np.array([dt], dtype=np.float64)
            comm.all_reduce(buf, op="max")
            out[(algo, nbytes)] = float(buf[0])
    return out


def _features(algo, nranks, nbytes):
    x = _C.predict(algo, 0, nranks, nbytes, 0, 1.0, 1e-300)["seconds"]
    y = _C.predict(algo, 0, nranks, nbytes, 0, 1e-300, 1.0)["seconds"]
    return x, y


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--nranks", default="2,4", help="comma-separated world sizes to measure")
    ap.add_argument("--sizes", default="4K,64K,1M,16M", help="comma-separated allreduce sizes (K/M/G suffixes)")
    ap.add_argument("--json", help="write measurements and fit here")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    sizes = [_C.parse_bytes(s) for s in args.sizes.split(",")]
    rows = []
    for p in (int(v) for v in args.nranks.split(",")):
        algos = [a for a in _C.algorithm_names() if _C.algorithm_unusable(a, 0, p, 0, 0) is None]
        times = gpucoll.spawn(_measure, p, args=(sizes, algos))[0]
        for (algo, nbytes), t in times.items():
            x, y = _features(algo, p, nbytes)
            rows.append({"nranks": p, "algo": algo, "bytes": nbytes, "seconds": t, "X": x, "Y": y})
    design = np.array([[1.0, r["X"], r["Y"]] for r in rows])
    # Relative error matters across five orders of magnitude of time: weight each equation by 1/t.
    t = np.array([r["seconds"] for r in rows])
    coef, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    c, a, b = (float(v) for v in coef)
    pred = design @ coef
    rel = np.abs(pred - t) / t
    print(f"fit over {len(rows)} measurements: c = {c * 1e6:.1f} us, a = {a * 1e6:.2f} us/step, "
          f"b = {b * 1e9:.4f} ns/byte; median |error| {np.median(rel) * 100:.0f}%, max {rel.max() * 100:.0f}%")
    hits = total = 0
    worst = 1.0
    for p in sorted({r["nranks"] for r in rows}):
        for nbytes in sizes:
            group = [r for r in rows if r["nranks"] == p and r["bytes"] == nbytes]
            best = min(group, key=lambda r: r["seconds"])
            model = min(group, key=lambda r: a * r["X"] + b * r["Y"])
            total += 1
            hits += best["algo"] == model["algo"]
            worst = max(worst, model["seconds"] / best["seconds"])
            print(f"  P={p} {nbytes:>10} B: measured best {best['algo']:>16} {best['seconds'] * 1e3:8.3f} ms; "
                  f"model picks {model['algo']:>16} {model['seconds'] * 1e3:8.3f} ms")
    print(f"model's pick was the measured best in {hits}/{total} cases; at worst {worst:.2f}x the best's time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fit": {"c": c, "a": a, "b": b}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
