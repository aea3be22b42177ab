"""gpucoll.spawn: run a function on N local ranks, each with an initialised Communicator.

Workers are started with multiprocessing's "spawn" method (safe with threads and CUDA), rendezvous on a free
loopback port, and send back their return value or their exception. A "spawn" child is a fresh interpreter that
imports the parent's main module again and unpickles `fn` by name, so what cannot work that way is refused in the
parent, before any rank starts, with one error that says what to do: a call reachable from the top level of a main
script without an ``if __name__ == "__main__":`` guard (each child would spawn ranks of its own), and an `fn` the
children cannot import (a lambda, a nested function, a function typed into an interactive session, ``python -c`` or
stdin). A worker's exception is re-raised in the
parent as the same exception type with the rank and the worker's traceback attached (``exc.rank``, a note,
and ``exc.results`` with the values of the ranks that did return).
"""

from __future__ import annotations

import ast
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, Callable

from gpucoll import _timeout
from gpucoll._make import init
from gpucoll.backends import custom, nccl
from gpucoll.bootstrap.store import new_secret
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, InvalidUsage, RemoteError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(fn, rank, nranks, port, backend, timeout, args, init_kwargs, results, env=None):
    try:
        # Before gpucoll (and NCCL, which reads its variables at init) does anything in this process.
        os.environ.update(env or {})
        # spawn asks a rank it is about to stop for being stuck to print every thread's stack first (_stop).
        faulthandler.register(_STACKS_SIGNAL, all_threads=True)
        comm = init(rank, nranks, backend=backend, address="127.0.0.1", port=port, timeout=timeout, **init_kwargs)
        try:
            value = fn(comm, *args)
        finally:
            comm.close()
        payload = ("ok", pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        # The wall clock, not a monotonic one: the parent compares the times of different processes.
        failed_at = time.time()
        tb = traceback.format_exc()
        knock_on = _is_knock_on(exc, rank)  # decided on the real exception, before it may be replaced below
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exception: send its text
            blob = pickle.dumps(RemoteError(f"{type(exc).__name__}: {exc}", ranks=(rank,)))
        payload = ("error", blob, tb, knock_on, failed_at)
    results.put((rank, payload))


def _is_knock_on(exc: BaseException, rank: int) -> bool:
    """Whether `exc`, raised on `rank`, only reports what other ranks did: a peer that failed, exited, closed the
    communicator or never came (CollectiveTimeout, RemoteError, or an error that names other ranks and not this
    one, such as "rank 1 closed the communicator"), or the lost connection to the store rank 0 serves. Such an
    error never hides a rank's own one (a user's exception, a bad argument)."""
    if not isinstance(exc, GpucollError):
        return False
    if isinstance(exc, (CollectiveTimeout, RemoteError)):
        return True
    return bool(exc.ranks) and rank not in exc.ranks


def spawn(fn: Callable[..., Any], nranks: int, args: Sequence[Any] = (), backend: str = "auto",
          timeout: float = 300.0, elastic: bool = False, **init_kwargs) -> list:
    """Start `nranks` local processes, call ``fn(comm, *args)`` in each, return the results ordered by rank.

    backend='nccl' gives rank r GPU r; with more ranks than GPUs, ranks share them through NCCL's multi-rank mode
    (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 is set for the workers), and otherwise this raises Unsupported
    saying why. backend='custom' runs gpucoll's own allreduce kernels, ranks sharing GPUs when there are fewer GPUs
    than ranks (CUDA IPC between processes on one device). backend='auto' uses NCCL when that works here, else the
    host backend.

    A rank that fails stops the others (a second after, so that they report what they saw) and spawn raises
    RemoteError (its ``.results``: the values of the ranks that returned). elastic=True lets the others run on (a
    job that shrinks its communicator and carries on, see Communicator.shrink): spawn waits for every rank, then
    returns or raises as above. Of several failed ranks, spawn raises a rank's own error (its exception, its exit)
    rather than a knock-on of it (a peer that timed out waiting for it, or was told that it failed or closed the
    communicator), and among equals the one that came first. Without elastic, a rank still running `timeout` + 30 s
    after the last of the others returned is stuck (nothing it waits for can come) and is stopped too, raising
    RemoteError. A rank that spawn stops first prints its threads' stacks to its stderr (faulthandler, on
    SIGUSR1)."""
    if not isinstance(nranks, int) or nranks < 1:
        raise InvalidArgument(f"nranks must be an integer >= 1; got {nranks!r}")
    if not callable(fn):
        raise InvalidArgument(f"fn must be callable; got {type(fn).__name__}")
    timeout = _timeout.check(timeout)  # here, not as one refusal per worker
    _check_main_guard()
    _check_sendable(fn, args, init_kwargs)
    worker_env: dict = {}
    if backend in ("auto", "nccl"):
        # Decided here, before any worker starts: a missing GPU or NCCL is one clear error, not N failed ranks.
        # (The CUDA probe initialises the driver in this process, which is safe: workers are spawned, not forked.)
        planned, worker_env = nccl.spawn_plan(nranks, backend)
        # 'auto' that can use NCCL stays 'auto' in the workers, so that their communicators also take CPU buffers
        # (backends/router.py), as init(backend='auto') does; the plan's environment makes NCCL work there.
        backend = "auto" if backend == "auto" and planned == "nccl" else planned
    elif backend == "custom":
        # Ranks beyond the GPU count share GPUs through CUDA IPC (correct, slow); NCCL, the fallback, may too.
        backend, worker_env = custom.spawn_plan(nranks)
    # The job's secret for its rendezvous store: fresh for every spawn, in the workers' environment only (a
    # communicator they create later over the same store finds it there too).
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
    last_result_at = None
    try:
        while len(outcome) < nranks:
            try:
                rank, payload = results_q.get(timeout=0.05)
                outcome[rank] = payload
                last_result_at = time.monotonic()
                if payload[0] != "ok" and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            if (not elastic and first_failure_at is None and last_result_at is not None
                    and time.monotonic() - last_result_at > timeout + _STRAGGLER_GRACE_S):
                # The others returned long ago, so nothing this rank waits for can come (they closed their
                # communicators): it is stuck, and spawn says so instead of waiting for ever.
                for r in range(nranks):
                    outcome.setdefault(r, ("stuck", time.monotonic() - last_result_at, timeout))
                break
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
                        outcome[r] = ("exited", p.exitcode, time.time())
                        if first_failure_at is None:
                            first_failure_at = time.monotonic()
            if not elastic and first_failure_at is not None and time.monotonic() - first_failure_at > _FAILURE_GRACE_S:
                break
    finally:
        _stop(procs, outcome)
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


_GUARD = 'if __name__ == "__main__":'


def _guarded_lines(tree: ast.Module) -> list:
    """Line ranges of the branches of every `if` that tests __name__ (a main guard, either branch)."""
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Name) and n.id == "__name__"
                                            for n in ast.walk(node.test)):
            ranges.append((node.lineno, node.end_lineno))
    return ranges


