"""The flight recorder and the straggler report on the custom kernels, on a GPU or on the emulated device: each
allreduce recorded at enqueue on the host and by the kernels on the device (start, end, timed-out or mismatched,
every rank's arrival at barrier 0), read only when asked (csrc/backends/custom/cuda/kernel_trace.h); each rank's
lateness measured in barrier 0 with no common clock; a rank that never arrives turned into a hang report on the
ranks that waited.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveTimeout, InvalidArgument, RemoteError
from gpucoll.testing import DeviceArray

pytestmark = [pytest.mark.spawns, pytest.mark.gpu, *helpers.timeout_mark(300)]


def _dev(comm, values):
    return DeviceArray.from_host(values, device=int(comm.device.split(":")[1]))


def _entries_worker(comm):
    x = _dev(comm, np.arange(16, dtype=np.float32))
    comm.all_reduce(x, algo="custom:oneshot", async_op=True).synchronize()
    comm.broadcast(_dev(comm, np.zeros(5, np.int32)), root=1)  # no custom kernel: the NCCL fallback runs it
    long = _dev(comm, np.ones(3000, np.float32))  # 3 pieces of a 4 KiB staging half
    comm.all_reduce(long, algo="custom:ring", async_op=True).synchronize()
    odd = _dev(comm, np.ones(16 + comm.rank, np.float32))  # rank 1's count differs: the kernels refuse the call
    try:
        comm.all_reduce(odd, algo="custom:oneshot", async_op=True).synchronize()
        refused = None
    except InvalidArgument as e:
        refused = str(e)
    comm.all_reduce(x, algo="custom:twoshot", async_op=True).synchronize()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # NCCL's watchdog ends its entries at its next poll
        out = comm.trace()
        if all(e["state"] != "running" for e in out["entries"]):
            break
        time.sleep(0.05)
    return out, refused, np.asarray(long.to_host())[:4].tolist()


def test_custom_records_every_call_with_device_times_and_the_fallback_beside_it(monkeypatch):
    monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", "4096")
    for rank, (t, refused, long) in enumerate(gpucoll.spawn(_entries_worker, 2, backend="custom", timeout=60)):
        assert refused is not None and "count" in refused, refused
        assert long == [2.0] * 4
        es = t["entries"]
        got = [(e["op"], e["seq"], e["count"], e["bytes"], e["backend"], e["algo"], e["state"]) for e in es]
        want = [("all_reduce", 1, 16, 64, "custom", "oneshot", "done"),
                ("nccl:broadcast", 1, 5, 20, "nccl", "nccl", "done"),
                ("all_reduce", 2, 3000, 12000, "custom", "ring", "done"),
                ("all_reduce", 3, 16 + rank, 4 * (16 + rank), "custom", "oneshot", "mismatch"),
                ("all_reduce", 4, 16, 64, "custom", "twoshot", "done")]
        assert got == want, (rank, got)
        for e in es:
            if e["backend"] != "custom":
                continue
            assert 0 < e["dev_start_ns"] < e["dev_end_ns"], e
            assert e["end_ns"] - e["start_ns"] == e["dev_end_ns"] - e["dev_start_ns"], e
            # Host times from device times: the clock probe's offset is good to well under a millisecond.
            assert e["start_ns"] > e["enqueue_ns"] - 1_000_000, e
        assert [e["coll_seq"] for e in es if e["backend"] == "custom"] == [1, 2, 3, 4]


DELAY = 0.2
LATE = 2
ROUNDS = 10


def _late_worker(comm):
    """Rank LATE computes DELAY longer before every tenth all_reduce. A call's lateness is settled at the next call's
    barrier 0 (each rank's view of it travels with the next signature), so one more call follows each delayed one
    before the window is read."""
    x = _dev(comm, np.ones(256, np.float32))
    rounds = []
    for _ in range(ROUNDS):
        for _ in range(9):
            comm.all_reduce(x, async_op=True).synchronize()
        comm.stragglers(reset=True)
        if comm.rank == LATE:
            time.sleep(DELAY)
        comm.all_reduce(x, async_op=True).synchronize()
        comm.all_reduce(x, async_op=True).synchronize()
        s = comm.stragglers(reset=True)  # the ninth call and the delayed one
        latest = max(s.ranks, key=lambda r: r.max_s).rank  # late by the most at the delayed call
        rounds.append((s.samples, latest, s.ranks[LATE].max_s, s.ranks[LATE].last,
                       max(r.max_s for r in s.ranks if r.rank != LATE)))
    comm.barrier()
    return rounds


def test_the_kernels_name_the_rank_that_sleeps_before_every_tenth_all_reduce():
    results = gpucoll.spawn(_late_worker, 4, backend="custom", timeout=60)
    for rank, rounds in enumerate(results):
        assert all(n == 2 for n, *_ in rounds), (rank, rounds)
        named = sum(1 for _, latest, _, last, _ in rounds if latest == LATE and last >= 1)
        assert named >= 0.9 * ROUNDS, (rank, rounds)
        median = statistics.median(late for _, _, late, _, _ in rounds)
        assert abs(median - DELAY) <= 0.2 * DELAY, (rank, median, rounds)
        assert statistics.median(other for *_, other in rounds) < DELAY / 4, (rank, rounds)
    # Every rank settles the same lateness from the same views: they agree on it to the nanosecond.
    assert len({tuple(late for _, _, late, *_ in r) for r in results}) == 1


def _silent_worker(comm, odd, mode):
    """Ranks run three all_reduces, then rank `odd` computes instead of entering the fourth; in `mode` stop or kill,
    the next rank stops or kills it there."""
    x = _dev(comm, np.ones(8, np.float32))
    pids = np.zeros(comm.world_size, np.float64)
    pids[comm.rank] = os.getpid()
    pids = _dev(comm, pids)
    comm.all_reduce(pids, async_op=True).synchronize()
    pids = np.asarray(pids.to_host())
    for _ in range(2):
        comm.all_reduce(x, async_op=True).synchronize()
    if comm.rank == odd:
        time.sleep(5)  # alive, computing: never enters collective #4 within the others' timeout
        return None
    if comm.rank == (odd + 1) % comm.world_size and mode in ("stop", "kill"):
        time.sleep(0.1)
        os.kill(int(pids[odd]), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
        if mode == "stop":
            threading.Timer(4.0, os.kill, (int(pids[odd]), signal.SIGCONT)).start()
    try:
        comm.all_reduce(x, async_op=True).synchronize()
    except CollectiveTimeout as e:
        return {"message": str(e), "ranks": list(e.ranks), "file": e.trace_file}
    return None


SILENT = {  # every rank's kernels are read from its ring through the IPC mapping, its process from /proc
    "compute": "rank 3 is alive and never entered all_reduce #4, and its GPU runs none of this communicator's "
               "kernels (computing, or in another call?) (its last completed operation: all_reduce #3, ",
    "stop": "rank 3 is alive but stopped (SIGSTOP or a debugger) and never entered all_reduce #4 (its last "
            "completed operation: all_reduce #3, ",
    "kill": "rank 3 is dead (its process has exited) (what it completed last is gone with it)",
}


@pytest.mark.parametrize("mode", list(SILENT))
def test_a_rank_that_never_arrives_gets_a_hang_report_from_the_kernels(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path))
    odd, world = 3, 4
    try:
        # elastic: spawn would stop the survivors a second after the kill, before their kernels time out
        results = gpucoll.spawn(_silent_worker, world, args=(odd, mode), backend="custom", timeout=2.0,
                                elastic=mode == "kill")
    except RemoteError as e:
        assert mode == "kill", e
        results = e.results
    files = set()
    for r in range(odd):
        out = results[r]
        assert out is not None and odd in out["ranks"], (r, out)
        msg = out["message"]
        assert "ranks 0-2 have waited in all_reduce #4 for up to" in msg, msg
        assert SILENT[mode] in msg, msg
        path = out["file"]
        assert path and os.path.dirname(path) == str(tmp_path) and f"Flight recorder: {path}" in msg
        files.add(path)
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        assert doc["backend"] == "custom" and doc["failed"] == {"op": "all_reduce", "seq": 4, "coll_seq": 4}
        assert [e["state"] for e in doc["trace"]["entries"]] == ["done"] * 3 + ["failed"], doc["trace"]
        assert sorted(doc["exchange"]["heard_from"]) == [0, 1, 2], doc["exchange"]
    assert len(files) == odd
    if mode != "compute":
        return
    pattern = next(iter(files)).rsplit("-rank", 1)[0] + "-rank*.json"
    plot = tmp_path / "hang.png"
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", pattern, "--plot", str(plot)], check=False,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert f"no dump from rank(s) {odd}" in cli.stdout and "failed: all_reduce #4" in cli.stdout, cli.stdout
    row = next(line for line in cli.stdout.splitlines() if line.split()[:2] == ["4", "all_reduce"])
    assert row.split()[-1] == "-" and row.count("FAILED") == 3, row
    assert plot.stat().st_size > 10_000


def _report_worker(comm):
    x = _dev(comm, np.ones(4, np.float32))
    for _ in range(20):
        comm.all_reduce(x, async_op=True).synchronize()
    return comm.trace(), comm.stragglers().samples


def test_the_summary_is_logged_on_rank_0_and_a_zero_buffer_records_nothing(monkeypatch, capfd):
    monkeypatch.setenv("GPUCOLL_STRAGGLER_REPORT", "5")
    results = gpucoll.spawn(_report_worker, 2, backend="custom", timeout=60)
    lines = [line for line in capfd.readouterr().err.splitlines() if "stragglers over the last" in line]
    # Rank 0 only, at calls 5, 10, 15 and 20; each summary holds the calls settled before it (the one before).
    assert len(lines) == 4 and all(line.startswith("[gpucoll 0]") for line in lines), lines
    assert "over the last 3 collectives" in lines[0] and "over the last 18 collectives" in lines[-1], lines
    assert [len(t["entries"]) for t, _ in results] == [20, 20] and [n for _, n in results] == [19, 19]
    monkeypatch.setenv("GPUCOLL_STRAGGLER_REPORT", "0")
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "0")
    for t, samples in gpucoll.spawn(_report_worker, 2, backend="custom", timeout=60):
        assert t["entries"] == [] and t["capacity"] == 0 and samples == 0, (t, samples)
