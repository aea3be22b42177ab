"""Ranks killed during init: named fast by every survivor, and nothing left behind whatever the kill timing.

* Stage sweep: a victim (rank 0, which serves the store, or the last rank) SIGKILLs itself at each step of the
  host backend's set-up (gpucoll.backends.host._STAGE_HOOK, a seam for tests only) - after registering with the store,
  after publishing its host name, after creating the region (rank 0), after attaching, after init returned.
  Every survivor must raise an error naming it well within the timeout (30 s here): the store names a registered
  rank whose connection closed and whose process is gone; the region's step counters name one that died after.
* Whole-job sweep: the parent SIGKILLs every rank at delays swept across init (measured first); nothing may be
  left in /dev/shm (the region is a memfd with no name; a named segment used to leak in this window).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import statistics
import time

import helpers
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns, *helpers.timeout_mark(300)]

W = 3
TIMEOUT = 30.0
NAMED_WITHIN = 5.0  # seconds from the kill to every survivor's error (the timeout is 30 s)
STAGES = ("build", "registered", "met", "created", "attached", "ready")


def _worker(rank, port, secret, victim, stage, killed_at, stamps, results, timeout):
    import numpy as np

    from gpucoll.backends import host as _backends

    def hook(name):
        stamps[rank * len(STAGES) + STAGES.index(name)] = time.monotonic()
        if rank == victim and name == stage:
            killed_at.value = time.monotonic()
            os.kill(os.getpid(), signal.SIGKILL)

    _backends._STAGE_HOOK = hook
    import gpucoll

    outcome = {"rank": rank}
    try:
        comm = gpucoll.init(rank, W, backend="host", address="127.0.0.1", port=port, timeout=timeout, secret=secret)
        x = np.arange(4, dtype=np.int64)
        comm.all_reduce(x)
        outcome["ok"] = x.tolist()
        comm.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        outcome.update(error=type(exc).__name__, ranks=tuple(getattr(exc, "ranks", ())), message=str(exc),
                       at=time.monotonic())
    results.put(outcome)


def _launch(victim=-1, stage="", timeout=TIMEOUT):
    from gpucoll._spawn import free_port
    from gpucoll.bootstrap.store import new_secret

    ctx = mp.get_context("spawn")
    killed_at = ctx.Value("d", 0.0)
    stamps = ctx.Array("d", W * len(STAGES))
    results = ctx.Queue()
    port, secret = free_port(), new_secret()
    procs = [ctx.Process(target=_worker, args=(r, port, secret, victim, stage, killed_at, stamps, results, timeout))
             for r in range(W)]
    for p in procs:
        p.start()
    return procs, killed_at, stamps, results


def _collect(procs, results, expected):
    out = {}
    deadline = time.monotonic() + TIMEOUT + 30
    while len(out) < expected and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            item = results.get(timeout=1.0)
            out[item["rank"]] = item
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    return out


# Rank 0 serves the store: killed before the others reached it ("build", "registered"), it leaves nothing to tell
# them, and they can only time out naming it (test_rank0_killed_before_anyone_met_it). From "met" on it is named at
# once. "met" and "created" are rank 0's stages only.
CASES = [(0, s) for s in ("met", "created", "attached", "ready")] + \
        [(W - 1, s) for s in ("build", "registered", "attached", "ready")]


@pytest.fixture(scope="module")
def stage_sweep():
    """(victim, stage) -> (survivor outcomes, kill time)."""
    out = {}
    for victim, stage in CASES:
        procs, killed_at, _, results = _launch(victim, stage)
        outcomes = _collect(procs, results, W - 1)
        out[(victim, stage)] = (outcomes, killed_at.value)
    return out


@pytest.mark.parametrize("victim, stage", CASES, ids=[f"kill{v}-{s}" for v, s in CASES])
def test_rank_killed_during_init_is_named_fast(stage_sweep, victim, stage):
    outcomes, killed = stage_sweep[(victim, stage)]
    assert killed > 0, "the victim never reached the stage"
    survivors = [r for r in range(W) if r != victim]
    assert sorted(outcomes) == survivors, outcomes
    problems = []
    for r in survivors:
        o = outcomes[r]
        if "error" not in o:
            problems.append(f"rank {r} finished normally with rank {victim} dead: {o}")
            continue
        if victim not in o["ranks"] or str(victim) not in o["message"]:
            problems.append(f"rank {r} did not name rank {victim}: {o['error']} ranks={o['ranks']} {o['message']}")
        if o["at"] - killed > NAMED_WITHIN:
            problems.append(f"rank {r} named it after {o['at'] - killed:.1f} s")
    assert not problems, helpers.format_failures(problems)


def test_time_to_name_a_rank_killed_during_init(stage_sweep):
    delays = [o["at"] - killed for outs, killed in stage_sweep.values() for o in outs.values() if "at" in o]
    print(f"\ntime to name a rank killed during init ({len(delays)} survivors, {len(stage_sweep)} kills): "
          f"median {statistics.median(delays) * 1e3:.0f} ms, max {max(delays) * 1e3:.0f} ms (timeout {TIMEOUT:g} s)")
    assert max(delays) < NAMED_WITHIN


def test_rank0_killed_before_anyone_met_it():
    """No evidence reaches the others (nothing was listening yet, or was it?): they time out naming rank 0, or
    name it at once if they had connected before it died."""
    timeout = 3.0
    for stage in ("build", "registered"):
        procs, killed_at, _, results = _launch(0, stage, timeout)
        outcomes = _collect(procs, results, W - 1)
        assert killed_at.value > 0 and sorted(outcomes) == [1, 2], outcomes
        for o in outcomes.values():
            assert "error" in o and 0 in o["ranks"], (stage, o)
            assert o["at"] - killed_at.value < timeout + NAMED_WITHIN, (stage, o)


def test_whole_job_killed_across_init_leaves_nothing():
    before = helpers.shm_names()
    procs, _, stamps, results = _launch()
    started = time.monotonic()
    assert all("ok" in o for o in _collect(procs, results, W).values())
    ready = max(stamps[r * len(STAGES) + STAGES.index("ready")] for r in range(W)) - started
    delays = [ready * (i + 1) / 12 for i in range(14)]  # from early start-up to just past init
    pids = []
    for d in delays:
        procs, _, _, _ = _launch()
        pids += [p.pid for p in procs]
        time.sleep(d)
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.join(10)
    # Only this test's processes count (other jobs on the machine may hold segments of their own).
    left = {n for n in helpers.shm_names() - before if any(f"-{pid}-" in n for pid in pids)}
    print(f"\nwhole-job SIGKILL at {len(delays)} times across init ({ready:.2f} s): segments left {len(left)}")
    assert not left, sorted(left)
