"""What the cross-rank call check costs: gpucoll-bench --compare unchecked, repeated.

    python bench/call_check_overhead.py                       # 2 and 4 ranks; 8 B, 64 KiB, 16 MiB; 6 runs each
    python bench/call_check_overhead.py --nranks 4 --sizes 8,64K --runs 10 --json out.json
    python bench/call_check_overhead.py --backend custom      # the CUDA kernels' check (virtual ranks on one GPU)

--backend host (default) measures the host backend's check; --backend custom the custom kernels' signature in their
barrier 0 (on gpucoll's emulated device that measures the emulator, not a GPU: say which it was).

Each run is one gpucoll-bench invocation (float32 sum all_reduce, out of place) that times every size 5 times
with the check on and 5 times with it off, alternately, in the same ranks (--compare unchecked: the switch exists
for this measurement only). Pairs taken in turn keep the comparison fair while the machine's speed drifts; the
report gives, per size, the minimum and the median of the checked and unchecked times over all pairs, the median
of the per-pair ratios checked/unchecked - 1 (the overhead) and the load average around the run, since on a
shared 2-core machine the other tenants move every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _iters(nbytes: int) -> tuple[int, int]:
    """(warmup, iters) for about 0.1-0.3 s per timed block on the 2-core machine."""
    if nbytes <= 1 << 10:
        return 200, 3000
    if nbytes <= 256 << 10:
        return 100, 1500
    return 3, 20


def _one_run(nranks: int, nbytes: int, backend: str = "host") -> tuple[list, list]:
    warmup, iters = _iters(nbytes)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "gpucoll.bench", "all_reduce", "--nranks", str(nranks), "-b", str(nbytes),
               "-e", str(nbytes), "-w", str(warmup), "-n", str(iters), "--compare", "unchecked", "--json", out,
               "--backend", backend]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            peer = json.load(f)["results"][0]["peer"]
    return peer["checked_us"], peer["unchecked_us"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", default="8,64K,16M")
    ap.add_argument("--runs", type=int, default=6, help="gpucoll-bench invocations per rank count and size")
    ap.add_argument("--json", default=None, help="write every pair and the summary here")
    ap.add_argument("--backend", choices=("host", "custom"), default="host")
    args = ap.parse_args(argv)
    sizes = [_bytes(s) for s in args.sizes.split(",")]
    doc = {"backend": args.backend, "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}, "rows": []}
    print("# ranks      size   checked us (min / median)   unchecked us (min / median)   overhead: median of "
          "pairs [quartiles], of minima   load")
    for nranks in args.nranks:
        for nbytes in sizes:
            on, off = [], []
            load0 = os.getloadavg()[0]
            t0 = time.time()
            for _ in range(args.runs):
                c, u = _one_run(nranks, nbytes, args.backend)
                on += c
                off += u
            load1 = os.getloadavg()[0]
            pairs = [a / b - 1 for a, b in zip(on, off)]
            q1, _, q3 = statistics.quantiles(pairs, n=4)
            row = {"nranks": nranks, "bytes": nbytes, "checked_us": on, "unchecked_us": off,
                   "overhead_median_of_pairs": statistics.median(pairs), "overhead_pairs_iqr": [q1, q3],
                   "overhead_of_minima": min(on) / min(off) - 1, "load": [load0, load1],
                   "seconds": time.time() - t0}
            doc["rows"].append(row)
            print(f"{nranks:7d} {nbytes:9d}   {min(on):9.2f} / {statistics.median(on):9.2f}       "
                  f"{min(off):9.2f} / {statistics.median(off):9.2f}          {row['overhead_median_of_pairs']:+7.1%}"
                  f" [{q1:+.1%}, {q3:+.1%}]  {row['overhead_of_minima']:+7.1%}     {load0:.1f}-{load1:.1f}", flush=True)
    doc["machine"]["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
