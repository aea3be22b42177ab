"""One Work type: every backend's async_op=True call (host, nccl, custom) and a call that finished before it returned
hand back gpucoll.Work, which is gpucoll._C.Work (csrc/python/work.cc). On each backend, ranks run an asynchronous
all_reduce into an output pre-filled with a sentinel, and its wait(), is_completed(), synchronize() and result()
behave as documented, with every value exact (small integers). nccl and custom run on a GPU, or on gpucoll's
emulated device (@pytest.mark.gpu)."""

from __future__ import annotations

import threading

import gpu_arrays
import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import InvalidUsage, Unsupported

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

N = 1000
SENTINEL = -7777


def _vals(r: int, k: int) -> np.ndarray:
    """Rank r's input of the k-th call: distinct per rank, element and call, and exact in float32."""
    return ((r + 1) * (np.arange(N) % 13 + 1) + 100 * k).astype(np.float32)


def _want(world: int, k: int) -> np.ndarray:
    return sum(_vals(q, k) for q in range(world))


def _check_type(work, what: str, errs: list) -> None:
    if type(work) is not gpucoll.Work or gpucoll.Work is not _C.Work:
        errs.append(f"{what}: {type(work).__qualname__}, not gpucoll.Work")


def _host_round(comm):
    """The host backend: a Work of the progress thread (wait blocks until done; a callback runs once it ended), and
    a call inside a group, which runs before it returns: a completed Work of the same type."""
    errs, P, r = [], comm.world_size, comm.rank
    x, out = _vals(r, 0), np.full(N, SENTINEL, np.float32)
    work = comm.all_reduce(x, out=out, async_op=True)
    _check_type(work, "host async all_reduce", errs)
    ended = threading.Event()
    work.add_done_callback(ended.set)  # runs on the progress thread once the operation ended
    if work.result() is not out:
        errs.append("result() is not the output")
    if work.wait() is not True:
        errs.append("wait() did not return True")
    if not np.array_equal(out, _want(P, 0)):  # wait() blocked until the progress thread had written it
        errs.append(f"after wait(): {out[:4]} (sentinel {SENTINEL} where nothing was written)")
    if not (work.is_completed() and work.done() and work.synchronize() is None and ended.wait(10)):
        errs.append(f"after wait(): is_completed/done/synchronize/callback: {work!r} {ended.is_set()}")
    if work.seq is not None or "completed" not in repr(work):
        errs.append(f"host Work: seq {work.seq}, repr {work!r}")
    y = _vals(r, 1)
    with comm.group():
        inline = comm.all_reduce(y, async_op=True)  # the host backend runs collectives of a group at once
    _check_type(inline, "completed Work", errs)
    if not (inline.is_completed() and inline.wait() is True and inline.result() is y
            and np.array_equal(y, _want(P, 1)) and repr(inline) == "<gpucoll.Work completed>"):
        errs.append(f"completed Work: {inline!r} {y[:4]}")
    return errs


def test_host_async_and_completed_calls_return_the_one_work_type():
    assert gpucoll.spawn(_host_round, 3, backend="host") == [[]] * 3


def _gpu_round(comm):
    """A GPU backend: wait() orders the caller's stream (the legacy one for a DeviceArray) after the collective, so a
    copy to the host issued after it reads the result; synchronize() blocks the host; a host callback is refused; on
    nccl, a Work of a group that is still open is not completed and cannot be waited for."""
    from gpucoll.testing import DeviceArray

    errs, P, r = [], comm.world_size, comm.rank
    dev = int(comm.device.split(":")[1])
    outs, works = [], []
    for k in range(3):
        x = DeviceArray.from_host(_vals(r, k), device=dev)
        out = DeviceArray.from_host(np.full(N, SENTINEL, np.float32), device=dev)
        work = comm.all_reduce(x, out=out, async_op=True)
        _check_type(work, f"{comm.backend} async all_reduce", errs)
        if work.result() is not out:
            errs.append(f"call {k}: result() is not the output")
        outs.append(out)
        works.append(work)
    if works[0].wait() is not True:
        errs.append("wait() did not return True")
    got = outs[0].to_host()  # on the legacy stream, which wait() ordered after the collective
    if not np.array_equal(got, _want(P, 0)):
        errs.append(f"after wait(): {got[:4]} (sentinel {SENTINEL} where nothing was written)")
    if works[1].synchronize() is not None or not works[1].is_completed() or not works[1].done():
        errs.append(f"after synchronize(): not completed: {works[1]!r}")
    works[2].synchronize()
    for k in (1, 2):
        got = outs[k].to_host()
        if not np.array_equal(got, _want(P, k)):
            errs.append(f"call {k} after synchronize(): {got[:4]}")
    if comm.backend == "nccl" and not (isinstance(works[2].seq, int) and works[2].seq > works[0].seq):
        errs.append(f"nccl seq: {works[0].seq}, {works[2].seq}")
    if not repr(works[0]).startswith("<gpucoll.Work "):
        errs.append(f"repr: {works[0]!r}")
    if comm.backend == "nccl":  # inside an open group the operation has not launched: wait() refuses
        y = DeviceArray.from_host(_vals(r, 3), device=dev)
        with comm.group():
            gw = comm.all_reduce(y, async_op=True)
            try:
                gw.wait()
                errs.append("wait() inside the group did not raise")
            except InvalidUsage:
                pass
            if gw.is_completed():
                errs.append("a Work of an open group reported completed")
        gw.synchronize()
        if not np.array_equal(y.to_host(), _want(P, 3)):
            errs.append(f"grouped call after synchronize(): {y.to_host()[:4]}")
    try:
        works[0].add_done_callback(lambda: None)
        errs.append("add_done_callback on a GPU Work did not raise")
    except Unsupported:
        pass
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "custom"])
def test_gpu_async_calls_return_the_one_work_type(backend):
    if backend == "nccl":  # the custom kernels take a float32 sum without NCCL
        gpu_arrays.require_nccl_ranks(2)
    assert gpucoll.spawn(_gpu_round, 2, backend=backend) == [[]] * 2


def test_a_completed_work_holds_its_result():
    w = gpucoll.Work([1, 2])
    assert w.wait() is True and w.wait(timeout=5) is True and w.is_completed() and w.done()
    assert w.synchronize() is None and w.result() == [1, 2] and w.seq is None
    ran = []
    w.add_done_callback(lambda: ran.append(1))
    assert ran == [1] and repr(w) == "<gpucoll.Work completed>"
