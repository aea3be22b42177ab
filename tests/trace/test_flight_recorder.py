"""The flight recorder (csrc/core/flight_recorder.h) and the hang report (gpucoll/flight_recorder.py) on the host
backend: what each entry holds, the ring's bounds, a reader on another thread, and what a timeout says and dumps
when a rank is elsewhere, computing, stopped or dead, and what `python -m gpucoll trace` makes of the dumps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import flight_recorder
from gpucoll.errors import CollectiveTimeout, InvalidArgument, RemoteError

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]


def _entries_worker(comm):
    x = np.arange(1000, dtype=np.float32) + comm.rank
    comm.all_reduce(x)                       # 1
    comm.barrier()                           # 2
    comm.all_gather(np.arange(5, dtype=np.int32))  # 3
    comm.broadcast(np.zeros(3, np.float64), root=1)  # 4
    comm.reduce_scatter(np.ones(8, np.int64), op="max")  # 5
    if comm.rank == 0:
        comm.send(np.zeros(10, np.uint8), 1)
    else:
        comm.recv(np.zeros(10, np.uint8), 0)
    mismatch = None
    try:  # 6: rank 1 passes another count: every rank raises, and the call ends as a mismatch
        comm.all_reduce(np.zeros(4 if comm.rank == 0 else 5, np.float32))
    except InvalidArgument as e:
        mismatch = str(e)
    own = comm._ops.impl.peer_states()[comm.rank]  # this rank's own words: what the peers read of it from now on
    comm.all_reduce(np.ones(2, np.float16), op="avg")  # 7: still usable
    whole = comm.trace()
    return {"trace": whole, "last2": comm.trace(last=2)["entries"], "own": (own["entered"], own["done"]),
            "mismatch": mismatch, "algo": comm.algorithm_for(0, 4000),
            "bad_last": [type(_raises(comm.trace, v)).__name__ for v in (-1, 1.5, True)]}


def _raises(f, *args):
    try:
        f(*args)
    except Exception as e:  # noqa: BLE001 - the type is what the test compares
        return e
    return None


def test_each_operation_is_recorded_with_its_call_size_algorithm_state_and_times():
    res = gpucoll.spawn(_entries_worker, 2, backend="host", timeout=30)
    for rank, r in enumerate(res):
        t = r["trace"]
        assert t["capacity"] == 2000 and t["recorded"] == 8, t
        es = t["entries"]
        want = [("all_reduce", 1, 1000, "float32", "sum", -1, 4000, "done"),
                ("barrier", 2, 0, None, None, -1, 0, "done"),
                ("all_gather", 3, 5, "int32", None, -1, 20, "done"),
                ("broadcast", 4, 3, "float64", None, 1, 24, "done"),
                ("reduce_scatter", 5, 4, "int64", "max", -1, 32, "done"),
                ("p2p", 1, 1, None, None, 1 - rank, 10 if rank == 0 else 0, "done"),
                ("all_reduce", 6, 4 + rank, "float32", "sum", -1, 4 * (4 + rank), "mismatch"),
                ("all_reduce", 7, 2, "float16", "avg", -1, 4, "done")]
        got = [(e["op"], e["seq"], e["count"], e["dtype"], e["redop"], e["root"], e["bytes"], e["state"]) for e in es]
        assert got == want, (rank, got)
        assert [e["id"] for e in es] == list(range(8))
        assert es[0]["algo"] == r["algo"] and es[1]["algo"] is None and es[5]["algo"] is None
        assert {e["backend"] for e in es} == {"host"}
        for prev, e in zip(es, es[1:]):
            assert prev["end_ns"] <= e["start_ns"], (prev, e)
        for e in es:
            assert 0 < e["enqueue_ns"] <= e["start_ns"] <= e["end_ns"] <= t["monotonic_ns"], e
            assert e["dev_start_ns"] == e["dev_end_ns"] == 0
        assert abs(t["realtime_ns"] - time.time_ns()) < 60e9
        assert r["last2"] == es[-2:]
        assert "count" in r["mismatch"] or "5" in r["mismatch"]
        # The mismatched call completed on every rank alike: the peers' reports must not say it is still inside.
        assert r["own"] == (6, 6), r["own"]
        assert r["bad_last"] == ["InvalidArgument"] * 3


def _ring_worker(comm):
    x = np.ones(4, np.float32)
    for _ in range(12):
        comm.all_reduce(x)
    return comm.trace()


def test_the_ring_keeps_the_last_n_operations_and_zero_turns_it_off(monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "5")
    t = gpucoll.spawn(_ring_worker, 2, backend="host", timeout=30)[0]
    assert t["capacity"] == 5 and t["recorded"] == 12
    assert [e["seq"] for e in t["entries"]] == [8, 9, 10, 11, 12]
    assert [e["id"] for e in t["entries"]] == [7, 8, 9, 10, 11]
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "0")
    t = gpucoll.spawn(_ring_worker, 2, backend="host", timeout=30)[0]
    assert t["capacity"] == 0 and t["recorded"] == 0 and t["entries"] == []


def _reader_worker(comm):
    """A thread reads the ring while the main thread runs collectives through several wraps of it (torch's worker
    thread runs a job's collectives while the main thread may ask): every copy must be a consistent run."""
    problems, copies = [], [0]
    stop = threading.Event()

    def read():
        while not stop.is_set():
            es = comm.trace()["entries"]
            copies[0] += 1
            ids = [e["id"] for e in es]
            if ids != list(range(ids[0], ids[0] + len(ids))) if ids else False:
                problems.append(f"ids not contiguous: {ids[:3]}...")
            for e in es:
                if e["seq"] != e["id"] + 1 or e["op"] != "all_reduce" or e["count"] != 1 + e["seq"] % 7:
                    problems.append(f"torn entry {e}")
                if e["state"] == "done" and not e["start_ns"] <= e["end_ns"]:
                    problems.append(f"done without its end time {e}")
            if len(problems) > 5:
                return

    t = threading.Thread(target=read)
    t.start()
    for i in range(1, 3001):
        comm.all_reduce(np.ones(1 + i % 7, np.float32))
    stop.set()
    t.join()
    return problems, copies[0]


def test_a_reader_on_another_thread_sees_only_whole_entries(monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "64")
    for problems, copies in gpucoll.spawn(_reader_worker, 2, backend="host", timeout=60):
        assert not problems, problems
        assert copies > 10


def _hang_worker(comm, odd, mode):
    """Ranks run three all_reduces, then rank `odd` does something else than the fourth: `mode` says what."""
    x = np.ones(8, np.float32)
    pids = np.zeros(comm.world_size, np.int64)
    pids[comm.rank] = os.getpid()
    comm.all_reduce(pids)
    for _ in range(2):
        comm.all_reduce(x)
    if comm.rank == odd:
        if mode == "recv":  # alive, elsewhere: in a receive that nobody sends
            time.sleep(1.0)  # its own timeout then falls well after the others': they find it still inside
            try:
                comm.recv(x, (odd + 1) % comm.world_size)
            except CollectiveTimeout:
                time.sleep(3)  # alive until the others have looked, however late a loaded machine lets them
            return None
        time.sleep(5)  # alive, computing (a stop or a kill, sent by another rank, lands here)
        return None
    if comm.rank == (odd + 1) % comm.world_size and mode in ("stop", "kill"):
        time.sleep(0.1)  # the odd rank is in its sleep by then; this rank is 0.1 s late into the exchange's 1 s
        os.kill(int(pids[odd]), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
        if mode == "stop":
            threading.Timer(4.0, os.kill, (int(pids[odd]), signal.SIGCONT)).start()
    try:
        comm.all_reduce(x)
    except (CollectiveTimeout, RemoteError) as e:
        return {"type": type(e).__name__, "message": str(e), "ranks": e.ranks, "file": e.trace_file}
    return {"type": None}


HANGS = {
    "recv": "is alive but elsewhere and never entered all_reduce #4: it is inside recv #1 from rank {next}",
    "compute": "is alive and never entered all_reduce #4, and is in no gpucoll call (computing?)",
    "stop": "is alive but stopped (SIGSTOP or a debugger) and never entered all_reduce #4",
    "kill": "is dead (its process has exited)",
}


@pytest.mark.parametrize("mode", list(HANGS))
def test_a_timeout_says_where_the_missing_rank_is_and_dumps_every_surviving_rank(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path))
    odd, world = 3, 4
    try:
        res = gpucoll.spawn(_hang_worker, world, args=(odd, mode), backend="host", timeout=2.0)
    except RemoteError as e:
        assert mode == "kill", e
        res = e.results
    others = [r for r in range(world) if r != odd]
    files = set()
    for r in others:
        out = res[r]
        assert out["type"] is not None, (r, out)
        msg = out["message"]
        assert odd in out["ranks"], (r, out)
        assert HANGS[mode].format(next=(odd + 1) % world) in msg, (r, msg)
        assert f"rank {odd} " in msg and "its last completed operation: all_reduce #3" in msg, (r, msg)
        assert "ranks 0-2 have waited in all_reduce #4 for up to" in msg, (r, msg)
        path = out["file"]
        assert path == str(tmp_path / os.path.basename(path)) and f"Flight recorder: {path}" in msg
        files.add(path)
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        assert doc["rank"] == r and doc["failed"] == {"op": "all_reduce", "seq": 4, "coll_seq": 4}
        assert doc["trace"]["entries"][-1]["state"] == "failed"
        assert sorted(doc["exchange"]["heard_from"]) == others, doc["exchange"]
    assert len(files) == len(others) and len({os.path.basename(f).rsplit("-rank", 1)[0] for f in files}) == 1
    pattern = next(iter(files)).rsplit("-rank", 1)[0] + "-rank*.json"
    plot = tmp_path / "hang.png"
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", pattern, "--plot", str(plot)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    text = cli.stdout
    assert f"no dump from rank(s) {odd}" in text and "failed: all_reduce #4" in text, text
    row = next(line for line in text.splitlines() if line.split()[:2] == ["4", "all_reduce"])
    assert row.split()[-1] == "-" and row.count("FAILED") == 3, row  # rank 3 never entered #4
    assert plot.stat().st_size > 10_000


def _late_worker(comm):
    x = np.ones(8, np.float32)
    for i in range(20):
        if comm.rank == 1 and i % 4 == 0:
            time.sleep(0.05)
        comm.all_reduce(x)
    comm.barrier()
    return comm.dump_trace()


def test_every_rank_dumps_on_demand_and_the_trace_command_names_the_straggler(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path))
    files = gpucoll.spawn(_late_worker, 3, backend="host", timeout=30)
    assert len(set(files)) == 3 and all(os.path.dirname(f) == str(tmp_path) for f in files)
    plot = tmp_path / "lanes.png"
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", *files, "--around", "0", "--plot", str(plot)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    assert "no failure: dumps of a running job" in cli.stdout, cli.stdout
    head = lines.index(next(line for line in lines if line.startswith("stragglers over the")))
    assert "stragglers over the 21 collectives" in lines[head], cli.stdout  # 20 all_reduces and the barrier
    top = lines[head + 2].split()
    # Rank 1 slept 50 ms before 5 of the 21: last in those at least, and its worst lateness shows the sleep.
    assert top[0] == "1" and int(top[4]) >= 5 and 40 <= float(top[3]) <= 200, cli.stdout
    timeline = [line.split() for line in lines[:head] if line[:8].strip().isdigit()]
    assert len(timeline) == 21 and all(row[-2].endswith("*") for row in timeline[:20:4]), cli.stdout
    assert plot.stat().st_size > 10_000


def test_the_trace_command_refuses_what_is_not_a_dump(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"format": "something else"}')
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", str(bad)], check=False, capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 2 and "not a gpucoll flight-recorder dump" in cli.stderr, cli.stderr
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", str(tmp_path / "none-*.json")],
                         check=False, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "no file matches" in cli.stderr, cli.stderr


def test_the_exchange_wait_is_bounded():
    assert flight_recorder.exchange_bound(2.0) == 1.0
    assert flight_recorder.exchange_bound(20.0) == 5.0
    assert flight_recorder.exchange_bound(300.0) == 10.0
    assert flight_recorder._ranks_text([0, 1, 2, 4, 6, 7]) == "ranks 0-2, 4, 6, 7"
    assert flight_recorder._ranks_text([3]) == "rank 3"
