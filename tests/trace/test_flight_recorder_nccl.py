"""The flight recorder on the NCCL backend, on a GPU or on the emulated device's NCCL stand-in: every call recorded
as it is enqueued and ended when its event completes, and a rank that never issues a collective turned into a
hang report by the watchdog (the dump, where every rank is) on the ranks that waited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import gpu_arrays
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveTimeout, RemoteError
from gpucoll.testing import DeviceArray

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]


def _device_array(comm, values):
    return DeviceArray.from_host(values, device=int(comm.device.split(":")[1]))


def _entries_worker(comm):
    x = _device_array(comm, np.arange(16, dtype=np.float32))
    comm.all_reduce(x)
    comm.broadcast(_device_array(comm, np.zeros(5, np.int32)), root=1)
    comm.barrier()
    peer = 1 - comm.rank
    with comm.group():
        comm.send(_device_array(comm, np.zeros(3, np.uint8)), peer)
        comm.recv(_device_array(comm, np.zeros(3, np.uint8)), peer)
    comm.all_reduce(x, async_op=True).synchronize()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the watchdog ends entries at its next poll after the event completed
        es = comm.trace()["entries"]
        if all(e["state"] == "done" for e in es):
            break
        time.sleep(0.05)
    return comm.trace()


def test_nccl_records_every_call_with_its_issue_and_completion():
    gpu_arrays.require_nccl_ranks(2)
    for rank, t in enumerate(gpucoll.spawn(_entries_worker, 2, backend="nccl", timeout=60)):
        es = t["entries"]
        got = [(e["op"], e["seq"], e["count"], e["dtype"], e["root"], e["bytes"], e["state"], e["algo"]) for e in es]
        want = [("all_reduce", 1, 16, "float32", -1, 64, "done", "nccl"),
                ("broadcast", 2, 5, "int32", 1, 20, "done", "nccl"),
                ("all_reduce", 3, 1, "int32", -1, 4, "done", "nccl"),  # the barrier: one int32 all_reduce
                ("p2p", 4, 1, None, 1 - rank, 3, "done", None),
                ("p2p", 5, 1, None, 1 - rank, 0, "done", None),
                ("all_reduce", 6, 16, "float32", -1, 64, "done", "nccl")]
        assert got == want, (rank, got)
        assert {e["backend"] for e in es} == {"nccl"}
        for e in es:
            assert e["start_ns"] == 0 and 0 < e["enqueue_ns"] <= e["end_ns"], e  # NCCL does not say when it starts


def _missing_worker(comm):
    x = _device_array(comm, np.ones(16, np.float32))
    for _ in range(3):
        comm.all_reduce(x)
    comm.barrier()
    if comm.rank == 1:
        comm._store.get("test/trace/seen", timeout=60.0)  # until rank 0 has its report
        comm.abort()
        return None
    try:
        comm.all_reduce(x, async_op=True).synchronize()
        return {"error": None}
    except CollectiveTimeout as e:
        first = e
    try:
        comm.all_reduce(x)
        again = None
    except CollectiveTimeout as e:
        again = e
    comm._store.set("test/trace/seen", b"1")
    return {"error": str(first), "ranks": first.ranks, "file": first.trace_file,
            "again": None if again is None else (str(again) == str(first), again.trace_file)}


def test_a_rank_that_never_issues_a_collective_gets_a_hang_report_on_nccl(tmp_path, monkeypatch):
    gpu_arrays.require_nccl_ranks(2)
    monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path))
    out = gpucoll.spawn(_missing_worker, 2, backend="nccl", timeout=3.0)[0]
    msg = out["error"]
    assert msg is not None and out["ranks"] == (1,), out
    assert "all_reduce #5" in msg and "ranks that had not reached operation #5: [1]" in msg, msg
    assert "where every rank is: rank 1 is alive" in msg and "; rank 0 has waited in all_reduce #5 for up to" in msg, msg
    assert "rank 1 is alive and sent no report: it is not in all_reduce #5 (computing, or in another call)" in msg, msg
    path = out["file"]
    assert path and os.path.dirname(path) == str(tmp_path) and f"Flight recorder: {path}" in msg
    assert out["again"] == (True, path)  # a later call raises the same report, dumped once
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["backend"] == "nccl" and doc["failed"] == {"op": "all_reduce", "seq": 5, "coll_seq": 5}
    assert [e["state"] for e in doc["trace"]["entries"]] == ["done"] * 4 + ["running"]
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", path], check=False, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    row = next(line for line in cli.stdout.splitlines() if line.split()[:2] == ["5", "all_reduce"])
    assert row.split()[-1] == "-" and "RUNNING" in row, cli.stdout  # rank 1, named by the timeout


def _stopped_worker(comm, mode):
    """Rank 0 stops or kills rank 1, which is computing, then enters a collective rank 1 never will."""
    pids = np.zeros(2, np.float64)
    pids[comm.rank] = os.getpid()
    pids = _device_array(comm, pids)
    comm.all_reduce(pids, async_op=True).synchronize()
    peer = int(np.asarray(pids.to_host())[1])
    if comm.rank == 1:
        time.sleep(6)
        return None
    os.kill(peer, signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
    if mode == "stop":
        threading.Timer(5.0, os.kill, (peer, signal.SIGCONT)).start()
    try:
        comm.all_reduce(_device_array(comm, np.ones(4, np.float32)), async_op=True).synchronize()
    except CollectiveTimeout as e:
        return str(e)
    return None


STOPPED = "rank 1 is alive but stopped (SIGSTOP or a debugger) and never entered all_reduce #2"


@pytest.mark.parametrize("mode,said", [("stop", STOPPED), ("kill", "rank 1 is dead (its process has exited)")])
def test_a_stopped_rank_is_told_from_a_dead_one_on_nccl(mode, said, tmp_path, monkeypatch):
    gpu_arrays.require_nccl_ranks(2)
    monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path))
    try:
        msg = gpucoll.spawn(_stopped_worker, 2, args=(mode,), backend="nccl", timeout=3.0, elastic=True)[0]
    except RemoteError as e:
        assert mode == "kill", e
        msg = e.results[0]
    assert msg is not None and said in msg, msg
    assert "rank 0 has waited in all_reduce #2 for up to" in msg, msg


DELAY = 0.2


def _late_worker(comm):
    """Rank 1 computes DELAY longer before every tenth all_reduce; each step waits for its all_reduce (as a training
    step that reads its loss does), so the ranks' enqueue times are comparable step by step. A barrier lines the
    ranks up just before the delayed call; the window is read only after it, once it holds every collective since
    the last read (the peers' samples reach the store with their watchdog's next publish, at most every 0.5 s): a
    wait for samples between two measured calls would put its own skew into their arrival times."""
    x = _device_array(comm, np.ones(64, np.float32))
    rounds = []
    for rnd in range(3):
        for _ in range(9):
            comm.all_reduce(x, async_op=True).synchronize()
        comm.barrier()
        if comm.rank == 1:
            time.sleep(DELAY)
        comm.all_reduce(x, async_op=True).synchronize()
        want = 11 if rnd == 0 else 12  # 9 steps, the barrier and the delayed call (and the last round's barrier)
        deadline = time.monotonic() + 10
        while comm.stragglers().samples < want and time.monotonic() < deadline:
            time.sleep(0.05)
        s = comm.stragglers(reset=True)
        rounds.append((s.samples, s.ranks[1].max_s, s.ranks[1].last, s.ranks[0].median_s))
        comm.barrier()  # neither rank leaves (and stops publishing) while the other still reads its samples
    return rounds


def test_nccl_stragglers_name_the_late_rank_from_the_sampled_enqueue_times():
    gpu_arrays.require_nccl_ranks(2)
    for rank, rounds in enumerate(gpucoll.spawn(_late_worker, 2, backend="nccl", timeout=60)):
        assert [n for n, *_ in rounds] == [11, 12, 12], (rank, rounds)  # every collective measured
        for _, late, last, other in rounds:
            assert abs(late - DELAY) <= 0.2 * DELAY and last >= 1, (rank, rounds)
            # Rank 0 is not a straggler. (Its worst can be large: the previous round's closing barrier is measured
            # too, and the ranks reach it when each has read the other's samples, up to 0.5 s apart.)
            assert other < DELAY / 4, (rank, rounds)


def _uneven_p2p_worker(comm):
    """Ranks 0 and 1 exchange a message that rank 2 takes no part in, so NCCL numbers the later collectives two
    apart on rank 2; then rank 2 is late once. The collectives must still be matched as the same calls."""
    x = _device_array(comm, np.ones(8, np.float32))
    if comm.rank < 2:
        buf = _device_array(comm, np.zeros(4, np.uint8))
        (comm.send if comm.rank == 0 else comm.recv)(buf, 1 - comm.rank)
    for step in range(5):
        if comm.rank == 2 and step == 2:
            time.sleep(DELAY)
        comm.all_reduce(x, async_op=True).synchronize()
    deadline = time.monotonic() + 10
    while comm.stragglers().samples < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    s = comm.stragglers()
    comm.barrier()
    return s.samples, s.ranks[2].max_s, s.ranks[2].last


def test_nccl_stragglers_match_collectives_not_operation_numbers():
    gpu_arrays.require_nccl_ranks(3)
    for samples, late, last in gpucoll.spawn(_uneven_p2p_worker, 3, backend="nccl", timeout=60):
        assert samples == 5 and last >= 1 and abs(late - DELAY) <= 0.2 * DELAY, (samples, late, last)


def _report_worker(comm):
    x = _device_array(comm, np.ones(4, np.float32))
    for _ in range(20):
        comm.all_reduce(x, async_op=True).synchronize()
        time.sleep(0.03)  # the watchdogs publish their samples meanwhile (at most every 0.5 s)


def test_the_summary_is_logged_on_rank_0_every_n_collectives_on_nccl(monkeypatch, capfd):
    gpu_arrays.require_nccl_ranks(2)
    monkeypatch.setenv("GPUCOLL_STRAGGLER_REPORT", "5")
    monkeypatch.setenv("GPUCOLL_LOG_LEVEL", "warn")  # asked for by name: logged whatever the level says
    gpucoll.spawn(_report_worker, 2, backend="nccl", timeout=60)
    lines = [line for line in capfd.readouterr().err.splitlines() if "stragglers over the last" in line]
    # Rank 0 only, at its 5th, 10th, 15th and 20th collective; each summary holds what the samples had reached.
    assert len(lines) == 4 and all(line.startswith("[gpucoll 0] INFO") for line in lines), lines
    assert "over the last 0 collectives" not in lines[-1], lines

