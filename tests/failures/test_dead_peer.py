"""A rank that dies (os._exit) before a collective: every surviving rank raises CollectiveTimeout naming it within
timeout + 5 s instead of hanging, the communicator is unusable afterwards, and nothing named gpucoll* is left in
/dev/shm. A rank that is alive but never arrives turns into a timeout after about `timeout` seconds.

gpucoll.spawn re-raises the dead rank's exit as RemoteError in the parent; the survivors' return values (each
catches its own error and reports it) are in that exception's `.results`.
"""

from __future__ import annotations

import os
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveTimeout, GpucollError, RemoteError

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

TIMEOUT = 5.0  # the communicator's timeout (gpucoll.spawn passes it to init)
SLACK = 5.0  # survivors must report within TIMEOUT + SLACK


@pytest.fixture(autouse=True)
def _default_config(monkeypatch):
    """Workers inherit the environment: keep GPUCOLL_DEBUG_CHECKS (its pre-collective exchange lets every rank see
    the dead one directly) and GPUCOLL_ALGO (it changes who waits on whom) out of these tests."""
    for name in ("GPUCOLL_DEBUG_CHECKS", "GPUCOLL_ALGO"):
        monkeypatch.delenv(name, raising=False)


def _describe(exc, started):
    return {"type": type(exc).__name__, "ranks": tuple(getattr(exc, "ranks", ())), "message": str(exc),
            "elapsed": time.monotonic() - started}


def _dead_peer_worker(comm, dead, count, algo):
    # Every rank learns every pid through a first, successful collective (also proving the set-up worked).
    pids = np.zeros(comm.world_size, np.int64)
    pids[comm.rank] = os.getpid()
    comm.all_reduce(pids)
    if comm.rank == dead:
        os._exit(7)  # no close(), no atexit, no result: the peers must notice on their own
    x = np.ones(count, np.float32)
    started = time.monotonic()
    result = {"pids": pids.tolist()}
    try:
        comm.all_reduce(x, algo=algo)
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = _describe(exc, started)
    # The failed collective leaves ranks out of step: later calls must fail at once, not hang or compute garbage.
    started = time.monotonic()
    try:
        comm.all_reduce(np.ones(4, np.float32))
        result["after"] = None
    except Exception as exc:  # noqa: BLE001
        result["after"] = _describe(exc, started)
    return result


def _wait_for_no_new_shm(before, deadline_s=3.0):
    """gpucoll* names in /dev/shm that were not there before; waits a little because ranks of concurrently
    running tests create segments that exist for milliseconds."""
    deadline = time.monotonic() + deadline_s
    while True:
        new = helpers.shm_names() - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.1)


def _run_dead_peer(world_size, dead, count, algo):
    before = helpers.shm_names()
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        gpucoll.spawn(_dead_peer_worker, world_size, args=(dead, count, algo), backend="host", timeout=TIMEOUT)
    wall = time.monotonic() - started
    exc = info.value
    assert exc.rank == dead, f"spawn blamed rank {exc.rank}, not the dead rank {dead}: {exc}"
    assert dead in exc.ranks and "exited" in str(exc), str(exc)
    results = exc.results
    assert len(results) == world_size and results[dead] is None, results
    leftovers = _wait_for_no_new_shm(before)
    return results, wall, leftovers


@pytest.mark.parametrize(
    "world_size, dead, count, algo",
    [
        (2, 1, 1000, "auto"),
        (3, 0, 2**20 + 3, "auto"),  # rank 0 created the shared memory; a large message dies between pieces
        (4, 2, 1000, "auto"),
        # In a ring, rank 0 never waits on rank 2 directly: it has to learn about it through its neighbours.
        (4, 2, 1000, "ring"),
    ],
    ids=["ws2-dead1", "ws3-dead0-large", "ws4-dead2", "ws4-dead2-ring"],
)
def test_dead_peer_raises_timeout_naming_it(world_size, dead, count, algo):
    results, wall, leftovers = _run_dead_peer(world_size, dead, count, algo)
    problems = []
    for r, res in enumerate(results):
        if r == dead:
            continue
        err = res["error"]
        if err is None:
            problems.append(f"rank {r}: the collective with a dead peer returned normally")
            continue
        if err["type"] != CollectiveTimeout.__name__ or dead not in err["ranks"]:
            problems.append(f"rank {r}: {err['type']} ranks={err['ranks']} ({err['message']}); expected "
                            f"CollectiveTimeout with {dead} in ranks")
        if err["elapsed"] > TIMEOUT + SLACK:
            problems.append(f"rank {r}: noticed the dead peer after {err['elapsed']:.1f} s (> {TIMEOUT + SLACK} s)")
        if str(dead) not in err["message"]:
            problems.append(f"rank {r}: the message does not name rank {dead}: {err['message']}")
        after = res["after"]
        if after is None or after["type"] != "InvalidUsage" or after["elapsed"] > 1.0:
            problems.append(f"rank {r}: a collective after the failure gave {after}; expected an immediate "
                            f"InvalidUsage (broken communicator)")
    assert not problems, helpers.format_failures(problems)
    assert not leftovers, f"left in /dev/shm: {sorted(leftovers)}"
    assert wall < TIMEOUT + SLACK + 20, f"gpucoll.spawn took {wall:.1f} s"


