"""The per-communicator selector (gpucoll/backends/select.py) on recorded topologies with faked backend availability."""

from __future__ import annotations

import math
import pathlib
import threading

import pytest
from helpers import run_threads

from gpucoll import _C
from gpucoll import topology as T
from gpucoll.backends import select as _select
from gpucoll.backends.select import Availability, Selector
from gpucoll.errors import InvalidArgument, Unsupported

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "topo"
SIZES = [8 << k for k in range(0, 28, 2)] + [1 << 30]  # 8 B .. 1 GiB
BOTH = Availability(nccl=True, custom=True)
P2P_KERNELS = {"oneshot", "twoshot", "ring", "tree"}


pytestmark = pytest.mark.usefixtures("no_selection_env")


def load(name):
    return T.load(str(FIX / name))


def selector(name, nranks=None, avail=BOTH, gpus=None, **kw):
    t = load(name)
    n = nranks or t.num_gpus
    return Selector(t, rank=0, world_size=n, gpus=list(gpus if gpus is not None else range(n)), avail=avail, **kw)


def table(sel, coll="all_reduce", **kw):
    return {s: sel.choose(coll, s, **kw) for s in SIZES}


@pytest.mark.parametrize("name", ["h100_8x_nvsmi.txt", "a100_8x_nvsmi.txt", "a100_8x_nccl.xml"])
def test_nvlink_full_mesh_small_custom_large_nccl(name):
    tab = table(selector(name))
    for s in (8, 2 << 10, 32 << 10):
        assert (tab[s].backend, tab[s].algorithm) == ("custom", "oneshot"), (s, tab[s])
    assert (tab[512 << 10].backend, tab[512 << 10].algorithm) == ("custom", "twoshot")
    assert tab[1 << 30].backend == "nccl"
    backends = [tab[s].backend for s in SIZES]
    assert backends == sorted(backends, key=lambda b: b == "nccl")  # once NCCL wins it keeps winning
    assert all(c.predicted_time > 0 and c.link_class == "NVL" for c in tab.values())
    assert "fastest predicted" in tab[8].reason


def test_custom_backend_with_fewer_algorithms():
    sel = selector("h100_8x_nvsmi.txt", avail=Availability(nccl=True, custom=True, custom_algorithms=("oneshot",)))
    tab = table(sel)
    assert tab[8].algorithm == "oneshot" and all(c.algorithm != "twoshot" for c in tab.values())
    with pytest.raises(InvalidArgument, match="does not implement twoshot for all_reduce yet"):
        sel.choose("all_reduce", 1 << 20, algo="twoshot")


def test_allreduce_only_custom_backend():
    # What issue 5's kernels cover (the default when the custom backend does not list ALGORITHMS).
    sel = selector("h100_8x_nvsmi.txt", avail=Availability(nccl=True, custom=True,
                                                           custom_algorithms=_select._CUSTOM_DEFAULT))
    assert sel.choose("all_reduce", 8).backend == "custom"
    assert sel.choose("broadcast", 8).backend == "nccl" and sel.choose("all_gather", 8 << 10).backend == "nccl"
    with pytest.raises(InvalidArgument, match="does not implement oneshot for broadcast"):
        sel.choose("broadcast", 8, algo="custom:oneshot")


@pytest.mark.parametrize("name", ["pcie_2x_nvsmi.txt", "pcie_4x_nvsmi.txt", "pcie_4x_nccl.xml"])
def test_no_p2p_no_p2p_kernels(name):
    for s, c in table(selector(name)).items():
        assert c.backend == "nccl", (s, c)
        assert c.algorithm not in P2P_KERNELS or c.backend != "custom"


def test_p2p_reported_but_failing():
    sel = selector("h100_8x_nvsmi.txt")
    assert sel.choose("all_reduce", 8).backend == "custom"
    sel.mark_p2p_failed([(2, 5)])  # the cache is dropped: the next call sees the failure
    for s, c in table(sel).items():
        # Kernels that touch every pair are out; a ring may still run, around the failed pair.
        assert c.backend != "custom" or c.algorithm == "ring", (s, c)
    with pytest.raises(InvalidArgument, match=r"oneshot needs working P2P.*GPU 2 and GPU 5: P2P is reported but "
                                              r"failed.*rank 2: GPU2"):
        sel.choose("all_reduce", 1024, algo="oneshot")


