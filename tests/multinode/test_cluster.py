"""The multi-node fixture itself (gpucoll.testing.cluster): nodes come up with their own hostname, address and HOME,
reach each other only over the veth network, lose each other when a cable is cut, and leave nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gpucoll.testing import cluster
from gpucoll.testing.cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.spawns]

# What a rank reports about where it runs: the launcher's view (gpucoll's own reader of it) and the machine's.
_WHERE = textwrap.dedent("""
    import json, os, socket
    from gpucoll.bootstrap.env import detect_launch
    l = detect_launch()
    print(json.dumps({"rank": l.rank, "world": l.world_size, "local": l.local_rank, "local_world": l.local_world_size,
                      "address": l.address, "port": l.port, "launcher": l.launcher, "host": socket.gethostname(),
                      "ip": socket.gethostbyname(socket.gethostname()), "home": os.environ["HOME"]}))
""")


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def _where(c: Cluster) -> list[dict]:
    results = c.run([sys.executable, "-c", _WHERE], timeout=60)
    assert all(r.returncode == 0 for r in results), [(r.rank, r.stderr) for r in results]
    return [json.loads(r.stdout) for r in results]


def test_two_clusters_come_up_run_and_go_down_within_60_s_leaving_nothing():
    links, t0 = _root_links(), time.monotonic()
    for nodes, per_node in ((2, 2), (4, 2)):
        with Cluster(nodes, per_node) as c:
            tag, workdir = c.tag, c.workdir
            seen = _where(c)
            assert [s["rank"] for s in seen] == list(range(nodes * per_node))
            for s in seen:
                node, local = divmod(s["rank"], per_node)
                assert s["host"] == c.hostnames[node] and s["ip"] == c.addresses[node]
                assert (s["world"], s["local"], s["local_world"]) == (nodes * per_node, local, per_node)
                assert (s["address"], s["port"], s["launcher"]) == (c.addresses[0], 29500, "torchrun")
                assert s["home"] == c.home(node)
            assert len({s["home"] for s in seen}) == nodes
            pids = [p.pid for job in c._jobs for p in job.procs]
        assert cluster.leftovers(tag) == [], "namespaces left behind"
        assert not os.path.exists(workdir)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "processes left behind"
    assert time.monotonic() - t0 < 60
    assert _root_links() == links, "the machine's own network changed"


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_other_launchers_variables_name_the_same_ranks_and_rendezvous(launcher):
    with Cluster(2, 2, launcher=launcher, shared_home=True) as c:
        seen = _where(c)
    for s in seen:
        assert (s["world"], s["local"], s["local_world"]) == (4, s["rank"] % 2, 2)
        assert s["launcher"] == launcher
        # Under srun the address is rank 0's node, from the step's node list: a hostname the nodes resolve.
        assert s["address"] == (c.hostnames[0] if launcher == "slurm" else c.addresses[0])
    assert len({s["home"] for s in seen}) == 1


_SERVE = "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); print('up', flush=True); s.accept(); " \
         "print('accepted', flush=True)"
# One dial, or, after a cable comes back (the bridge port and ARP take a moment), dials until the deadline.
_DIAL = ("import socket,sys,time\nend = time.monotonic() + float(sys.argv[2])\nwhile True:\n    try:\n"
         "        socket.create_connection((sys.argv[1], 7000), timeout=max(0.1, end - time.monotonic())); break\n"
         "    except OSError:\n        if sys.argv[3] == '0' or time.monotonic() > end: raise\n        time.sleep(0.1)\n"
         "print('ok')")


def test_nodes_meet_only_over_the_network_and_a_cut_cable_separates_them():
    with Cluster(2) as c:
        def dial(host, timeout=2.0, retry=False):
            return c.exec(1, [sys.executable, "-c", _DIAL, host, str(timeout), "1" if retry else "0"],
                          timeout=timeout + 20)

        def serve(host):
            p = c.spawn(0, [sys.executable, "-c", _SERVE, host], stdout=subprocess.PIPE)
            assert p.stdout.readline() == b"up\n"
            return p

        local = serve("127.0.0.1")  # node 0's loopback is node 0's alone
        assert dial("127.0.0.1").returncode != 0
        local.kill()
        server = serve(c.addresses[0])
        c.cut(1)
        assert dial(c.hostnames[0]).returncode != 0
        c.restore(1)
        reached = dial(c.hostnames[0], timeout=10, retry=True)
        assert reached.returncode == 0, reached.stderr
        server.wait(timeout=10)


def test_a_cluster_whose_maker_was_killed_is_removed_by_the_next_one():
    program = "import time; from gpucoll.testing.cluster import Cluster\n" \
              "c = Cluster(2).up(); print(c.tag, flush=True); time.sleep(600)"
    maker = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    tag = maker.stdout.readline().strip()
    assert len(cluster.leftovers(tag)) == 3  # two nodes and the switch
    maker.send_signal(signal.SIGKILL)
    maker.wait()
    with Cluster(1):
        assert cluster.leftovers(tag) == []


def test_the_command_line_runs_every_rank_prefixes_its_lines_and_returns_the_worst_status():
    argv = [sys.executable, "-m", "gpucoll.testing.cluster", "--nodes", "2", "--ranks-per-node", "2", "--",
            "sh", "-c", 'echo "$RANK on $(hostname)"; exit $((RANK == 3 ? 5 : 0))']
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 5, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert [line.split()[0] for line in lines] == ["[0]", "[1]", "[2]", "[3]"]
    assert lines[0].endswith("0 on " + lines[0].split()[-1]) and lines[0].split()[-1].startswith("node0-")
    assert lines[3].split()[-1].startswith("node1-")
    assert "[3] exited with status 5" in done.stderr
    nothing = subprocess.run([sys.executable, "-m", "gpucoll.testing.cluster"], capture_output=True, check=False)
    assert nothing.returncode == 2