def _late_rank_worker(comm, late, sleep_s):
    if comm.rank == late:
        time.sleep(sleep_s)  # alive, but never enters the collective
        return {"error": None, "late": True}
    started = time.monotonic()
    try:
        comm.all_reduce(np.ones(16, np.float32))
        return {"error": None}
    except Exception as exc:  # noqa: BLE001
        return {"error": _describe(exc, started)}


def test_live_rank_that_never_arrives_times_out():
    timeout = 2.0
    before = helpers.shm_names()
    results = gpucoll.spawn(_late_rank_worker, 2, args=(1, timeout + 1.5), backend="host", timeout=timeout)
    err = results[0]["error"]
    assert err is not None, "rank 0 completed a collective that rank 1 never entered"
    assert err["type"] == "CollectiveTimeout" and 1 in err["ranks"], err
    assert timeout - 0.1 <= err["elapsed"] <= timeout + SLACK, err
    assert not _wait_for_no_new_shm(before)


def _hung_peer_worker(comm, stamp_path):
    if comm.rank == 1:
        time.sleep(600)  # hung: alive, never enters the collective, never returns
    with open(stamp_path, "w") as f:
        f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC is system-wide: the parent can compare it with its own
    comm.all_reduce(np.ones(16, np.float32))  # raises CollectiveTimeout after `timeout`; spawn re-raises it


def test_spawn_with_a_hung_peer_returns_within_the_timeout_and_a_second_or_two(tmp_path):
    """spawn stops a rank that never reports once another rank failed, instead of giving it a timeout of its own
    (it used to return after timeout + 10 s plus 5 s joins per hung rank)."""
    timeout = 3.0
    stamp = tmp_path / "collective_started"
    with pytest.raises(CollectiveTimeout) as info:
        gpucoll.spawn(_hung_peer_worker, 2, args=(str(stamp),), backend="host", timeout=timeout)
    returned = time.monotonic()
    assert info.value.rank == 0 and 1 in info.value.ranks, info.value
    assert info.value.failures == {0: "CollectiveTimeout", 1: "killed"}, info.value.failures
    elapsed = returned - float(stamp.read_text())
    assert timeout - 0.1 <= elapsed <= timeout + 2.5, f"spawn returned {elapsed:.2f} s after the collective began"


def _own_error_worker(comm, bad):
    if comm.rank == bad:
        raise ValueError(f"bad batch on rank {bad}")
    comm.all_reduce(np.ones(16, np.float32))  # fails in turn: rank `bad` closed the communicator


def test_spawn_raises_the_failing_ranks_own_error_not_the_knock_on():
    """Rank 1's ValueError made rank 0's all_reduce fail ("rank 1 closed the communicator", an InvalidArgument
    naming rank 1): spawn raised that, the lower rank's, and the ValueError appeared nowhere."""
    with pytest.raises(ValueError, match="bad batch on rank 1") as info:
        gpucoll.spawn(_own_error_worker, 2, args=(1,), backend="host", timeout=TIMEOUT)
    exc = info.value
    assert type(exc) is ValueError and exc.rank == 1, repr(exc)
    assert exc.failures == {0: "InvalidArgument", 1: "ValueError"}, exc.failures
    note = "".join(getattr(exc, "__notes__", []))
    assert "raised on rank 1 (other ranks: rank 0 InvalidArgument)" in note, note
    assert 'raise ValueError(f"bad batch on rank {bad}")' in note, note  # the worker's traceback


def _first_timeout_worker(comm, late_s):
    if comm.rank == 0:
        time.sleep(late_s)  # rank 1 gives up on it meanwhile
        comm.all_reduce(np.ones(16, np.float32))  # may complete: rank 1's part is there
    comm.all_reduce(np.ones(16, np.float32))  # rank 0: fails, rank 1 having given up (and left)


def test_spawn_raises_the_first_knock_on_when_every_failure_is_one():
    """Rank 1 times out waiting for rank 0 (at `timeout`), then rank 0 arrives and fails in turn: both errors are
    about another rank, and rank 1's came first. spawn raised rank 0's, the lowest rank."""
    timeout = 1.0
    with pytest.raises(GpucollError) as info:
        gpucoll.spawn(_first_timeout_worker, 2, args=(timeout + 0.5,), backend="host", timeout=timeout)
    exc = info.value
    assert set(exc.failures) == {0, 1}, exc.failures
    assert exc.rank == 1 and type(exc) is CollectiveTimeout and "waiting for rank 0" in str(exc), str(exc)
