"""A node lost in the middle of training, on "nodes" of this machine: SIGKILL of every rank of one node, or its
cable cut with its ranks alive on the far side, or a cable that flaps. Survivors name the lost ranks on every rank
within the timeout plus a second, shrink, and train on (gpucoll.elastic, host backend across nodes); a process on a
new node joins. Nothing hangs: every rank's process is waited for with a deadline (tests/multinode/node_rank.py,
mode elastic)."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

import pytest

from gpucoll.testing.cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.spawns]

RANK = str(Path(__file__).resolve().parent / "node_rank.py")
T = 5.0  # the communicators' timeout, seconds
AT = 5  # the step at which node 2 goes


def _env(c: Cluster, lose: str, steps: int, timeout: float = T, admit: int = 0) -> dict:
    return {"GPUCOLL_STORE_SECRET": secrets.token_hex(32), "T": str(timeout), "LOST_NODE": "2", "AT": str(AT),
            "STEPS": str(steps), "LOSE": lose, "MARK": os.path.join(c.workdir, "mark"),
            "CONTACT": os.path.join(c.workdir, "contact") if admit else "", "ADMIT": str(admit)}


def _wait_for(path: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _report(text: str, who) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, f"{who} printed no report:\n{text[-3000:]}"
    rep = json.loads(lines[-1])
    assert "error" not in rep, f"{who}: {rep.get('trace')}"
    return rep


def _survivors(results, lost: set) -> list[dict]:
    reps = []
    for r in results:
        if r.rank in lost:
            continue
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        reps.append(_report(r.stdout, f"rank {r.rank}"))
    return reps


def _check_failure(reps, lost_at: float, kind: str, lost: list) -> None:
    for rep in reps:
        failure = rep["events"][0]
        assert failure["kind"] == "failure" and failure["type"] == kind, failure
        assert failure["ranks"] == lost, failure  # every survivor names the lost node's ranks
        assert f"rank(s) {lost}" in failure["error"], failure["error"]
        assert failure["at"] - lost_at <= T + 1.0, f"named {failure['at'] - lost_at:.2f} s after the loss"
        assert rep["events"][1]["kind"] == "recovered", rep["events"]


def test_a_node_killed_mid_training_is_named_at_once_and_a_process_on_a_new_node_joins():
    with Cluster(4, 2) as c:
        env = _env(c, "kill", steps=30, admit=3)
        job = c.launch([sys.executable, RANK, "elastic"], env=env, nodes=3)
        _wait_for(env["CONTACT"])  # rank 0 after the shrink: where a newcomer meets the job
        address, port = Path(env["CONTACT"]).read_text().split()
        assert address == c.addresses[0]  # the survivors' new store listens where the job's first one did
        log = os.path.join(c.workdir, "newcomer.out")
        with open(log, "w") as out:
            newcomer = c.spawn(3, [sys.executable, RANK, "elastic"],
                               {**env, "JOIN": "1", "MASTER_ADDR": address, "MASTER_PORT": port, "WORLD_SIZE": "6"},
                               stdout=out, stderr=out)
        results = job.wait(timeout=120)
        newcomer.wait(timeout=60)
        joined = _report(Path(log).read_text(), "the newcomer")
        lost_at = float(Path(env["MARK"]).read_text())
    reps = _survivors(results, {4, 5})
    assert all(results[r].returncode == -9 for r in (4, 5))
    _check_failure(reps, lost_at, "RemoteError", [4, 5])
    for rep in reps:
        assert rep["events"][1]["world_size"] == 4 and rep["events"][1]["step"] == AT
        grown = rep["events"][2]
        assert grown["kind"] == "grown" and grown["world_size"] == 5, rep["events"]
        assert rep["backend"] == "HostNodes" and rep["world_size"] == 5
        steps = [s[0] for s in rep["sums"]]
        assert steps == list(range(30)), steps  # every step once, the failed one redone
        # Each step's all_reduce of (rank + 1) over the communicator of that moment: exact, every rank alike.
        assert all(total == size * (size + 1) / 2 for _, size, total in rep["sums"]), rep["sums"]
        assert [size for _, size, _ in rep["sums"]][:AT] == [6] * AT
    start = grown["step"]
    assert joined["events"][0]["kind"] == "joined" and joined["events"][0]["rank"] == 4
    assert [s[0] for s in joined["sums"]] == list(range(start, 30))
    assert {json.dumps(rep["w"]) for rep in (*reps, joined)} == {json.dumps(reps[0]["w"])}


def test_a_node_cut_off_alive_is_named_within_the_timeout_and_the_others_go_on():
    with Cluster(3, 2) as c:
        env = _env(c, "cut", steps=12)
        job = c.launch([sys.executable, RANK, "elastic"], env=env)
        _wait_for(env["MARK"])
        c.cut(2)
        results = job.wait(timeout=60, abandon={4, 5})  # node 2's ranks wait forever on the far side: killed
        lost_at = float(Path(env["MARK"]).read_text())
    reps = _survivors(results, {4, 5})
    _check_failure(reps, lost_at, "CollectiveTimeout", [4, 5])
    for rep in reps:
        assert rep["events"][1]["world_size"] == 4 and rep["events"][1]["at"] - lost_at <= T + 3.0
        assert [s[0] for s in rep["sums"]] == list(range(12))
        assert rep["world_size"] == 4 and len({json.dumps(r["w"]) for r in reps}) == 1


def test_a_cable_that_flaps_for_two_seconds_costs_time_not_the_job():
    with Cluster(3, 1) as c:
        env = _env(c, "flap", steps=12, timeout=10.0)
        job = c.launch([sys.executable, RANK, "elastic"], env=env)
        _wait_for(env["MARK"])
        c.flap(2, 2.0)
        results = job.wait(timeout=60)
    reps = _survivors(results, set())
    for rep in reps:
        assert rep["events"] == [] and rep["world_size"] == 3
        assert rep["sums"] == [[i, 3, 6.0] for i in range(12)]
        # The step node 2 was cut in waited for the cable to come back (not run around it, not failed).
        assert rep["times"][AT] - rep["times"][AT - 1] >= 2.0, rep["times"]
