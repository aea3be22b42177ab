"""async_op=True on the host backend: the collective runs on the communicator's progress thread (csrc/backends/host/
progress.h) while the caller goes on, and a communicator's operations run in the order they were called, whatever
mixes them: asynchronous and synchronous collectives, sends and receives, barriers. Every value is exact (small
integers, distinct per rank and element); what an asynchronous call raises comes out of wait() on every rank, typed,
and a timeout is recorded as a synchronous one is; close() waits for the queue; the buffers of an operation stay
alive until it ran, whoever drops them."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]


def _vals(r: int, n: int, k: int) -> np.ndarray:
    """Rank r's input of the k-th call: distinct per rank, element and call."""
    return ((r + 1) * (np.arange(n) % 7 + 1) + 10 * k).astype(np.float32)


def _in_order(comm):
    """Asynchronous all-reduces interleaved with synchronous collectives, a send/recv pair and a barrier, on one
    communicator: every result exact, so nothing ran out of order (the call check would also have raised)."""
    P, r = comm.world_size, comm.rank
    n = 3000
    works, arrays = [], []
    for k in range(6):
        x = _vals(r, n, k)
        arrays.append(x)
        works.append(comm.all_reduce(x, async_op=True))
        if k == 2:
            y = _vals(r, 5, 100)
            comm.all_reduce(y)  # synchronous, behind three queued ones
            assert np.array_equal(y, sum(_vals(q, 5, 100) for q in range(P)))
        if k == 3:
            g = comm.all_gather(np.full(2, r, np.int64), async_op=True)
            b = np.full(4, r, np.int32)
            if r == 0:
                comm.send(np.arange(4, dtype=np.int32) + 7, 1)
            elif r == 1:
                comm.recv(b, 0)
            comm.barrier()
            works.append(g)
    for w in works:
        assert w.wait() is True
    errs = []
    for k, x in enumerate(arrays):
        if not np.array_equal(x, sum(_vals(q, n, k) for q in range(P))):
            errs.append(f"call {k}")
    if g.result().tolist() != [q for q in range(P) for _ in range(2)]:
        errs.append("all_gather")
    if r == 1 and b.tolist() != [7, 8, 9, 10]:
        errs.append(f"recv {b.tolist()}")
    return errs


@pytest.mark.parametrize("P", (2, 3))
def test_operations_run_in_call_order_and_are_exact(P):
    assert gpucoll.spawn(_in_order, P, backend="host") == [[]] * P


def _goes_on(comm):
    """Rank 1 comes 0.5 s late: rank 0's async call returns at once and is not complete; its callbacks run once it
    is (one registered after runs at once); its buffer stays alive with no reference left but the operation's."""
    r = comm.rank
    if r == 1:
        time.sleep(0.5)
    x = _vals(r, 64, 0)
    t0 = time.perf_counter()
    w = comm.all_reduce(x, async_op=True)
    issued = time.perf_counter() - t0
    early = w.is_completed()
    seen = []
    w.add_done_callback(lambda: seen.append("before"))
    temp = _vals(r, 64, 1)  # the input alone: the Work holds the output as its result
    ref = weakref.ref(temp)
    out = np.zeros(64, np.float32)
    w2 = comm.all_reduce(temp, out=out, async_op=True)
    del temp, w2
    gc.collect()
    alive_meanwhile = ref() is not None or r == 1  # rank 1's may have run by now
    w.wait()
    comm.barrier()  # after the second all_reduce: its buffer is released on the progress thread
    w.add_done_callback(lambda: seen.append("after"))
    gc.collect()
    want = _vals(0, 64, 0) + _vals(1, 64, 0)
    exact = np.array_equal(x, want) and np.array_equal(out, _vals(0, 64, 1) + _vals(1, 64, 1))
    return {"issued_fast": issued < 0.25 if r == 0 else True, "early": early if r == 0 else False,
            "exact": bool(exact), "seen": seen, "alive_meanwhile": alive_meanwhile,
            "released": ref() is None}


def test_the_caller_goes_on_and_the_buffers_live_until_the_operation_ran():
    for r, out in enumerate(gpucoll.spawn(_goes_on, 2, backend="host")):
        assert out == {"issued_fast": True, "early": False, "exact": True, "seen": ["before", "after"],
                       "alive_meanwhile": True, "released": True}, (r, out)


def _mismatch(comm):
    """Ranks make different async calls: wait() raises the call check's InvalidArgument on every rank, and the
    communicator goes on (a mismatch leaves it usable)."""
    r = comm.rank
    w = comm.all_reduce(np.ones(4 + r, np.float32), async_op=True)
    with pytest.raises(InvalidArgument, match="all_reduce"):
        w.wait()
    with pytest.raises(InvalidArgument):
        w.is_completed()
    x = np.full(3, r + 1, np.float32)
    comm.all_reduce(x)
    return x.tolist()


def test_an_async_mismatch_raises_from_wait_on_every_rank():
    assert gpucoll.spawn(_mismatch, 2, backend="host") == [[3.0] * 3] * 2


def _times_out(comm):
    """Rank 1 never makes the call: rank 0's wait() raises CollectiveTimeout naming rank 1, and the communicator
    records the failure as a synchronous call does (the ranks shrink() would drop)."""
    if comm.rank == 1:
        time.sleep(3.0)
        return None
    w = comm.all_reduce(np.ones(4, np.float32), async_op=True)
    with pytest.raises(CollectiveTimeout) as e:
        w.wait()
    time.sleep(0.2)  # the failure is recorded by a callback on the progress thread, after wait() saw the end
    return sorted(e.value.ranks), sorted(comm._failed)


def test_an_async_timeout_names_the_rank_and_is_recorded():
    got = gpucoll.spawn(_times_out, 2, backend="host", timeout=1.0, elastic=True)
    assert got[0] == ([1], [1]), got


def _close_waits(comm):
    """close() right after an async call waits for it: rank 0's result is there after close."""
    r = comm.rank
    if r == 1:
        time.sleep(0.5)
    x = _vals(r, 32, 0)
    comm.all_reduce(x, async_op=True)
    comm.close()
    return bool(np.array_equal(x, _vals(0, 32, 0) + _vals(1, 32, 0)))


def test_close_runs_the_queued_operations_first():
    assert gpucoll.spawn(_close_waits, 2, backend="host") == [True, True]


def _aborts(comm):
    """abort() does not wait for issued operations: the one waiting for rank 1 (which never comes) and the one
    queued behind it both raise InvalidUsage naming the abort, within a wait slice, long before the timeout."""
    if comm.rank == 1:
        time.sleep(2.0)
        return None
    running = comm.all_reduce(np.ones(4, np.float32), async_op=True)
    queued = comm.all_reduce(np.ones(4, np.float32), async_op=True)
    time.sleep(0.2)
    t0 = time.perf_counter()
    aborting = threading.Thread(target=comm.abort)  # abort() then closes, and rank 0's store waits for its peers
    aborting.start()
    messages = []
    for w in (running, queued):
        with pytest.raises(InvalidUsage, match="abort") as e:
            w.wait()
        messages.append(str(e.value))
    took = time.perf_counter() - t0
    aborting.join()
    return took, messages


def test_abort_does_not_wait_for_issued_operations():
    (took, (running, queued)), _ = gpucoll.spawn(_aborts, 2, backend="host", timeout=60.0, elastic=True)
    assert took < 1.0, took
    assert "was aborted while it waited for rank 1" in running, running
    assert "aborted communicator" in queued, queued
