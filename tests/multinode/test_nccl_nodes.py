"""The NCCL backend across "nodes" (gpucoll.testing.cluster) on the emulated device: ranks on different hosts reach
each other only through the NCCL stand-in's network transport (csrc/emulation/nccl/net.cc, TCP over the cluster's
veth network), ranks of one host through its IPC mailboxes.

* gpucoll.init from torchrun's variables on 2 nodes x 2 ranks and 4 nodes x 1 rank: the NCCL backend, each rank on
  its node's hostname and on the device of its local rank; NCCL's battery (every collective x dtype x op, send/recv,
  groups, async work) bit-exact across the nodes, and exact on the split by node, on the split of the nodes' first
  ranks and on a subgroup of two ranks on two nodes. Small channel chunks (NCCL_EMU_CHUNK_BYTES=256) make every
  message many frames on the wire. Each rank's stand-in log says which peers it reaches over the network: exactly
  the ranks on other hosts.
* Faults only a network has: a node's cable cut in the middle of all-reduces is named (the lost host and its ranks)
  on every surviving rank within the stand-in's network timeout, well inside gpucoll's timeout, also by the ranks
  that learn it from the first survivor to give up; the survivors shrink to an NCCL communicator across the other
  nodes, every collective exact; a node killed with SIGKILL is named at once; a cable down for 2 s and back (a
  flap) is survived with exact results.
The ranks run tests/multinode/nccl_rank.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import helpers
import pytest

from gpucoll import _C
from gpucoll.testing.cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.spawns, pytest.mark.gpu, *helpers.timeout_mark(300),
              pytest.mark.skipif(not _C.build_info().get("cuda_emulated"),
                                 reason="ranks on the cluster's nodes run on gpucoll's emulated device and its NCCL "
                                        "stand-in (GPUCOLL_CUDA=emulate); nodes of one machine share one real GPU")]

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_rank.py")
NET_TIMEOUT_S = 3.0  # NCCL_EMU_NET_TIMEOUT_MS for the fault tests: how long a silent host takes to be named
TIMEOUT_S = 20.0  # gpucoll's own timeout in the ranks: the network's must name the loss before it


def _env(per_node: int, **more) -> dict:
    return {"GPUCOLL_EMU_DEVICES": str(per_node), "NCCL_DEBUG": "INFO", **more}


def _report(result) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"rank"')]
    assert result.returncode == 0 and lines, f"rank {result.rank}: {result.returncode}\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])


def _over_the_network(stderr: str) -> list[int]:
    """The peers the rank's first communicator (the world's) reaches over the network, from the stand-in's log."""
    line = next((ln for ln in stderr.splitlines() if "reaches over the network:" in ln), "")
    return sorted(int(r) for r in re.findall(r"rank (\d+) \(host", line.split("network:", 1)[-1]))


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_every_collective_is_exact_across_nodes_and_on_the_split_by_node(nodes, per_node):
    with Cluster(nodes, per_node, shared_home=True) as c:
        results = c.run([sys.executable, RANK, "everything", str(TIMEOUT_S)], timeout=240,
                        env=_env(per_node, NCCL_EMU_CHUNK_BYTES="256"))
    for res in results:
        seen = _report(res)
        node, local = divmod(res.rank, per_node)
        assert (seen["rank"], seen["world"], seen["backend"]) == (res.rank, nodes * per_node, "nccl")
        assert seen["host"] == c.hostnames[node] and seen["device"] == f"cuda:{local}"
        assert _over_the_network(res.stderr) == [q for q in range(nodes * per_node) if q // per_node != node]
        assert seen["cases"] >= 50 and seen["battery"] == {}, seen["battery"]
        assert seen["node_comm"] == [local, per_node, "nccl"]
        assert seen["node_fails"] == [] and seen["world_fails"] == []
        assert seen.get("cross_fails") == ([] if res.rank in (1, 2) else None)
        if local == 0:
            assert seen["leaders"] == [node, nodes] and seen["leader_fails"] == []
        else:
            assert "leaders" not in seen


def _start(c: Cluster, per_node: int, net_timeout_s: float, rank_env=None, step: str = "loop", env=None):
    """Every rank all-reduces (nccl_rank.loop) until one fails or the test writes the stop file; returns once all of
    them are running."""
    stop = os.path.join(c.workdir, "stop")
    job = c.launch([sys.executable, RANK, step, str(TIMEOUT_S)], rank_env=rank_env,
                   env=_env(per_node, NCCL_EMU_NET_TIMEOUT_MS=str(int(net_timeout_s * 1000)), STOP_FILE=stop,
                            **(env or {})))
    deadline = time.monotonic() + 60
    while sum('"ready"' in Path(out).read_text() for out, _ in job._logs) < c.world_size:
        assert all(code is None for code in job.poll()), "a rank exited before the fault"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    time.sleep(0.5)  # well inside the all-reduces
    return job, stop


def _exits(job, t0: float) -> dict:
    """Seconds from t0 to each rank's exit, by rank (gpucoll's timeout and then some at most)."""
    exits = {}
    while len(exits) < len(job.procs) and time.monotonic() - t0 < TIMEOUT_S + 10:
        for r, code in enumerate(job.poll()):
            if code is not None and r not in exits:
                exits[r] = time.monotonic() - t0
        time.sleep(0.02)
    return exits


@pytest.mark.parametrize("nodes,per_node,victim", [(2, 2, 1), (4, 1, 2)], ids=["2x2", "4x1"])
def test_a_cut_cable_mid_collective_is_named_on_every_survivor(nodes, per_node, victim):
    with Cluster(nodes, per_node, shared_home=True) as c:
        job, _ = _start(c, per_node, NET_TIMEOUT_S)
        t0 = time.monotonic()
        c.cut(victim)
        exits = _exits(job, t0)
        results = job.wait(timeout=5)
    lost = [r for r in range(nodes * per_node) if r // per_node == victim]
    lost_text = f"ranks {', '.join(map(str, lost))}" if len(lost) > 1 else f"rank {lost[0]}"
    for res in results:
        if res.rank in lost:
            continue  # the far side of the cut loses everyone
        seen = _report(res)
        assert seen["error"] == "RemoteError" and seen["fails"] in ([], [seen["ops"] - 1]), (seen.get("message"), seen)
        assert f"lost host {c.hostnames[victim]} ({lost_text})" in seen["message"], seen["message"]
        # The lost ranks as gpucoll itself names them, not from the stand-in's text: those whose heartbeat through
        # the rendezvous store stood still (backends/nccl_liveness.py), so that shrink need not wait for them.
        assert seen["ranks"] == lost, seen
        # Seen by the network's timeout (3 s), named 2 s later (and a second's look at where the others are), well
        # before gpucoll's own timeout (20 s).
        if res.rank != 0:  # rank 0 stays a while after its error (it serves the store)
            assert NET_TIMEOUT_S - 0.5 < exits[res.rank] < NET_TIMEOUT_S + 6.0, exits


def test_the_survivor_that_names_a_lost_host_first_tells_the_others():
    """Rank 0 gives up on a silent host after 2 s, the others would after 8: rank 0's abort sends them its reason,
    so they name the lost host too, at once, instead of only rank 0 that went away."""
    with Cluster(4, 1, shared_home=True) as c:
        job, _ = _start(c, 1, 8.0, rank_env=lambda r: {"NCCL_EMU_NET_TIMEOUT_MS": "2000"} if r == 0 else None)
        t0 = time.monotonic()
        c.cut(2)
        exits = _exits(job, t0)
        results = job.wait(timeout=5)
    for res in (results[1], results[3]):
        seen = _report(res)
        assert seen["error"] == "RemoteError" and seen["ranks"] == [2], (seen.get("message"), seen)
        assert f"rank 0 (host {c.hostnames[0]}" in seen["message"], seen["message"]
        assert "gave up on the communicator" in seen["message"], seen["message"]
        assert f"lost host {c.hostnames[2]} (rank 2)" in seen["message"], seen["message"]
        assert exits[res.rank] < 8.0, exits


def test_the_survivors_of_a_cut_shrink_to_an_nccl_communicator_across_the_other_nodes():
    with Cluster(4, 1, shared_home=True) as c:
        job, _ = _start(c, 1, NET_TIMEOUT_S, step="loop_then_shrink", env={"LOST": "2"})
        c.cut(2)
        results = job.wait(timeout=TIMEOUT_S + 30, abandon={2})
    for res in (results[0], results[1], results[3]):
        seen = _report(res)
        assert seen["error"] == "RemoteError" and seen["ranks"] == [2], (seen.get("message"), seen)
        assert seen["shrunk"] == [[0, 1, None, 2][res.rank], 3, "nccl"] and seen["shrunk_fails"] == [], seen
        # shrink() without exclude=: the error named rank 2, so nobody waited for it (gpucoll's timeout is 20 s).
        assert seen["shrink_s"] < 5.0, seen


def test_a_killed_node_is_named_at_once():
    with Cluster(2, 2, shared_home=True) as c:
        job, _ = _start(c, 2, 30.0)
        t0 = time.monotonic()
        job.kill_node(1)
        exits = _exits(job, t0)
        results = job.wait(timeout=5)
    for res in results[:2]:
        seen = _report(res)
        assert seen["error"] == "RemoteError" and seen["fails"] in ([], [seen["ops"] - 1]), (seen.get("message"), seen)
        assert seen["ranks"] == [2, 3], seen
        assert re.search(r"rank [23] \(host " + re.escape(c.hostnames[1]), seen["message"]), seen["message"]
        assert "closed its connection" in seen["message"]
        if res.rank != 0:  # rank 0 stays a while after its error (it serves the store)
            assert exits[res.rank] < 5.0, exits
    assert [res.returncode for res in results[2:]] == [-9, -9]


def test_a_cable_down_for_2_s_and_back_is_survived_exactly():
    with Cluster(2, 2, shared_home=True) as c:
        job, stop = _start(c, 2, 8.0)
        c.flap(1, 2.0)
        time.sleep(1.0)  # traffic again after the flap
        open(stop, "w").close()
        results = job.wait(timeout=60)
    for res in results:
        seen = _report(res)
        assert seen["error"] is None and seen["fails"] == [], (seen.get("message"), seen)
        assert seen["ops"] >= 20