def test_multi_node_hierarchical():
    tab = table(selector("h100_2node_16x.json"))
    # Across nodes: our two-level algorithm where the model prices it faster, NCCL's own pick elsewhere.
    assert {c.backend for c in tab.values()} == {"custom+nccl", "nccl"}, tab
    assert all(c.algorithm == "hierarchical" for c in tab.values() if c.backend == "custom+nccl")
    # A custom backend that cannot run the intra-node phases leaves the whole call to NCCL.
    sel = selector("h100_2node_16x.json", avail=Availability(nccl=True, custom=True, custom_algorithms=("oneshot",)))
    assert {c.backend for c in table(sel).values()} == {"nccl"}
    with pytest.raises(InvalidArgument, match="inside one node"):
        sel.choose("all_reduce", 1 << 20, algo="oneshot")


def test_explicit_algo_and_env_win(monkeypatch):
    sel = selector("h100_8x_nvsmi.txt")
    assert sel.choose("all_reduce", 8, algo="nccl:ring").backend == "nccl"
    c = sel.choose("all_reduce", 1 << 30, algo="oneshot")
    assert (c.backend, c.algorithm) == ("custom", "oneshot") and c.reason.startswith("requested")
    assert sel.choose("all_reduce", 8, backend="nccl").backend == "nccl"  # an explicit backend keeps to its own
    monkeypatch.setenv("GPUCOLL_ALGO", "allreduce:nccl:ring")
    fresh = selector("h100_8x_nvsmi.txt")
    assert (fresh.choose("all_reduce", 8).backend, fresh.choose("all_reduce", 8).algorithm) == ("nccl", "ring")
    assert fresh.choose("all_reduce", 8, algo="twoshot").algorithm == "twoshot"  # algo= beats the variable
    assert fresh.choose("broadcast", 8).backend == "custom"  # the variable names all_reduce only


def test_impossible_requests_say_why():
    sel = selector("pcie_4x_nvsmi.txt")
    with pytest.raises(InvalidArgument, match=r"oneshot needs working P2P between every pair: GPU 0 and GPU 3: the "
                                              r"path is SYS.*rank 3: GPU3"):
        sel.choose("all_reduce", 1024, algo="oneshot")
    with pytest.raises(InvalidArgument, match=r"restricted to backend='nccl'"):
        selector("h100_8x_nvsmi.txt").choose("all_reduce", 8, algo="oneshot", backend="nccl")
    no_custom = Availability(nccl=True, custom=False, custom_why="the custom kernels were not built (no nvcc)")
    with pytest.raises(InvalidArgument, match="custom backend not available: the custom kernels were not built"):
        selector("h100_8x_nvsmi.txt", avail=no_custom).choose("all_reduce", 8, algo="custom:oneshot")
    with pytest.raises(InvalidArgument, match="names no backend or algorithm"):
        sel.choose("all_reduce", 8, algo="warp_drive")
    with pytest.raises(InvalidArgument, match="backend='host' takes CPU buffers"):
        sel.choose("all_reduce", 8, backend="host")
    nothing = Availability(nccl=False, custom=False, nccl_why="libnccl.so.2 not found")
    with pytest.raises(InvalidArgument, match="no backend can run all_reduce.*libnccl.so.2 not found"):
        selector("h100_8x_nvsmi.txt", avail=nothing).choose("all_reduce", 8)


def test_every_collective_has_a_gpu_choice():
    sel = selector("h100_8x_nvsmi.txt")
    for coll in _C.coll_names():
        for s in (1 << 10, 1 << 30):
            c = sel.choose(coll, s)
            assert c.backend in ("custom", "nccl") and c.predicted_time > 0, (coll, s, c)
    # Rooted patterns are bound by the root's link: scatter's busbw cannot beat the NVLink rate (450 GB/s).
    big = T.select(load("h100_8x_nvsmi.txt"), "scatter", 1 << 30)
    assert big["busbw"] / 1e9 < 500


