"""Ranks stopped (SIGSTOP/SIGCONT) or killed inside collectives (host backend, 3-4 ranks).

* A rank stopped for less than the timeout: nothing fails, every result is exact.
* A rank stopped for longer than the timeout: the others raise CollectiveTimeout naming it; once resumed it
  reports that it was the late one (its own rank in .ranks, "this rank was late"), never blaming a survivor.
* A rank SIGKILLed at swept moments inside a loop of collectives of every kind and of several pieces: every
  survivor names it, from evidence (its process is gone), within a few seconds of a 30 s timeout.

The signals come from a thread of another rank, which knows every pid after a first all_reduce.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveTimeout, RemoteError

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]


def _pids(comm):
    pids = np.zeros(comm.world_size, np.int64)
    pids[comm.rank] = os.getpid()
    comm.all_reduce(pids)
    return pids


def _signal_later(pid, delay, stop_for=None):
    def run():
        time.sleep(delay)
        if stop_for is None:
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop_for)
        os.kill(pid, signal.SIGCONT)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _loop(comm, calls, sizes=(7, 1003, 300_001)):
    """`calls` matched collectives of every kind; returns (calls made, first wrong result or '')."""
    W, r = comm.world_size, comm.rank
    for i in range(calls):
        n = sizes[i % len(sizes)]
        x = np.arange(n, dtype=np.int64) + r * 1_000_003
        kind = i % 3
        if kind == 0:
            comm.all_reduce(x)
            want = np.arange(n, dtype=np.int64) * W + 1_000_003 * W * (W - 1) // 2
        elif kind == 1:
            x = comm.all_gather(x)
            want = np.concatenate([np.arange(n, dtype=np.int64) + q * 1_000_003 for q in range(W)])
        else:
            comm.broadcast(x, root=i % W)
            want = np.arange(n, dtype=np.int64) + (i % W) * 1_000_003
        if not np.array_equal(x, want):
            return i, f"call {i} gave a wrong result"
    return calls, ""


def _stop_worker(comm, victim, stop_for, calls):
    pids = _pids(comm)
    signaller = _signal_later(int(pids[victim]), 0.3, stop_for) if comm.rank == 0 else None
    started = time.monotonic()
    try:
        made, wrong = _loop(comm, calls)
        comm.barrier()  # whether or not the loop outlasted the stop, the stop falls inside a collective
        return {"calls": made, "wrong": wrong, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"error": type(exc).__name__, "ranks": tuple(getattr(exc, "ranks", ())), "message": str(exc),
                "after": time.monotonic() - started}
    finally:
        if signaller is not None:
            signaller.join()  # the victim is continued before this rank may exit


def test_short_stop_is_harmless():
    res = gpucoll.spawn(_stop_worker, 3, args=(1, 1.0, 300), backend="host", timeout=5.0)
    assert all(r["error"] is None and not r["wrong"] and r["calls"] == 300 for r in res), res


def test_long_stop_blames_the_stopped_rank_everywhere():
    timeout, victim = 2.0, 1
    res = gpucoll.spawn(_stop_worker, 3, args=(victim, 2 * timeout + 1.0, 10**6), backend="host", timeout=timeout)
    problems = []
    for r, out in enumerate(res):
        if out["error"] is None:
            problems.append(f"rank {r} completed everything although rank {victim} was stopped for longer than "
                            f"the timeout")
            continue
        if r != victim:
            if out["error"] != CollectiveTimeout.__name__ or out["ranks"][:1] != (victim,):
                problems.append(f"survivor {r}: {out}")
        elif out["ranks"] != (victim,) or "this rank was late" not in out["message"]:
            problems.append(f"the stopped rank blamed someone else: {out}")
    assert not problems, helpers.format_failures(problems)
    print(f"\nstopped rank's own report: {res[victim]['message']}")


def _kill_worker(comm, victim, killer, delay):
    pids = _pids(comm)
    if comm.rank == killer:
        _signal_later(int(pids[victim]), delay)
    started = time.monotonic()
    try:
        made, wrong = _loop(comm, 10**6)
        return {"error": None, "calls": made, "wrong": wrong}
    except Exception as exc:  # noqa: BLE001
        return {"error": type(exc).__name__, "ranks": tuple(getattr(exc, "ranks", ())), "message": str(exc),
                "at": time.monotonic() - started, "delay": delay}


KILLS = [(victim, delay) for victim in (0, 2) for delay in (0.05, 0.3, 0.9)]


@pytest.mark.parametrize("victim, delay", KILLS, ids=[f"kill{v}-at{d}s" for v, d in KILLS])
def test_kill_inside_collectives_is_named_by_every_survivor(victim, delay):
    killer = 1
    with pytest.raises(RemoteError) as info:
        gpucoll.spawn(_kill_worker, 4, args=(victim, killer, delay), backend="host", timeout=30.0)
    results = info.value.results
    problems = []
    for r, out in enumerate(results):
        if r == victim:
            continue
        if out is None or out["error"] is None:
            problems.append(f"rank {r}: {out}")
            continue
        if out["error"] != CollectiveTimeout.__name__ or out["ranks"][:1] != (victim,):
            problems.append(f"rank {r}: {out['error']} ranks={out['ranks']}: {out['message']}")
        if out["at"] - delay > 5.0:
            problems.append(f"rank {r} named it {out['at'] - delay:.1f} s after the kill")
    assert not problems, helpers.format_failures(problems)


def _stuck_after_the_others(comm):
    comm.barrier()
    if comm.rank == 1:
        threading.Event().wait()  # waits for ever, after every collective (a hung close, a forgotten thread...)
    return comm.rank


def test_a_rank_stuck_after_the_others_returned_is_stopped_with_its_stack(monkeypatch, capfd):
    """spawn does not wait for ever for a rank that outlives the others: `timeout` + a grace after the last of them
    returned it stops it, after the rank printed its threads' stacks, and raises RemoteError naming it."""
    monkeypatch.setattr("gpucoll._spawn._STRAGGLER_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        gpucoll.spawn(_stuck_after_the_others, 3, backend="host", timeout=2.0)
    took = time.monotonic() - start
    assert info.value.ranks == (1,) and "had not returned" in str(info.value), info.value
    assert info.value.results == [0, None, 2]
    assert took < 30, took
    err = capfd.readouterr().err
    assert "_stuck_after_the_others" in err and "most recent call first" in err, err[-3000:]
