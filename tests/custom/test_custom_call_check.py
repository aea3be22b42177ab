"""The custom kernels' cross-rank call check (backends/custom/kernels/peer_sync.cuh, open_call): every rank's all_reduce carries
its signature (count, dtype, op, algorithm, call number) in barrier 0, so calls that differ across ranks move no
data at all and raise the same InvalidArgument on every rank where the kernels are next synchronised (barrier(),
a Work's synchronize(), VirtualRanks.synchronize()), and the communicator stays usable: later matched calls are
exact. Runs on a real GPU or on gpucoll's emulated device (GPUCOLL_CUDA=emulate), in both one-GPU modes:

* virtual ranks (P communicators in this process): every kind of mismatch x every algorithm x each rank as the
  odd one, at P = 2, 3, 5; outputs and inputs checked untouched, each rank's own error compared;
* 3 processes through gpucoll.spawn(backend='custom'): the public API, barrier() and Work.synchronize().

Kinds: a count one element off (the same pieces and blocks), a count with more blocks, a count with more pieces (a
rank whose partner block or piece never comes: block 0's verdict releases it), dtype, op, algorithm.
"""

from __future__ import annotations

import os

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll._make import init_from_store
from gpucoll.errors import InvalidArgument
from gpucoll.testing import DeviceArray, virtual_ranks

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

ALGOS = ("oneshot", "twoshot", "ring", "tree")
HALF = 64 << 10  # staging half: 16384 float32 elements per piece
BASE = 1000
# kind -> (what the odd rank changes, the words the message must name)
KINDS = {
    "count+1": ({"count": BASE + 1}, "count"),
    "count, more blocks": ({"count": 12000}, "count"),
    "count, more pieces": ({"count": 40000}, "count"),
    "dtype": ({"dtype": "int32"}, "dtype"),
    "op": ({"op": "max"}, "op"),
    "algorithm": ({}, "algorithm"),  # the odd rank's algorithm is the next one in ALGOS
}


def _call(kind: str, algo: str, odd: int, r: int) -> dict:
    call = {"count": BASE, "dtype": "float32", "op": "sum", "algo": algo}
    if r == odd:
        change, _ = KINDS[kind]
        call.update(change)
        if kind == "algorithm":
            call["algo"] = ALGOS[(ALGOS.index(algo) + 1) % len(ALGOS)]
    return call


def _values(count: int, r: int, dtype: str) -> np.ndarray:
    return ((np.arange(count) % 7) + r + 1).astype(dtype)


def _odd_ranks(P: int, odd: int) -> list:
    """ranks() of the error: those whose call differs from rank 0's."""
    return [odd] if odd != 0 else list(range(1, P))


def _virtual_case(vr, kind: str, algo: str, odd: int) -> list:
    P = vr.nranks
    calls = [_call(kind, algo, odd, r) for r in range(P)]
    xs = [_C_array(_values(c["count"], r, c["dtype"])) for r, c in enumerate(calls)]
    outs = [_C_array(np.full(c["count"], -5, c["dtype"])) for c in calls]
    for r, (c, comm) in enumerate(zip(calls, vr.comms)):
        comm.all_reduce(xs[r].ptr, outs[r].ptr, c["count"], getattr(_C.DType, c["dtype"]), getattr(_C.RedOp, c["op"]),
                        c["algo"], vr.streams[r])
    for comm in vr.comms:
        comm.synchronize()
    fails, messages = [], []
    for r, comm in enumerate(vr.comms):
        try:
            comm.check_calls()
            fails.append(f"{kind} {algo} odd={odd}: rank {r} raised nothing")
        except InvalidArgument as e:
            messages.append(str(e))
            if list(e.ranks) != _odd_ranks(P, odd):
                fails.append(f"{kind} {algo} odd={odd}: rank {r} names ranks {e.ranks}")
            if KINDS[kind][1] not in str(e):
                fails.append(f"{kind} {algo} odd={odd}: rank {r}'s message does not name the {KINDS[kind][1]}: {e}")
        if not (outs[r].to_host() == -5).all():
            fails.append(f"{kind} {algo} odd={odd}: rank {r}'s output was written")
        if not (xs[r].to_host() == _values(calls[r]["count"], r, calls[r]["dtype"])).all():
            fails.append(f"{kind} {algo} odd={odd}: rank {r}'s input was written")
    if len(set(messages)) > 1:
        fails.append(f"{kind} {algo} odd={odd}: ranks raised different messages: {messages}")
    return fails


def _C_array(a: np.ndarray):
    return DeviceArray.from_host(np.ascontiguousarray(a))


def _virtual_matched(vr, algo: str, count: int, seed: int) -> list:
    """One matched in-place call, exact (integer-valued float32, distinct per element)."""
    P = vr.nranks
    inputs = [((np.arange(count) * (seed + 3) + r * 11) % 97).astype(np.float32) for r in range(P)]
    xs = [_C_array(a) for a in inputs]
    vr.all_reduce(xs, algo=algo)
    vr.synchronize()  # raises if the kernels found a mismatch
    want = helpers.reference(inputs, "float32", "sum")
    return [f"matched {algo} count={count} rank {r}" for r, x in enumerate(xs)
            if helpers.compare_exact(x.to_host(), want)]


