"""Runs the custom allreduce kernels under compute-sanitizer (memcheck, then racecheck) on a small case and exits
non-zero on any report.

    python tests/custom/sanitize_custom.py            # both tools
    python tests/custom/sanitize_custom.py --tool memcheck

The case runs as 2 processes on GPU 0 (gpucoll.spawn(backend='custom')): virtual ranks cannot run under a sanitizer,
which serialises kernel launches, so ranks in one process would wait on each other forever. Every algorithm,
float32 and bfloat16, sum and avg, an odd count, staged and registered inputs (in place too).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def _case_fn(comm):
    import torch

    bad = 0
    for algo in ("oneshot", "twoshot", "ring", "tree"):
        for dtype in (torch.float32, torch.bfloat16):
            for op in ("sum", "avg"):
                x = torch.full((1001,), float(comm.rank + 1), dtype=dtype, device=comm.device)
                comm.all_reduce(x, op=op, algo=algo)
                torch.cuda.synchronize()
                want = 3.0 if op == "sum" else 1.5
                bad += int(not bool((x.float() == want).all()))
    y = torch.ones(513, device=comm.device)
    comm.register(y)
    out = torch.empty_like(y)
    for algo in ("oneshot", "twoshot"):
        comm.all_reduce(y, out, algo=algo)
        torch.cuda.synchronize()
        bad += int(not bool((out == 2).all()))
    comm.all_reduce(y, algo="oneshot")  # registered and in place: the result is held in staging until peers read
    torch.cuda.synchronize()
    return bad + int(not bool((y == 2).all()))


def run_tool(tool: str, timeout: float) -> bool:
    cmd = ["compute-sanitizer", "--tool", tool, "--target-processes", "all", "--error-exitcode", "97",
           sys.executable, __file__, "--case"]
    print("+", " ".join(cmd), flush=True)
    # Every call of the case runs on the custom kernels: without the NCCL fallback no NCCL communicator is set up
    # (and instrumented) in the workers, which only costs time under the tool.
    env = dict(os.environ, GPUCOLL_CUSTOM_NCCL_FALLBACK="0")
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        print(text(e.stdout)[-3000:] + text(e.stderr)[-3000:])
        print(f"{tool}: FAILED (no result within {timeout:g} s)", flush=True)
        return False
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    summaries = re.findall(r"ERROR SUMMARY: (\d+) error", out) + re.findall(r"RACECHECK SUMMARY: (\d+) hazard", out)
    reported = any(int(n) > 0 for n in summaries)
    ok = proc.returncode == 0 and not reported
    print(f"{tool}: {'clean' if ok else 'FAILED'} (exit {proc.returncode}, summaries {summaries})", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=("memcheck", "racecheck"), action="append")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per tool (default 540)")
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        import gpucoll

        bad = sum(gpucoll.spawn(_case_fn, 2, backend="custom", timeout=600.0))
        print(f"wrong results: {bad}")
        return 1 if bad else 0
    if shutil.which("compute-sanitizer") is None:
        print("compute-sanitizer is not on PATH", file=sys.stderr)
        return 2
    results = [run_tool(t, args.timeout) for t in (args.tool or ["memcheck", "racecheck"])]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
