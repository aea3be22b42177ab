"""Run a function on N spawned ranks that share an initialised torch.distributed default group.

``run(fn, world_size, *args, backend="gloo")`` starts world_size processes ("spawn" start method, a free loopback
port), initialises ``torch.distributed`` in each with `backend` (None: leave it to `fn`), imports gpucoll.torch,
calls ``fn(rank, world_size, *args)`` and returns the values by rank. A worker's exception comes back to the parent
as an AssertionError carrying every failing rank's traceback; a rank that hangs past `timeout` is terminated and
reported, so a test never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, backend, args, env, results):
    try:
        os.environ.update(env or {})
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world_size)})
        import datetime

        import torch

        torch.set_num_threads(1)  # N ranks on few cores: intra-op threads would only fight
        import torch.distributed as dist

        import gpucoll.torch  # noqa: F401 - registers the backend

        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=60))
        try:
            value = fn(rank, world_size, *args)
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def run(fn, world_size: int, *args, backend="gloo", timeout: float = 120.0, env=None) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, backend, args, env, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.2)
                got[rank] = (status, payload)
                if status != "ok":
                    deadline = min(deadline, time.monotonic() + 20.0)  # let the others report what they saw
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    errors = [f"--- rank {r} ---\n{got[r][1]}" for r in sorted(got) if got[r][0] != "ok"]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        why = f"ranks {missing} did not report (hung or died)\n" if missing else ""
        raise AssertionError(why + "\n".join(errors))
    return [pickle.loads(got[r][1]) for r in range(world_size)]