@pytest.mark.parametrize("P", (2, 3, 5))
def test_virtual_ranks_every_mismatch_raises_on_every_rank(P):
    fails = []
    with virtual_ranks(P, buffer_bytes=2 * HALF) as vr:
        for kind in KINDS:
            for algo in ALGOS:
                for odd in range(P):
                    fails += _virtual_case(vr, kind, algo, odd)
                    # At once a matched call: exact, and nothing more to report.
                    fails += _virtual_matched(vr, algo, BASE + odd, odd)
        # Through VirtualRanks.synchronize as well: raised once, then usable.
        xs = [_C_array(np.ones(BASE + (r == 1), np.float32)) for r in range(P)]
        for r, comm in enumerate(vr.comms):
            comm.all_reduce(xs[r].ptr, xs[r].ptr, BASE + (r == 1), _C.DType.float32, _C.RedOp.sum, "twoshot",
                            vr.streams[r])
        with pytest.raises(InvalidArgument, match="differ in count"):
            vr.synchronize()
        vr.synchronize()
        # 100 matched calls, every algorithm, sizes from one element to several pieces: exact.
        sizes = (1, 37, 1001, 16384, 40001)
        for i in range(100):
            fails += _virtual_matched(vr, ALGOS[i % 4], sizes[i % len(sizes)], i)
    assert not fails, helpers.format_failures(fails)


def test_check_off_lets_a_mismatch_through():
    """The comparison is what catches it: with the check off (the benchmark's switch) the same mismatch raises
    nothing. (The test of the test: a signature that were never compared would pass the matrix above only if
    this one failed.)"""
    with virtual_ranks(2, buffer_bytes=2 * HALF) as vr:
        for comm in vr.comms:
            comm._set_call_check(False)
        xs = [_C_array(np.ones(BASE, np.float32)), _C_array(np.ones(BASE, np.int32))]
        for r, comm in enumerate(vr.comms):
            comm.all_reduce(xs[r].ptr, xs[r].ptr, BASE, getattr(_C.DType, ("float32", "int32")[r]), _C.RedOp.sum,
                            "oneshot", vr.streams[r])
        vr.synchronize()
        for comm in vr.comms:
            comm._set_call_check(True)
        assert vr.comms[0].call_check


def _spawned(comm) -> dict:
    P, r = comm.world_size, comm.rank
    DA = DeviceArray
    out = {"barrier": [], "work": [], "fails": []}
    for kind in ("count+1", "count, more pieces", "dtype", "op", "algorithm"):
        for odd in range(P):
            c = _call(kind, "twoshot", odd, r)
            x = DA.from_host(_values(c["count"], r, c["dtype"]))
            y = DA.from_host(np.full(c["count"], -5, c["dtype"]))
            comm.all_reduce(x, y, op=c["op"], algo=c["algo"])
            try:
                comm.barrier()
                out["fails"].append(f"{kind} odd={odd}: barrier raised nothing")
            except InvalidArgument as e:
                out["barrier"].append((str(e), list(e.ranks)))
            if not (y.to_host() == -5).all():
                out["fails"].append(f"{kind} odd={odd}: the output was written")
            # Async: the Work's synchronize() raises it.
            work = comm.all_reduce(x, y, op=c["op"], algo=c["algo"], async_op=True)
            try:
                work.synchronize()
                out["fails"].append(f"{kind} odd={odd}: Work.synchronize raised nothing")
            except InvalidArgument as e:
                out["work"].append(str(e))
    inputs = [((np.arange(40001) * 3 + q * 5) % 89).astype(np.float32) for q in range(P)]
    want = helpers.reference(inputs, "float32", "sum")
    for i in range(100):
        n = (1, 1001, 40001)[i % 3]
        x = DA.from_host(inputs[r][:n])
        comm.all_reduce(x, algo=ALGOS[i % 4])
        comm.barrier()
        if helpers.compare_exact(x.to_host(), want[:n]):
            out["fails"].append(f"matched call {i} (n={n})")
    return out


def test_processes_mismatch_raises_the_same_error_on_every_rank(monkeypatch):
    monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", str(HALF))
    results = gpucoll.spawn(_spawned, 3, backend="custom", timeout=300.0)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fails"]]
    assert not fails, helpers.format_failures(fails)
    assert len(results[0]["barrier"]) == 5 * 3
    for res in results[1:]:
        assert res["barrier"] == results[0]["barrier"]
        assert res["work"] == results[0]["work"]
    for i, (message, ranks) in enumerate(results[0]["barrier"]):
        odd = i % 3
        assert list(ranks) == _odd_ranks(3, odd), (message, ranks)
        assert "ranks made different calls" in message and "still usable" in message


def _odd_buffer(comm):
    """Each rank asks for a custom communicator with its own staging size, over the host communicator's store."""
    os.environ["GPUCOLL_CUSTOM_BUFFER_BYTES"] = str(HALF * (1 + comm.rank))
    try:
        init_from_store(comm._store, comm.rank, comm.world_size, backend="custom", timeout=60.0).close()
    except InvalidArgument as e:
        return str(e)
    return None


def test_ranks_with_different_staging_sizes_are_refused():
    """Every rank must cut a call into the same pieces (the kernels compare each call's whole count, not its
    pieces'), so init refuses different GPUCOLL_CUSTOM_BUFFER_BYTES on every rank, naming it."""
    results = gpucoll.spawn(_odd_buffer, 2, backend="host", timeout=120.0)
    assert all(r is not None and "GPUCOLL_CUSTOM_BUFFER_BYTES" in r for r in results), results
    assert results[0] == results[1]