def _check_main_guard() -> None:
    """Refuse a spawn that each child would run again when it imports the main module (multiprocessing then fails
    in every child with its "bootstrapping phase" error). The outermost frame of the main module's own top-level
    code tells where the call came from; it must be inside a main guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return  # interactive, -c, stdin: the children do not import the main module
    outer = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            outer = frame
        frame = frame.f_back
    if outer is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return  # cannot tell
    line = outer.f_lineno
    if not any(lo <= line <= hi for lo, hi in _guarded_lines(tree)):
        raise InvalidUsage(
            f"gpucoll.spawn is reached from the top level of {path} (line {line}) without a main guard. Each rank is a "
            f"new Python process that imports {os.path.basename(path)} again, so it would run this line too and start "
            f"ranks of its own. Put the code that starts the ranks under `{_GUARD}` (functions the ranks run stay at "
            f"the top level).")


def _check_sendable(fn, args, init_kwargs) -> None:
    """`fn` and its arguments must reach the children: pickled by reference to an importable function."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    where = f"fn={name!r}"
    if getattr(fn, "__name__", None) == "<lambda>" or "<locals>" in str(getattr(fn, "__qualname__", "")):
        raise InvalidArgument(
            f"{where} is a lambda or a function defined inside another function: the ranks are new processes that "
            f"import fn by its module and name, which such functions do not have. Define it with `def` at the top "
            f"level of a module (pass what it needs through args=).")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        # `python -` sets __file__ to "<stdin>": multiprocessing's children would fail to import that path.
        raise InvalidUsage(
            f"gpucoll.spawn cannot start ranks from a program read from {main_file}: each rank is a new Python process "
            f"that imports the main program from its file, and this one has none. Save the program as a .py file "
            f"(calling spawn under `{_GUARD}`) and run that.")
    if getattr(fn, "__module__", None) == "__main__" and main_file is None:
        raise InvalidArgument(
            f"{where} is defined in an interactive session (or python -c): the ranks are new processes that "
            f"import fn from its module, and this session's code exists in no file they can import. Put fn in a .py "
            f"file and import it from there, or run a script that defines it and calls spawn under `{_GUARD}`.")
    for what, value in ((where, fn), ("args", tuple(args)), ("the init keyword arguments", init_kwargs)):
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickling raises many types (PicklingError, TypeError, AttributeError)
            raise InvalidArgument(f"{what} cannot be sent to the spawned ranks (they are new processes and receive it "
                                  f"pickled): {type(e).__name__}: {e}") from None


