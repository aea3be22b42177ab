"""P ranks of gpucoll's own allreduce kernels sharing ONE GPU: what a call costs, and why processes differ.

    python bench/one_gpu.py --json out.json                  # every part below, 2 ranks
    python bench/one_gpu.py --parts virtual,processes --nranks 2 4

Parts (each in its own interpreter, so that no CUDA context outlives its part):
- virtual:   P virtual ranks in one process (gpucoll.testing.virtual_ranks), called directly in one loop: eager
             launches and CUDA-graph replays, time per call from 8 B to 1 MiB; then two-shot at 64 MiB as the bytes it
             moves through this GPU's memory per second (`_twoshot_bytes`; compare with a device copy's GB/s,
             which .ci/gpu's bench phase measures with CUDA events).
- processes: P processes (gpucoll.spawn(backend="custom"), CUDA IPC), time per call at 8 B and 64 KiB.
- mps:       the same processes under the CUDA MPS daemon, started here for the part and stopped after it. Without
             MPS the GPU time-slices between processes' contexts, and kernels that spin on each other's flags wait
             for the slice to turn: the processes part measures that, the mps part what is left without it.

On gpucoll's emulated device (GPUCOLL_CUDA=emulate) every part runs with few iterations to keep this script
working; its times are the emulator's, not a GPU's, and the JSON says so ("emulated": true).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SMALL = [8, 1 << 10, 64 << 10, 1 << 20]


def _emulated() -> bool:
    from gpucoll._native import _C

    return bool(_C.cuda_probe().get("emulated"))


def _twoshot_bytes(nbytes: int, p: int) -> int:
    """Bytes the two-shot kernel reads plus writes in this GPU's memory for one call of `nbytes` per rank, all P
    ranks together: copy-in to staging (N read + N written), reduce-scatter (each rank reads its chunk N/P from P
    stagings and writes it once: N + N/P), all-gather (reads N, writes N into out). Per rank 5N + N/P."""
    return p * (5 * nbytes + nbytes // p)


def part_virtual(nranks: int, emulated: bool) -> dict:
    import numpy as np

    from gpucoll.testing import DeviceArray, virtual_ranks

    iters = 5 if emulated else 2000
    out: dict = {"eager_us": {}, "graph_us": {}, "ok": True}
    with virtual_ranks(nranks, device=0) as vr:
        for size in SMALL if not emulated else SMALL[:2]:
            n = max(1, size // 4)
            xs = [DeviceArray.from_host(np.full(n, r + 1, np.float32)) for r in range(nranks)]
            ys = [DeviceArray.from_host(np.zeros(n, np.float32)) for _ in range(nranks)]
            for _ in range(3):
                vr.all_reduce(xs, outs=ys)
            vr.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                vr.all_reduce(xs, outs=ys)
            vr.synchronize()
            out["eager_us"][size] = (time.perf_counter() - t0) / iters * 1e6
            want = nranks * (nranks + 1) / 2
            out["ok"] &= all(bool((y.to_host() == want).all()) for y in ys)
            with vr.graph_capture() as g:
                vr.all_reduce(xs, outs=ys)
            g.replay(3)
            vr.synchronize()
            t0 = time.perf_counter()
            g.replay(iters)
            vr.synchronize()
            out["graph_us"][size] = (time.perf_counter() - t0) / iters * 1e6
            out["ok"] &= all(bool((y.to_host() == want).all()) for y in ys)
        big = (64 << 20) if not emulated else (1 << 20)
        n = big // 4
        xs = [DeviceArray.from_host(np.full(n, r + 1, np.float32)) for r in range(nranks)]
        ys = [DeviceArray.from_host(np.zeros(n, np.float32)) for _ in range(nranks)]
        reps = 3 if emulated else 50
        for _ in range(2):
            vr.all_reduce(xs, outs=ys, algo="twoshot")
        vr.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            vr.all_reduce(xs, outs=ys, algo="twoshot")
        vr.synchronize()
        us = (time.perf_counter() - t0) / reps * 1e6
        out["ok"] &= all(bool((y.to_host() == nranks * (nranks + 1) / 2).all()) for y in ys)
        moved = _twoshot_bytes(big, nranks)
        out["twoshot"] = {"bytes": big, "us": us, "busbw_GBps": big / us / 1e3 * 2 * (nranks - 1) / nranks,
                          "moved_bytes": moved, "moved_GBps": moved / us / 1e3}
    return out


def _proc_fn(comm, sizes, iters):
    import numpy as np

    from gpucoll.testing import DeviceArray

    res = {}
    for size in sizes:
        n = max(1, size // 4)
        x = DeviceArray.from_host(np.full(n, comm.rank + 1, np.float32))
        y = DeviceArray.from_host(np.zeros(n, np.float32))
        for _ in range(3):
            comm.all_reduce(x, y)
        ok = bool((y.to_host() == comm.world_size * (comm.world_size + 1) / 2).all())
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, y)
        y.to_host()
        res[size] = {"us": (time.perf_counter() - t0) / iters * 1e6, "ok": ok}
    return res


def part_processes(nranks: int, emulated: bool) -> dict:
    import gpucoll

    sizes = [8, 64 << 10]
    iters = 3 if emulated else 200
    per_rank = gpucoll.spawn(_proc_fn, nranks, args=(sizes, iters), backend="custom", device=0, timeout=120.0)
    return {"us": {s: max(r[s]["us"] for r in per_rank) for s in sizes},
            "ok": all(r[s]["ok"] for r in per_rank for s in sizes)}


def _run_part(part: str, nranks: int, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "part.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--_part", part, "--_nranks", str(nranks), "--_out", path]
        p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=240)
        if p.returncode != 0:
            return {"error": (p.stderr or p.stdout)[-1500:]}
        with open(path) as f:
            return json.load(f)


def _with_mps(nranks: int) -> dict:
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        return {"error": "nvidia-cuda-mps-control is not on PATH"}
    tmp = tempfile.mkdtemp(prefix="gpucoll-mps-")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(tmp, "pipe"),
               CUDA_MPS_LOG_DIRECTORY=os.path.join(tmp, "log"))
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    start = subprocess.run([ctl, "-d"], check=False, env=env, capture_output=True, text=True)
    if start.returncode != 0:
        return {"error": f"nvidia-cuda-mps-control -d failed: {start.stderr or start.stdout}"}
    try:
        res = _run_part("processes", nranks, env)
    finally:
        subprocess.run([ctl], check=False, input="quit\n", env=env, capture_output=True, text=True)
        time.sleep(1.0)
    logs = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
    if os.path.exists(logs):
        with open(logs) as f:
            res["mps_log_tail"] = f.read()[-800:]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="virtual,processes,mps")
    ap.add_argument("--nranks", type=int, nargs="+", default=[2])
    ap.add_argument("--json", default=None)
    ap.add_argument("--_part", help=argparse.SUPPRESS)
    ap.add_argument("--_nranks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._part:
        fn = {"virtual": part_virtual, "processes": part_processes}[a._part]
        with open(a._out, "w") as f:
            json.dump(fn(a._nranks, _emulated()), f)
        return 0
    from gpucoll._native import _C

    report = {"emulated": _emulated(), "device": _C.cuda_probe(), "runs": []}
    for p in a.nranks:
        for part in a.parts.split(","):
            t0 = time.perf_counter()
            res = _with_mps(p) if part == "mps" else _run_part(part, p)
            res.update(part=part, nranks=p, seconds=round(time.perf_counter() - t0, 1))
            report["runs"].append(res)
            print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
