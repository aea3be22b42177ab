"""gpucoll.spawn: run a function on N local ranks, each with an initialised Communicator.

Workers are started with multiprocessing's "spawn" method (safe with threads and CUDA), rendezvous on a free
loopback port, and send back their return value or their exception. A worker's exception is re-raised in the
parent as the same exception type with the rank and the worker's traceback attached (``exc.rank``, a note,
and ``exc.results`` with the values of the ranks that did return).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Any, Callable

from gpucoll.errors import GpucollError, InvalidArgument, RemoteError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(fn, rank, nranks, port, backend, timeout, args, init_kwargs, results, env=None):
    try:
        # Before gpucoll (and NCCL, which reads its variables at init) does anything in this process.
        os.environ.update(env or {})
        from gpucoll.communicator import init

        comm = init(rank, nranks, backend=backend, address="127.0.0.1", port=port, timeout=timeout, **init_kwargs)
        try:
            value = fn(comm, *args)
        finally:
            comm.close()
        payload = ("ok", pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exception: send its text
            blob = pickle.dumps(RemoteError(f"{type(exc).__name__}: {exc}", ranks=(rank,)))
        payload = ("error", blob, tb)
    results.put((rank, payload))


def spawn(fn: Callable[..., Any], nranks: int, args: Sequence[Any] = (), backend: str = "auto",
          timeout: float = 300.0, **init_kwargs) -> list:
    """Start `nranks` local processes, call ``fn(comm, *args)`` in each, return the results ordered by rank.

    backend='nccl' gives rank r GPU r; with more ranks than GPUs, ranks share them through NCCL's multi-rank mode
    (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 is set for the workers), and otherwise this raises Unsupported
    saying why. backend='custom' runs gpucoll's own allreduce kernels, ranks sharing GPUs when there are fewer GPUs
    than ranks (CUDA IPC between processes on one device). backend='auto' uses NCCL when that works here, else the
    host backend."""
    if not isinstance(nranks, int) or nranks < 1:
        raise InvalidArgument(f"nranks must be an integer >= 1; got {nranks!r}")
    if not callable(fn):
        raise InvalidArgument(f"fn must be callable; got {type(fn).__name__}")
    worker_env: dict = {}
    if backend in ("auto", "nccl"):
        # Decided here, before any worker starts: a missing GPU or NCCL is one clear error, not N failed ranks.
        # (The CUDA probe initialises the driver in this process, which is safe: workers are spawned, not forked.)
        from gpucoll._nccl_backend import spawn_plan

        backend, worker_env = spawn_plan(nranks, backend)
    elif backend == "custom":
        # Ranks beyond the GPU count share GPUs through CUDA IPC (correct, slow); NCCL, the fallback, may too.
        from gpucoll._custom_backend import spawn_plan as custom_plan

        backend, worker_env = custom_plan(nranks)
    # The job's secret for its rendezvous store: fresh for every spawn, in the workers' environment only (a
    # communicator they create later over the same store finds it there too).
    from gpucoll.bootstrap.store import new_secret

    worker_env = {**worker_env, "GPUCOLL_STORE_SECRET": new_secret()}
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"gpucoll-rank{r}",
                         args=(fn, r, nranks, port, backend, timeout, tuple(args), init_kwargs, results_q,
                               worker_env),
                         daemon=True)
             for r in range(nranks)]
    for p in procs:
        p.start()
    outcome: dict = {}
    first_failure_at = None
    # After a failure the other ranks notice the dead/failed peer within milliseconds; give them until their
    # own timeout to report, then stop them.
    grace = timeout + 10.0
    try:
        while len(outcome) < nranks:
            try:
                rank, payload = results_q.get(timeout=0.05)
                outcome[rank] = payload
                if payload[0] != "ok" and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in outcome and not p.is_alive():
                    # Drain a result that may have been queued just before the exit.
                    try:
                        while True:
                            rank, payload = results_q.get(timeout=0.2)
                            outcome[rank] = payload
                    except queue.Empty:
                        pass
                    if r not in outcome:
                        outcome[r] = ("exited", p.exitcode)
                        if first_failure_at is None:
                            first_failure_at = time.monotonic()
            if first_failure_at is not None and time.monotonic() - first_failure_at > grace:
                break
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    values = [None] * nranks
    failures = []
    for r in range(nranks):
        payload = outcome.get(r, ("killed", None))
        if payload[0] == "ok":
            values[r] = pickle.loads(payload[1])
        else:
            failures.append((r, payload))
    if not failures:
        return values
    raise _pick_failure(failures, values)


def _pick_failure(failures, values):
    """The exception to raise: a worker's own error before a consequence of it (peers timing out, ranks that
    were killed)."""
    def severity(item):
        r, payload = item
        if payload[0] == "error":
            exc = pickle.loads(payload[1])
            consequence = isinstance(exc, GpucollError) and exc.code in (4, 5)  # timeout / remote
            return (1 if consequence else 0, r)
        if payload[0] == "exited":
            return (0, r)
        return (2, r)

    r, payload = min(failures, key=severity)
    if payload[0] == "error":
        exc = pickle.loads(payload[1])
        note = f"[gpucoll.spawn] raised on rank {r}; worker traceback:\n{payload[2]}"
    elif payload[0] == "exited":
        exc = RemoteError(f"rank {r} exited with code {payload[1]} without returning a result", ranks=(r,))
        note = None
    else:
        exc = RemoteError(f"rank {r} did not finish and was terminated", ranks=(r,))
        note = None
    exc.rank = r
    exc.results = values
    exc.failures = {fr: (p[0] if p[0] != "error" else type(pickle.loads(p[1])).__name__) for fr, p in failures}
    if note and hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc
