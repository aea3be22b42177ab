"""What runs across machines, on "nodes" of this machine (gpucoll.testing.cluster): the rendezvous over the network,
the secret-file cases, the merged topology, and CPU collectives across nodes (host backend: shared memory inside a
node, gloo between nodes; gpucoll.torch's CPU tensors). Every collective is checked exactly (tests/multinode/
node_rank.py)."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

import helpers
import pytest

from gpucoll.testing.cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.spawns]

RANK = str(Path(__file__).resolve().parent / "node_rank.py")
EXAMPLES = Path(__file__).resolve().parents[2] / "gpucoll" / "topo_examples"


def _secret() -> dict:
    return {"GPUCOLL_STORE_SECRET": secrets.token_hex(32)}


def _reports(results) -> list[dict]:
    out = []
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert r.returncode == 0 and lines, f"rank {r.rank} exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
        out.append(json.loads(lines[-1]))
    return out


def _run(c: Cluster, mode: str, env=None, timeout=240) -> list[dict]:
    return _reports(c.run([sys.executable, RANK, mode], env=env, timeout=timeout))


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (4, 1), (3, 2)])
def test_every_collective_is_exact_across_nodes_on_the_host_backend(nodes, per_node):
    with Cluster(nodes, per_node) as c:
        reports = _run(c, "host", env=_secret())
    for rank, rep in enumerate(reports):
        assert "error" not in rep, rep.get("trace")
        assert rep["fails"] == [], f"rank {rank}: {rep['fails'][:10]}"
        assert rep["backend"] == "HostNodes" and rep["algorithm"] == "hierarchical:shm+gloo"
    # The store listens on the address the ranks were given (MASTER_ADDR), not on every interface.
    assert reports[0]["bound"] == [c.addresses[0], 29500]


def test_communicators_split_across_nodes_meet_and_are_exact():
    with Cluster(3, 2) as c:
        reports = _run(c, "split", env=_secret())
    for rep in reports:
        assert "error" not in rep, rep.get("trace")
        assert rep["fails"] == [], rep["fails"][:10]
        assert rep["kinds"]["by_local_rank"] == "HostNodes" and rep["kinds"]["by_node"] == "Host"
    assert [rep["kinds"].get("subgroup") for rep in reports] == ["HostNodes"] * 2 + [None] * 2 + ["HostNodes"] * 2


def test_nodes_without_a_shared_home_are_refused_naming_the_secret_file_and_rank_0_says_why():
    with Cluster(2, 2) as c:
        reports = _run(c, "host", env={"T": "6"})
    for rep in reports[2:]:  # node 1 made its own per-user secret file
        assert rep["error"] == "SecretRefused", rep
        assert f"{c.home(1)}/.gpucoll/store_secret" in rep["message"] and "GPUCOLL_STORE_SECRET" in rep["message"]
    for rep in reports[:2]:  # node 0's ranks wait for node 1's, and learn that the store turned them away
        assert rep["error"] == "CollectiveTimeout", rep
        assert f"from {c.addresses[1]}=" in rep["message"] and "GPUCOLL_STORE_SECRET" in rep["message"]


def test_a_shared_home_or_one_secret_lets_the_nodes_meet():
    with Cluster(2, 1, shared_home=True) as c:
        assert all(rep["fails"] == [] and "error" not in rep for rep in _run(c, "host"))


def test_the_merged_topology_has_one_host_per_node_and_the_choice_is_the_node_aware_one():
    with Cluster(2, 2) as c:
        env = {**_secret(), "TOPO_EXAMPLE": str(EXAMPLES / "h100_8x_nvsmi.txt")}
        reports = _run(c, "topology", env=env)
    for rep in reports:
        assert rep["hosts"] == c.hostnames
        assert rep["chosen"] == rep["modelled"]
        assert rep["chosen"]["link_class"] == "NET"  # the inter-node hop, priced as the network
    assert len({json.dumps(rep["chosen"]) for rep in reports}) == 1


@pytest.mark.parametrize("backend", ["gpucoll", "cpu:gloo,cuda:gpucoll"])
def test_torch_cpu_tensors_run_across_nodes(backend):
    helpers.require("torch")
    with Cluster(2, 2) as c:
        reports = _run(c, "torch", env={"TORCH_BACKEND": backend})
    assert all(rep["fails"] == [] and "error" not in rep for rep in reports), reports


def _hide_torch(tmp_path) -> str:
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch is hidden by the test')\n")
    return str(tmp_path)


def test_a_job_launched_under_mpi_moves_data_between_nodes_through_mpi_without_torch(tmp_path):
    helpers.require("mpi4py")
    with Cluster(2, 2) as c:
        env = {"UNDER_MPI": "1", "PYTHONPATH": _hide_torch(tmp_path), "REPORT_DIR": str(tmp_path)}
        done = c.mpiexec([sys.executable, RANK, "host"], env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(rep.get("rank", -1) for rep in reports) == [0, 1, 2, 3], done.stdout[-3000:]
    for rep in reports:
        assert "error" not in rep, rep.get("trace")
        assert rep["fails"] == [], rep["fails"][:10]
        assert rep["backend"] == "HostNodes" and rep["algorithm"] == "hierarchical:shm+MPI"


def test_without_torch_the_host_backend_across_nodes_says_what_it_needs(tmp_path):
    with Cluster(2, 1) as c:
        reports = _run(c, "no_torch", env={**_secret(), "PYTHONPATH": _hide_torch(tmp_path)})
    for rep in reports:
        assert rep["error"] == "Unsupported", rep
        assert "2 machines" in rep["message"] and "gloo" in rep["message"] and "pip install torch" in rep["message"]