def test_cache_per_bucket():
    sel = selector("h100_8x_nvsmi.txt")
    a = sel.choose("all_reduce", 3000 * 4)
    assert sel.choose("all_reduce", 4096 * 4) is a  # same bucket (16 KiB)
    assert sel.choose("all_reduce", 4097 * 4) is not a
    assert _select.size_bucket(0) == 0 and _select.size_bucket(1) == 1 and _select.size_bucket(1025) == 2048


def test_cpu_buffers_use_the_host_selector(monkeypatch):
    sel = Selector(T.Topology(), rank=0, world_size=4, gpus=None, avail=Availability(), local_size=0)
    c = sel.choose("all_reduce", 64 << 10, device="cpu")
    assert c.backend == "host" and c.algorithm == _C.select_algorithm(0, 4, 64 << 10, 0, "auto")
    assert c.predicted_time > 0
    assert sel.choose("all_reduce", 64 << 10, algo="ring", device="cpu").algorithm == "ring"
    assert sel.choose("all_reduce", 64 << 10, algo="host:tree", device="cpu").algorithm == "tree"
    with pytest.raises(InvalidArgument, match="CPU buffers run on the host backend"):
        sel.choose("all_reduce", 8, device="cpu", backend="nccl")
    monkeypatch.setenv("GPUCOLL_ALGO", "allreduce:dbt")
    assert Selector(T.Topology(), rank=0, world_size=4).choose("all_reduce", 8, device="cpu").algorithm == "dbt"


def test_irregular_placement_falls_back_to_nccl():
    t = load("h100_2node_16x.json")
    sel = Selector(t, rank=0, world_size=3, gpus=[0, 1, 8], avail=BOTH)
    c = sel.choose("all_reduce", 1 << 20)
    assert (c.backend, c.algorithm) == ("nccl", "auto") and math.isnan(c.predicted_time)
    assert "different numbers of ranks" in c.reason
    with pytest.raises(InvalidArgument, match="needs the ranks' GPU topology"):
        sel.choose("all_reduce", 1 << 20, algo="oneshot")
    interleaved = Selector(t, rank=0, world_size=4, gpus=[0, 8, 1, 9], avail=BOTH)
    assert "not grouped by host" in interleaved.choose("all_reduce", 8).reason


def test_ranks_sharing_a_gpu():
    # CI runners with one GPU: several ranks on GPU 0. P2P between a GPU and itself always works.
    c = selector("pcie_2x_nvsmi.txt", nranks=2, gpus=[0, 0]).choose("all_reduce", 8)
    assert c.backend == "custom"


def test_availability_merge():
    a = Availability(nccl=True, custom=True, custom_algorithms=("oneshot", "twoshot")).record()
    b = Availability(nccl=False, custom=True, nccl_why="libnccl.so.2 not found",
                     custom_algorithms=("oneshot",)).record()
    m = Availability.merged([a, b])
    assert not m.nccl and m.nccl_why == "rank 1: libnccl.so.2 not found"
    assert m.custom and m.custom_algorithms == ("oneshot",) and m.host


def test_place_ranks():
    t = load("h100_2node_16x.json")
    recs = [{"host": h, "device": d, "bus_id": ""} for h in ("nodeA", "nodeB") for d in range(2)]
    # No host name matches (a topology file describing other machines): hosts are matched in order.
    assert _select.place_ranks(t, recs) == ([0, 1, 8, 9], "")
    recs[3]["device"] = 9
    gpus, why = _select.place_ranks(t, recs)
    assert gpus is None and "CUDA device 9" in why
    gpus, why = _select.place_ranks(T.Topology(), [{"host": "x", "device": 0, "bus_id": ""}])
    assert gpus is None and "no GPUs" in why
    assert _select.place_ranks(t, [{"host": "x", "device": None, "bus_id": ""}])[0] is None


