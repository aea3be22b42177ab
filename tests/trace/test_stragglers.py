"""Stragglers on the host backend: who arrives late at collectives, and by how much (Communicator.stragglers(),
csrc/core/stragglers.h), read where the call check already compares every rank's call. And what a timeout says of
a rank that never arrived: its last completed collective and how long ago.

Lateness is measured, so the assertions allow what a 2-core machine running 4 ranks does to timing: a 200 ms delay
must read as 200 ms within 20%, and the delayed rank must be the last to arrive in at least 9 of 10 delayed calls.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
import types

import helpers
import numpy as np
import pytest
import torch_ranks

import gpucoll
from gpucoll.backends.base import Backend
from gpucoll.errors import CollectiveTimeout, InvalidUsage, RemoteError, Unsupported

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

DELAY = 0.2
LATE = 2
ROUNDS = 10


def _late_rank_worker(comm):
    x = np.zeros(1024, np.float32)
    before = comm.stragglers()
    delayed = []
    for _ in range(ROUNDS):
        for _ in range(9):
            comm.all_reduce(x)
        undelayed = comm.stragglers(reset=True)  # read and empty the window: the next call is measured alone
        if comm.rank == LATE:
            time.sleep(DELAY)
        comm.all_reduce(x)
        s = comm.stragglers(reset=True)
        delayed.append((s.samples, s.slowest().rank, s.ranks[LATE].median_s, s.ranks[LATE].last))
    comm.all_reduce(x)
    whole = comm.stragglers()
    return {"before": (before.samples, before.total, before.slowest()), "delayed": delayed,
            "undelayed": (undelayed.samples, [r.median_s for r in undelayed.ranks]),
            "after_reset": (whole.samples, whole.total), "summary": str(whole)}


def test_a_rank_that_sleeps_before_every_tenth_all_reduce_is_named_last_with_its_lateness():
    results = gpucoll.spawn(_late_rank_worker, 4, backend="host", timeout=60)
    for rank, res in enumerate(results):
        assert res["before"] == (0, 0, None), res["before"]  # nothing measured before the first collective
        delayed = res["delayed"]
        assert all(n == 1 for n, *_ in delayed), delayed  # reset empties the window
        named = sum(1 for _, slowest, _, last in delayed if slowest == LATE and last == 1)
        assert named >= 0.9 * ROUNDS, (rank, delayed)
        median = statistics.median(late for *_, late, _ in delayed)
        assert abs(median - DELAY) <= 0.2 * DELAY, (rank, median, delayed)
        n, medians = res["undelayed"]
        assert n == 9 and max(medians) < DELAY / 2, (rank, res["undelayed"])  # nobody slept in those
        assert res["after_reset"] == (1, 1), res["after_reset"]
        assert "stragglers over the last 1 collectives" in res["summary"] and "median ms" in res["summary"]
    # Every rank measures the same arrivals, so every rank names the same rank last.
    assert len({tuple(slowest for _, slowest, _, _ in r["delayed"]) for r in results}) == 1


def _silent_worker(comm, skipper):
    x = np.ones(8, np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    if comm.rank == skipper:
        time.sleep(4)  # alive, computing: never enters collective #4 within the others' timeout
        return None
    try:
        comm.all_reduce(x)
    except CollectiveTimeout as exc:
        return {"message": exc.message, "ranks": list(exc.ranks)}
    return None


def test_a_rank_that_never_arrives_is_named_with_its_last_completed_collective():
    try:
        results = gpucoll.spawn(_silent_worker, 4, args=(3,), backend="host", timeout=1.5)
    except RemoteError as exc:  # a peer's timeout stops the late rank: its own result is lost, the others' kept
        results = exc.results
    reports = [r for rank, r in enumerate(results) if rank != 3 and r is not None]
    assert len(reports) == 3, results
    for rep in reports:
        assert 3 in rep["ranks"], rep
        msg = rep["message"]
        assert "all_reduce #4" in msg and "rank(s) that had not entered it: 3 (its last completed: all_reduce #3, " \
            in msg, msg


def test_the_summary_is_logged_every_n_collectives_when_asked(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import gpucoll

        def work(comm):
            for _ in range(20):
                comm.all_reduce(np.ones(4, np.float32))

        if __name__ == "__main__":
            gpucoll.spawn(work, 3, backend="host", timeout=60)
    """))
    env = dict(os.environ, GPUCOLL_STRAGGLER_REPORT="5")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "stragglers over the last" in line]
    assert len(lines) == 4, proc.stderr  # rank 0 only, at collectives 5, 10, 15 and 20
    assert all(line.startswith("[gpucoll 0]") for line in lines), lines
    quiet = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False,
                           env={k: v for k, v in os.environ.items() if k != "GPUCOLL_STRAGGLER_REPORT"})
    assert quiet.returncode == 0 and "stragglers" not in quiet.stderr, quiet.stderr


def _single_rank_worker(comm):
    comm.all_reduce(np.ones(4, np.float32))
    comm.barrier()
    s = comm.stragglers()
    comm.close()
    try:
        comm.stragglers()
    except InvalidUsage as exc:
        return s, str(exc)
    return s, None


def test_one_rank_is_never_late_and_a_closed_communicator_refuses():
    (s, refused), = gpucoll.spawn(_single_rank_worker, 1, backend="host", timeout=60)
    assert (s.samples, s.total) == (2, 2) and s.ranks[0].max_s == 0 and s.ranks[0].last == 0, s  # barriers count
    assert refused is not None and "stragglers on a closed communicator" in refused, refused


def test_backends_without_arrival_times_say_so():
    with pytest.raises(Unsupported, match="host, nccl and custom backends; the mock backend does not compare arrival"):
        Backend.stragglers(types.SimpleNamespace(name="mock"), False)


def _torch_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    import gpucoll.torch

    t = torch.zeros(256)
    try:
        gpucoll.torch.stragglers()
    except InvalidUsage as exc:
        early = str(exc)
    for step in range(10):
        if rank == 1:
            time.sleep(DELAY)
        dist.all_reduce(t)
    s = gpucoll.torch.stragglers()
    path = gpucoll.torch.dump_trace(path=os.path.join(os.environ["TRACE_TMP"], f"r{rank}.json"))
    return early, s.samples, s.slowest().rank, s.ranks[1].median_s, path


def test_torch_jobs_read_the_groups_stragglers_and_dump_its_recorder(tmp_path, monkeypatch):
    helpers.require("torch.distributed")
    monkeypatch.setenv("TRACE_TMP", str(tmp_path))
    results = torch_ranks.run(_torch_worker, 3, backend="gpucoll")
    for early, samples, slowest, median, _ in results:
        assert "no collective has run on cpu tensors in this group yet" in early, early
        assert samples >= 10 and slowest == 1, (samples, slowest)
        assert abs(median - DELAY) <= 0.2 * DELAY, median
    cli = subprocess.run([sys.executable, "-m", "gpucoll", "trace", *(r[-1] for r in results)], check=False,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("stragglers over the"))
    assert lines[head + 2].split()[0] == "1", cli.stdout  # the rank that slept is the first row, last most often
