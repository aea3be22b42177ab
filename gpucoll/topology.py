"""The machine's wiring as a value, and the topology-aware choice of backend and algorithm.

The value lives in the C++ core (``csrc/topo/``); this module is its Python face::

    topo = gpucoll.topology.detect()                  # NVML + sysfs + CUDA driver; GPUCOLL_TOPO_FILE replaces it
    topo = gpucoll.topology.from_nvidia_smi(text)      # `nvidia-smi topo -m` as pasted
    topo = gpucoll.topology.from_nccl_xml(text)        # NCCL_TOPO_DUMP_FILE output
    topo = gpucoll.topology.load("topo.json"); gpucoll.topology.dump(topo, "topo.json")
    gpucoll.topology.select(topo, "all_reduce", 1 << 20)   # {'backend': 'custom', 'algorithm': 'twoshot', ...}

Across ranks, :func:`merge_through_store` exchanges every rank's view through the bootstrap store and groups
ranks by host, so every rank ends with the same multi-host value.
"""

from __future__ import annotations

import json
import socket

from gpucoll._native import _C, LOAD_ERROR

Topology = None if LOAD_ERROR else _C.Topology  # the value type (None where the native core did not load)


def detect() -> Topology:
    """This machine's topology. Never fails for a missing driver/NVML/GPU: ``notes`` says what was missing."""
    return _C.topo_detect()


def from_nvidia_smi(text: str) -> Topology:
    return _C.topo_from_nvidia_smi(text)


def from_nccl_xml(text: str) -> Topology:
    return _C.topo_from_nccl_xml(text)


def from_json(text: str) -> Topology:
    return Topology.from_json(text)


def from_text(text: str) -> Topology:
    """Any of the three formats, told apart by the first character."""
    return _C.topo_from_text(text)


def load(path: str) -> Topology:
    with open(path) as f:
        return from_text(f.read())


def dump(topo: Topology, path: str) -> None:
    with open(path, "w") as f:
        f.write(topo.to_json())


def to_dict(topo: Topology) -> dict:
    return json.loads(topo.to_json())


def merge(parts) -> Topology:
    """One value from several views: grouped by host name, GPUs unioned by bus id; pairs across hosts are NET."""
    return _C.topo_merge(list(parts))


def replicate(topo: Topology, nodes: int) -> Topology:
    """``nodes`` copies of a single-host topology (explain a multi-node job from one node's description)."""
    return _C.topo_replicate(topo, nodes)


def merge_through_store(store, rank: int, world_size: int, local: Topology | None = None,
                        prefix: str = "gpucoll/topo", timeout: float | None = None) -> Topology:
    """Every rank publishes its view under ``prefix/<rank>`` and merges all of them (same result on every rank).

    ``store`` is a gpucoll bootstrap store (``set(key, bytes)``, ``get(key, timeout=...)``). A rank's view is
    named by its hostname, so ranks of one host collapse into one host entry and ranks are grouped by host.
    """
    return exchange_through_store(store, rank, world_size, local, prefix=prefix, timeout=timeout)[0]


def exchange_through_store(store, rank: int, world_size: int, local: Topology | None = None, extra=None,
                           prefix: str = "gpucoll/topo", timeout: float | None = None):
    """:func:`merge_through_store` that also carries one JSON-able record per rank (``extra``: this rank's, e.g.
    its hostname and GPU); returns ``(merged topology, [every rank's record, by rank])``."""
    local = local if local is not None else detect()
    d = to_dict(local)
    if d["hosts"] and d["hosts"][0]["name"] in ("", "localhost"):
        d["hosts"][0]["name"] = socket.gethostname()
    store.set(f"{prefix}/{rank}", json.dumps({"topology": d, "extra": extra}).encode())
    views, records = [], []
    for r in range(world_size):
        raw = store.get(f"{prefix}/{r}", timeout=timeout) if timeout is not None else store.get(f"{prefix}/{r}")
        doc = json.loads(raw.decode())
        if "topology" not in doc:  # a bare topology document (an older writer)
            doc = {"topology": doc, "extra": None}
        views.append(Topology.from_json(json.dumps(doc["topology"])))
        records.append(doc["extra"])
    return merge(views), records


def hosts_of_ranks(topo: Topology) -> dict:
    """Host name -> global GPU indices, in order: how ranks are grouped by host."""
    return {name: topo.host_gpus(h) for h, name in enumerate(topo.host_names())}


def nccl_version_number(version) -> int:
    """"2.21.5" or 22105 -> 22105 (ncclGetVersion's encoding); "" or 0 -> 0 (unknown: NCCL >= 2.23's rules)."""
    if not version:
        return 0
    if isinstance(version, int):
        return version
    parts = [int(x) for x in str(version).split(".")]
    if len(parts) != 3:
        raise ValueError(f"NCCL version {version!r}: expected MAJOR.MINOR.PATCH, e.g. 2.21.5")
    return parts[0] * 10000 + parts[1] * 100 + parts[2]


def candidates(topo: Topology, coll: str, nbytes: int, dtype: str = "float32", nranks_per_node: int = 0,
               nodes: int = 0, custom: bool = True, nccl: bool = True, host: bool = True, tuning: str = "",
               custom_algorithms=(), nccl_version=0) -> list:
    """Every backend/algorithm priced for the call (usable or not, with reasons). ``custom_algorithms``: what
    the custom backend implements ("all_reduce:oneshot", or "oneshot" for every collective; empty: all).
    NCCL candidates carry NCCL's own estimate (``tuner_seconds``) and whether NCCL's tuner picks them
    (``nccl_auto``); every candidate says how sure the model is (``confidence``)."""
    return _C.topo_candidates(topo, coll, nbytes, dtype, nranks_per_node, nodes, custom, nccl, host, tuning,
                              custom_algorithms=list(custom_algorithms),
                              nccl_version=nccl_version_number(nccl_version))


def select(topo: Topology, coll: str, nbytes: int, dtype: str = "float32", nranks_per_node: int = 0,
           nodes: int = 0, algo: str = "auto", custom: bool = True, nccl: bool = True, host: bool = True,
           tuning: str = "", custom_algorithms=(), nccl_version=0) -> dict:
    """The chosen backend/algorithm. ``algo`` ("oneshot", "nccl", "nccl:ring", ...) or GPUCOLL_ALGO wins; an
    impossible one raises InvalidArgument saying why. ``nccl_version`` ("2.21.5"): NCCL's P2P rule depends on it."""
    return _C.topo_select(topo, coll, nbytes, dtype, nranks_per_node, nodes, custom, nccl, host, algo, tuning,
                          custom_algorithms=list(custom_algorithms),
                          nccl_version=nccl_version_number(nccl_version))


def ring(topo: Topology, gpus, require_p2p: bool = False) -> list:
    return _C.topo_build_ring(topo, list(gpus), require_p2p)


def trees(topo: Topology, nranks_per_node: int = 0, nodes: int = 0) -> dict:
    """NCCL-style trees: a chain inside each node in ring order, a binary tree over the nodes' first GPUs.
    Returns {"chains": [[gpu, ...] per node], "inter": [(parent_node, child_node), ...]}."""
    n_nodes, local, gpus = _C.topo_layout(topo, nranks_per_node, nodes)
    chains = [ring(topo, gpus[n * local:(n + 1) * local]) for n in range(n_nodes)]
    inter = [((c - 1) // 2, c) for c in range(1, n_nodes)]
    return {"chains": chains, "inter": inter}
