"""The figures of .ci/gpu's bench phase, each a ratio of two things measured in the same run on the same GPU:

    small_messages  the custom kernels against NCCL at P = 2, 8 B to 256 KiB (gpucoll-bench; NCCL where this machine
                    can put 2 NCCL ranks on its GPUs), and the custom kernels in 2 processes (gpucoll.spawn)
    two_shot_64MiB  the two-shot kernel at 64 MiB, P = 2 on one GPU: the bytes both ranks read and write in the GPU's
                    memory per second, against a device-to-device copy of 64 MiB (its roofline on one GPU)
    nccl_vs_torch   gpucoll's NCCL path against torch's ProcessGroupNCCL, same NCCL, same sizes, 1 rank
    dispatch        host time per call, enqueue only: gpucoll (nccl backend) against torch's ProcessGroupNCCL and
                    against one bare kernel launch
    recorder_cost   the custom kernels at 8 B, P = 2 on one GPU, with their flight recorder on (the default) against
                    off (GPUCOLL_TRACE_BUFFER=0), runs alternating
    calibration     gpucoll-tune --calibrate at P = 2 (up to 30 s): the model's error on the measured sizes before its
                    tuning file and with it

Every measurement runs in its own process, so that a crash is a named problem rather than the end of the phase.
On gpucoll's emulated device the same code paths run at small sizes and every result is checked, but no timing is
reported: it would time the emulator, not a GPU.

    python .ci/gpu_bench.py --out DIR --result FILE [--seconds N] [--emulated]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_GPU = "emulated device: its timings are the emulator's, not a GPU's"


def _bench(args: list, json_path: Path, timeout: float, plot: Path | None = None, env=None) -> tuple:
    """gpucoll-bench all_reduce with `args` (and `env` over this process's); (rows, problem or '')."""
    cmd = [sys.executable, "-X", "faulthandler", "-m", "gpucoll.bench", "all_reduce", *args, "--json", str(json_path)]
    if plot is not None:
        cmd += ["--plot", str(plot)]
    print("$", " ".join(cmd[3:]), flush=True)
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                             env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return [], f"gpucoll-bench {' '.join(args)} timed out after {timeout:.0f} s"
    print(res.stdout[-6000:], res.stderr[-3000:], flush=True)
    if res.returncode != 0:
        return [], f"gpucoll-bench {' '.join(args)} exited {res.returncode}: {(res.stderr or res.stdout)[-600:]}"
    runs = json.loads(json_path.read_text())
    rows = [row for run in (runs if isinstance(runs, list) else [runs]) for row in run.get("results", [])]
    wrong = [r for r in rows if any((r.get(k) or {}).get("wrong") for k in ("out_of_place", "in_place"))]
    if wrong:
        return rows, f"gpucoll-bench {' '.join(args)}: wrong elements at sizes {[r['size'] for r in wrong]}"
    return rows, ""


def _worker(name: str, timeout: float, *extra) -> tuple:
    """Runs `python .ci/gpu_bench.py --worker name`; (its JSON, problem or '')."""
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--worker", name, *map(str, extra)]
    print("$ worker", name, flush=True)
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {}, f"{name}: timed out after {timeout:.0f} s"
    print(res.stdout[-4000:], res.stderr[-4000:], flush=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return (json.loads(lines[-1]) if lines else {}), f"{name}: exit {res.returncode}: {res.stderr[-1500:]}"
    return json.loads(lines[-1]), ""


def _time_of(rows, backend: str, size: int):
    for r in rows:
        if r.get("backend") == backend and int(r["size"]) == size:
            return float(r["out_of_place"]["time"])
    return None


# -- workers (each in its own process) --------------------------------------------------------------------------------

def _custom_processes_fn(comm, sizes, iters):
    import numpy as np

    from gpucoll.testing import DeviceArray

    out = {}
    for size in sizes:
        n = max(1, size // 4)
        x = DeviceArray.from_host(np.full(n, comm.rank + 1, np.float32))
        y = DeviceArray.from_host(np.zeros(n, np.float32))
        for _ in range(max(3, iters // 10)):
            comm.all_reduce(x, y)
        want = float(comm.world_size * (comm.world_size + 1) // 2)
        ok = bool((y.to_host() == want).all())
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, y)
        y.to_host()  # cudaMemcpy on the legacy stream: waits for the kernels (DeviceArray's rule)
        us = (time.perf_counter() - t0) / iters * 1e6
        # In place, sync, algo auto: the one native call (CustomComm.all_reduce_array); max keeps the values fixed.
        z = DeviceArray.from_host(np.full(n, comm.rank + 1, np.float32))
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(z, op="max")
        got = z.to_host()
        out[size] = {"us": us, "in_place_us": (time.perf_counter() - t0) / iters * 1e6,
                     "ok": ok and bool((got == float(comm.world_size)).all())}
    return out


def worker_custom_processes(emulated: bool) -> dict:
    import gpucoll

    sizes = [8, 1024, 64 << 10, 256 << 10] if not emulated else [8, 1024]
    iters = 5 if emulated else 300
    results = gpucoll.spawn(_custom_processes_fn, 2, args=(sizes, iters), backend="custom", device=0,
                            timeout=120.0)
    return {"sizes": sizes, "per_rank": results}


def worker_nccl_torch(emulated: bool) -> dict:
    """gpucoll's nccl backend and torch's ProcessGroupNCCL, 1 rank each, in this one process."""
    import numpy as np

    import gpucoll
    from gpucoll._spawn import free_port

    sizes = [8, 64 << 10, 16 << 20] if not emulated else [8, 1024]
    iters = 5 if emulated else 500
    comm = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=60)
    out = {"world_size": 1, "gpucoll": {}, "torch": {}, "launch": {}}
    torch = None
    if not emulated:
        import torch
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    for size in sizes:
        n = max(1, size // 4)
        if torch is None:
            from gpucoll.testing import DeviceArray

            x = DeviceArray.from_host(np.full(n, 3, np.float32))
            for _ in range(iters):
                comm.all_reduce(x)
            out["gpucoll"][size] = {"ok": bool((x.to_host() == 3).all())}
            continue
        x = torch.full((n,), 3.0, device="cuda")
        for name, call in (("gpucoll", lambda x=x: comm.all_reduce(x)), ("torch", lambda x=x: dist.all_reduce(x))):
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            enq = time.perf_counter() - t0
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            out[name][size] = {"us": total / iters * 1e6, "enqueue_us": enq / iters * 1e6,
                               "ok": bool((x == 3).all())}
    if torch is not None:
        x = torch.zeros(2, device="cuda")
        for _ in range(20):
            x.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            x.add_(1)
        out["launch"] = {"enqueue_us": (time.perf_counter() - t0) / iters * 1e6}
        torch.cuda.synchronize()
        dist.destroy_process_group()
    comm.close()
    return out


def worker_copy(emulated: bool) -> dict:
    """Device-to-device copy of 64 MiB: GB/s counting bytes read plus written (as shared/FACTS.md does)."""
    if emulated:
        return {"skipped": NOT_GPU}
    import torch

    n = 64 << 20
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(5):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 50
    for _ in range(reps):
        b.copy_(a)
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1e3 / reps
    return {"bytes": n, "us": secs * 1e6, "GBps_read_plus_write": 2 * n / secs / 1e9}


WORKERS = {"custom_processes": worker_custom_processes, "nccl_torch": worker_nccl_torch, "copy": worker_copy}


# -- the figures ------------------------------------------------------------------------------------------------------

def nccl_pair_problem() -> str:
    """Why 2 NCCL ranks cannot run on this machine's GPUs (gpucoll.spawn's own verdict), or ''."""
    from gpucoll.backends import nccl
    from gpucoll.errors import Unsupported

    try:
        nccl.spawn_plan(2, "nccl")
    except Unsupported as e:
        return f"no NCCL figure at P = 2: {e}"
    return ""


def _calibration(emulated: bool, nccl_why: str, tmp: Path, seconds: float, problems: list) -> dict:
    """gpucoll-tune --calibrate on this GPU (P = 2, the detected topology): the model's error on the sizes it
    measured before its tuning file and with it (issue 34's 'a calibration a user can run in a minute'). Last and
    with what is left of the budget, up to 30 s; tests/topo/test_calibrate.py checks the mechanics on the emulator."""
    fig = {"what": "gpucoll-tune --calibrate, P = 2 on one GPU, the detected topology: the model's median and worst "
                   "error on the measured sizes before the tuning file and with it, and the wall time used"}
    if emulated:
        fig["skipped"] = NOT_GPU + " (tests/topo/test_calibrate.py runs it there)"
        return fig
    if seconds < 10:
        fig["skipped"] = f"{seconds:.0f} s of the budget left (needs 10)"
        return fig
    out = tmp / "calibration.json"
    cmd = [sys.executable, "-X", "faulthandler", "-c", "import sys; from gpucoll.cli.tune import main; sys.exit(main())",
           "--calibrate", "--seconds", f"{seconds:.0f}", "--nranks", "2", "--backend", "custom" if nccl_why else "auto",
           "-o", str(out)]
    print("$ gpucoll-tune", " ".join(cmd[5:]), flush=True)
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 60, check=False)
    except subprocess.TimeoutExpired:
        problems.append(f"gpucoll-tune --calibrate --seconds {seconds:.0f} ran past {seconds + 60:.0f} s")
        return fig
    print(res.stdout[-6000:], res.stderr[-3000:], flush=True)
    if not out.exists():
        problems.append(f"gpucoll-tune --calibrate exited {res.returncode}: {(res.stderr or res.stdout)[-600:]}")
        return fig
    cal = json.loads(out.read_text())["calibration"]
    b, f = cal["error_before"], cal["error_after"]
    fig.update(budget_s=cal["budget_s"], wall_s=cal["wall_s"], rounds=cal["rounds"], before=b, after=f,
               fits=sorted(json.loads(out.read_text())["fits"]), exit=res.returncode)
    if b["median"] is not None:
        fig["summary"] = (f"median {b['median'] * 100:.0f}% / worst {b['max'] * 100:.0f}% before, median "
                          f"{f['median'] * 100:.1f}% / worst {f['max'] * 100:.1f}% after ({cal['wall_s']:.0f} s)")
    return fig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--result", type=Path)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--emulated", action="store_true")
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("rest", nargs="*")
    a = p.parse_args()
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a.emulated), default=str))
        return
    end = time.time() + a.seconds
    figures, problems = {}, []

    def left(share: float) -> float:
        return max(10.0, min(share, end - time.time()))

    tmp = Path(tempfile.mkdtemp(prefix="gpucoll-ci-bench-"))
    nccl_why = nccl_pair_problem()
    small = ["-b", "8", "-e", "4K" if a.emulated else "256K", "-f", "4", "--nranks", "2",
             "-n", "3" if a.emulated else "200", "-w", "1" if a.emulated else "20",
             "--backend", "custom" if nccl_why else "custom,nccl"]
    rows, why = _bench(small, a.out / "bench.json", left(90), plot=a.out / "bench.png")
    problems += [why] if why else []
    fig = {"what": "all_reduce float32 sum, out of place, P = 2 on one GPU: custom kernels (virtual ranks) and NCCL; "
                   "time per call in us", "nccl": nccl_why or "measured"}
    if a.emulated:
        fig["skipped"] = NOT_GPU
    elif rows:
        sizes = sorted({int(r["size"]) for r in rows})
        fig["rows"] = [{"bytes": s, "custom_us": _time_of(rows, "custom", s), "nccl_us": _time_of(rows, "nccl", s)}
                       for s in sizes]
        for r in fig["rows"]:
            if r["custom_us"] and r["nccl_us"]:
                r["custom_over_nccl"] = round(r["custom_us"] / r["nccl_us"], 3)
        t8 = fig["rows"][0]
        fig["summary"] = (f"custom {t8['custom_us']:.1f} us at {t8['bytes']} B"
                          + (f", {t8['custom_over_nccl']}x NCCL's" if "custom_over_nccl" in t8 else f"; {nccl_why}"))
    procs, why = _worker("custom_processes", left(90), *(["--emulated"] if a.emulated else []))
    problems += [why] if why else []
    if procs:
        per_rank = procs.get("per_rank") or []
        bad = [(r, s) for r, res in enumerate(per_rank) for s, v in res.items() if not v["ok"]]
        if bad:
            problems.append(f"custom kernels in 2 processes: wrong results (rank, bytes) {bad}")
        if not a.emulated and per_rank:
            fig["processes_us"] = {str(s): round(max(res[str(s)]["us"] for res in per_rank), 2)
                                   for s in procs["sizes"]}
            fig["processes_in_place_us"] = {str(s): round(max(res[str(s)]["in_place_us"] for res in per_rank), 2)
                                            for s in procs["sizes"]}
    figures["small_messages"] = fig

    rows, why = _bench(["-b", "1M" if a.emulated else "64M", "-e", "1M" if a.emulated else "64M", "--nranks", "2",
                        "--backend", "custom", "--algo", "twoshot", "-n", "2" if a.emulated else "20",
                        "-w", "1" if a.emulated else "5"], tmp / "twoshot.json", left(60))
    problems += [why] if why else []
    copy, why = _worker("copy", left(30), *(["--emulated"] if a.emulated else []))
    problems += [why] if why else []
    fig = {"what": "two-shot all_reduce at 64 MiB, P = 2 on one GPU: bytes both ranks read plus write in the GPU's "
                   "memory per second (P x (5N + N/P): copy-in, reduce-scatter, all-gather), against a 64 MiB "
                   "device-to-device copy (GB/s counting bytes read plus written)"}
    if a.emulated:
        fig["skipped"] = NOT_GPU
    elif rows and copy.get("GBps_read_plus_write"):
        n, p = 64 << 20, 2
        us = float(rows[0]["out_of_place"]["time"])
        moved = p * (5 * n + n // p) / us / 1e3
        fig.update(busbw_GBps=round(float(rows[0]["out_of_place"]["bus_bw"]), 1), moved_GBps=round(moved, 1),
                   copy_GBps=round(copy["GBps_read_plus_write"], 1),
                   ratio=round(moved / copy["GBps_read_plus_write"], 4))
        fig["summary"] = (f"busbw {fig['busbw_GBps']:.0f} GB/s; moves {moved:.0f} GB/s through the GPU's memory = "
                          f"{fig['ratio']:.3f} x the copy's {fig['copy_GBps']:.0f} GB/s")
    figures["two_shot_64MiB"] = fig

    nt, why = _worker("nccl_torch", left(90), *(["--emulated"] if a.emulated else []))
    problems += [why] if why else []
    bad = [f"{k} {s}" for k in ("gpucoll", "torch") for s, v in (nt.get(k) or {}).items() if not v.get("ok")]
    if bad:
        problems.append(f"nccl vs torch: wrong results in {bad}")
    fig = {"what": "all_reduce float32 sum in place, 1 rank, the same NCCL: gpucoll's nccl backend against torch's "
                   "ProcessGroupNCCL; time per call with the device's work (us)"}
    disp = {"what": "host time per all_reduce call, enqueue only, 8 B, 1 rank: gpucoll (nccl backend) against torch's "
                    "ProcessGroupNCCL and against one bare kernel launch (torch add_)"}
    if a.emulated:
        fig["skipped"] = disp["skipped"] = NOT_GPU + "; torch has no CUDA there"
    elif nt.get("gpucoll") and nt.get("torch"):
        fig["rows"] = [{"bytes": int(s), "gpucoll_us": round(v["us"], 2), "torch_us": round(nt["torch"][s]["us"], 2),
                        "gpucoll_over_torch": round(v["us"] / nt["torch"][s]["us"], 3)}
                       for s, v in nt["gpucoll"].items()]
        fig["summary"] = ", ".join(f"{r['bytes']} B {r['gpucoll_over_torch']}x" for r in fig["rows"])
        g8, t8 = nt["gpucoll"][min(nt["gpucoll"], key=int)], nt["torch"][min(nt["torch"], key=int)]
        launch = nt.get("launch", {}).get("enqueue_us")
        disp.update(gpucoll_us=round(g8["enqueue_us"], 2), torch_us=round(t8["enqueue_us"], 2),
                    launch_us=round(launch, 2) if launch else None,
                    gpucoll_over_torch=round(g8["enqueue_us"] / t8["enqueue_us"], 3))
        disp["summary"] = (f"gpucoll {disp['gpucoll_us']} us, torch {disp['torch_us']} us, bare launch "
                           f"{disp['launch_us']} us per call")
    figures["nccl_vs_torch"] = fig
    figures["dispatch"] = disp

    # The kernels' flight recorder (a device ring block 0 writes, and the arrival views barrier 0 carries): on and
    # off alternate, so that drift of the GPU's clocks falls on both alike.
    times: dict = {"on": [], "off": []}
    for i in range(2 if a.emulated else 4):
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            rows, why = _bench(["-b", "8", "-e", "8", "--nranks", "2", "--backend", "custom",
                                "-n", "3" if a.emulated else "2000", "-w", "1" if a.emulated else "200"],
                               tmp / f"recorder-{name}-{i}.json", left(30),
                               env={"GPUCOLL_TRACE_BUFFER": "2000" if name == "on" else "0"})
            problems += [why] if why else []
            t = _time_of(rows, "custom", 8)
            if t:
                times[name].append(t)
    fig = {"what": "all_reduce float32 sum of 8 B, P = 2 virtual ranks on one GPU, custom kernels: time per call with "
                   "the kernels' flight recorder on (GPUCOLL_TRACE_BUFFER=2000) over off (0), medians of alternating "
                   "runs"}
    if a.emulated:
        fig["skipped"] = NOT_GPU
    elif times["on"] and times["off"]:
        on, off = sorted(times["on"])[len(times["on"]) // 2], sorted(times["off"])[len(times["off"]) // 2]
        fig.update(on_us=round(on, 2), off_us=round(off, 2), on_over_off=round(on / off, 4),
                   runs={k: [round(v, 2) for v in vs] for k, vs in times.items()})
        fig["summary"] = f"on {on:.2f} us, off {off:.2f} us per call: {on / off:.4f}x"
    figures["recorder_cost"] = fig

    figures["calibration"] = _calibration(a.emulated, nccl_why, tmp, min(30.0, end - time.time() - 8), problems)
    a.result.write_text(json.dumps({"figures": figures, "problems": problems}, indent=1, default=str))
    for pr in problems:
        print("PROBLEM:", pr, flush=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(ROOT))
    main()