class ThreadStore:
    """The bootstrap store's interface (set, get with timeout, add) in memory, for ranks run as threads."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = v
            self.cv.notify_all()

    def get(self, k, timeout=None):
        with self.cv:
            assert self.cv.wait_for(lambda: k in self.d, timeout=timeout or 10), f"no key {k}"
            return self.d[k]

    def add(self, k, n):
        with self.cv:
            self.d[k] = int(self.d.get(k, 0)) + n
            return self.d[k]


def build_ranks(n, store, **kw_of_rank):
    """Every rank's Selector, ranks as threads; kw_of_rank: argument name -> f(rank)."""
    out = [None] * n

    def run(r):
        out[r] = _select.build(store, r, n, **{k: v(r) for k, v in kw_of_rank.items()})

    run_threads(n, run)
    return out


def test_build_through_store_same_choice_everywhere():
    h100 = load("h100_8x_nvsmi.txt")
    store = ThreadStore()
    sels = build_ranks(4, store, device=lambda r: r, local_topology=lambda r: h100,
                       avail=lambda r: BOTH if r != 3 else Availability(nccl=True, custom=True,
                                                                         custom_algorithms=("oneshot", "twoshot")))
    assert {s.choose("all_reduce", 8) for s in sels} == {sels[0].choose("all_reduce", 8)}
    assert sels[0].choose("all_reduce", 8).backend == "custom" and sels[0].gpus == [0, 1, 2, 3]
    assert sels[1].avail.custom_algorithms == ("oneshot", "twoshot")
    # A second communicator over the same store, where rank 2's real-copy probe failed between ranks 1 and 2.
    sels = build_ranks(4, store, device=lambda r: r, local_topology=lambda r: h100,
                       avail=lambda r: BOTH, p2p_failed=lambda r: [(1, 2)] if r == 2 else [])
    for s in sels:
        # Kernels that need every pair are out; a ring may still go round the failed pair (0-1-3-2).
        used = {(c.backend, c.algorithm) for c in table(s).values()}
        assert not used & {("custom", "oneshot"), ("custom", "twoshot"), ("custom", "tree")}, used
        assert s.topology.link_p2p(1, 2) == "failed"


def test_build_from_topo_file(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUCOLL_TOPO_FILE", str(FIX / "pcie_4x_nvsmi.txt"))
    sels = build_ranks(2, ThreadStore(), device=lambda r: r, avail=lambda r: BOTH)
    assert sels[0].gpus == [0, 1] and sels[0].choose("all_reduce", 8).backend == "custom"  # GPU0-GPU1 is PIX


def test_detection_here_falls_back():
    """This machine: no GPU, no NVML. Detection gives an empty GPU topology; CPU buffers go to the host backend,
    CUDA buffers to NCCL when it is available (it detects the machine itself) and nowhere otherwise."""
    sel = build_ranks(1, ThreadStore(), device=lambda r: None)[0]
    assert sel.topology.num_gpus == 0 or _C.cuda_probe()["device_count"] > 0
    assert sel.choose("all_reduce", 1 << 20, device="cpu").backend == "host"
    nccl_only = build_ranks(1, ThreadStore(), device=lambda r: 0,
                            avail=lambda r: Availability(nccl=True, custom=False))[0]
    if nccl_only.topology.num_gpus == 0:
        c = nccl_only.choose("all_reduce", 1 << 20)
        assert (c.backend, c.algorithm) == ("nccl", "auto") and "no GPUs" in c.reason
        none = build_ranks(1, ThreadStore(), device=lambda r: 0,
                           avail=lambda r: Availability(nccl=False, nccl_why="no usable CUDA GPU"))[0]
        with pytest.raises(Unsupported, match="no usable CUDA GPU"):
            none.choose("all_reduce", 8)
    probed = _select.probe_availability()
    assert probed.host and (probed.nccl or probed.nccl_why) and (probed.custom or probed.custom_why)