# After the first failure, how long the other ranks have to report. A rank in a collective with a failed or dead peer
# notices it within milliseconds (the host backend sees a peer's exit; NCCL's watchdog its own timeout, which started
# with the collective); a rank that has not reported by then is hung (in user code, or waiting on a hung peer) and
# is stopped: spawn then returns within the failing rank's timeout plus this grace, not a second timeout.
_FAILURE_GRACE_S = 1.0
# With no failure: how long past the communicator's timeout a rank may go on after the last of the others returned.
_STRAGGLER_GRACE_S = 30.0
# What spawn sends a rank it stops for being stuck, so that the rank prints its stacks (faulthandler) first.
_STACKS_SIGNAL = signal.SIGUSR1


def _stop(procs, outcome) -> None:
    """Join the ranks that reported (they are closing and exiting), stop the others at once, each after it printed
    its threads' stacks to its stderr (faulthandler): where a hung rank waited is the first thing to know."""
    hung = [p for r, p in enumerate(procs) if outcome.get(r, ("stuck",))[0] == "stuck" and p.is_alive()]
    for p in hung:
        try:
            os.kill(p.pid, _STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    if hung:
        time.sleep(0.5)
    deadline = time.monotonic() + 5.0
    for r, p in enumerate(procs):
        if r in outcome and outcome[r][0] != "stuck":
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():  # SIGTERM blocked or ignored
            p.kill()
            p.join(timeout=2.0)


def _pick_failure(failures, values):
    """The exception to raise: a rank's own failure (its exception, its exit, its hang) before a knock-on of one (a
    peer timing out on it, or told that it failed or closed), and either before a rank spawn stopped; among equals
    the one that came first, since what follows a failure is mostly its consequence."""
    def severity(item):
        r, payload = item
        kind = payload[0]
        if kind == "error":
            return (1 if payload[3] else 0, payload[4], r)
        if kind == "exited":
            return (0, payload[2], r)
        if kind == "stuck":
            return (0, float("inf"), r)
        return (2, float("inf"), r)

    r, payload = min(failures, key=severity)
    kinds = {fr: (p[0] if p[0] != "error" else type(pickle.loads(p[1])).__name__) for fr, p in failures}
    if payload[0] == "error":
        exc = pickle.loads(payload[1])
        others = ", ".join(f"rank {fr} {kind}" for fr, kind in kinds.items() if fr != r)
        also = f" (other ranks: {others})" if others else ""
        note = f"[gpucoll.spawn] raised on rank {r}{also}; worker traceback:\n{payload[2]}"
    elif payload[0] == "exited":
        exc = RemoteError(f"rank {r} exited with code {payload[1]} without returning a result", ranks=(r,))
        note = None
    elif payload[0] == "stuck":
        exc = RemoteError(f"rank {r} had not returned {payload[1]:.0f} s after the other ranks did (more than the "
                          f"communicator's timeout of {payload[2]:g} s, plus {_STRAGGLER_GRACE_S:g} s): it was stopped; "
                          f"its threads' stacks, printed to its stderr just before, show where it waited", ranks=(r,))
        note = None
    else:
        exc = RemoteError(f"rank {r} did not finish and was terminated", ranks=(r,))
        note = None
    exc.rank = r
    exc.results = values
    exc.failures = kinds
    if note and hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc
