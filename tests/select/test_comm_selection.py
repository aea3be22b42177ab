"""The Communicator's per-call choice on the custom backend: each call goes where gpucoll/backends/select.py sends it.

The custom backend needs a GPU, so its two paths (our kernels, NCCL) record each call here instead of running it;
the selector is the real one, on recorded topologies. What is checked is the wiring: which of the backend's two paths (our kernels or
NCCL) a call takes, with which algorithm, for 'auto' and for an explicit backend='custom'."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from gpucoll import _C
from gpucoll import topology as T
from gpucoll.backends import custom as _custom_backend
from gpucoll.backends import nccl as _nccl_backend
from gpucoll.backends.base import Backend
from gpucoll.backends.select import Availability, Selector
from gpucoll.communicator import Communicator
from gpucoll.errors import InvalidArgument

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "topo"
BOTH = Availability(nccl=True, custom=True, custom_algorithms=_custom_backend.ALGORITHMS)


pytestmark = pytest.mark.usefixtures("no_selection_env")


class Recorder(_custom_backend.Custom):
    """The custom backend with its selection as it is, recording which path each call took (host buffers pass)."""

    def __init__(self, nranks, selector, chosen):
        super().__init__(None, rank=0, world_size=nranks, device=0, store=None, prefix="", timeout=5.0,
                         hosts=["h"] * nranks, p2p=[1] * nranks * nranks, nccl=None, nccl_why="not here")
        self.selector, self.chosen = selector, chosen
        self.calls = []

    def check_buffer(self, buf, arg):
        pass

    def _run(self, coll, src, dst, count, redop, root, stream, async_op, algo):
        self.calls.append(("custom", algo, count))

    def nccl_collective(self, reason, coll, src, dst, count, redop, root, stream, async_op):
        assert reason  # the model's reason is what the backend logs
        self.calls.append(("nccl", None, count))

    def close(self):
        pass


class NcclRecorder(_nccl_backend.Nccl):
    """The nccl backend's checks as they are, recording what it would enqueue (no NCCL communicator behind it)."""

    def __init__(self):
        Backend.__init__(self, None, rank=0, world_size=2)
        self.calls = []

    def check_buffer(self, buf, arg):
        pass

    def _enqueue(self, coll, src, dst, count, redop, root, stream, async_op):
        self.calls.append(("nccl", count))

    def close(self):
        pass


def comm(fixture, nranks, chosen, gpus=None, avail=BOTH):
    topo = T.load(str(FIX / fixture))
    sel = Selector(topo, rank=0, world_size=nranks, gpus=gpus if gpus is not None else list(range(nranks)),
                   avail=avail) if gpus != "unknown" else Selector(topo, rank=0, world_size=nranks, avail=avail)
    ops = Recorder(nranks, sel, chosen)
    c = Communicator(rank=0, world_size=nranks, backend="custom", ops=ops, store=None, timeout=5.0)
    return c, ops


def big(nbytes):
    return np.zeros(nbytes // 4, np.float32)  # calloc: pages are only touched if written


def test_auto_sends_small_to_our_kernels_and_large_to_nccl_on_nvlink():
    c, impl = comm("h100_8x_nvsmi.txt", 8, chosen=True)
    c.all_reduce(big(8 << 10))
    c.all_reduce(big(512 << 10))
    c.all_reduce(big(1 << 30))
    assert [k[:2] for k in impl.calls] == [("custom", "oneshot"), ("custom", "twoshot"), ("nccl", None)]


def test_explicit_custom_keeps_to_our_kernels():
    c, impl = comm("h100_8x_nvsmi.txt", 8, chosen=False)
    c.all_reduce(big(1 << 30))
    assert impl.calls[0][0] == "custom" and impl.calls[0][1] in ("twoshot", "ring", "tree")


def test_explicit_algo_wins_and_an_impossible_one_says_why():
    c, impl = comm("h100_8x_nvsmi.txt", 8, chosen=True)
    c.all_reduce(big(8 << 10), algo="custom:ring")
    c.all_reduce(big(8 << 10), algo="nccl")
    c.all_reduce(big(8 << 10), algo="ring")  # either backend's ring: the faster one predicted
    assert [k[:2] for k in impl.calls[:2]] == [("custom", "ring"), ("nccl", None)]
    assert impl.calls[2][1] in ("ring", None)
    pcie, impl = comm("pcie_4x_nvsmi.txt", 4, chosen=True)
    with pytest.raises(InvalidArgument, match="oneshot"):
        pcie.all_reduce(big(8 << 10), algo="oneshot")
    assert impl.calls == []


@pytest.mark.parametrize("fixture, nranks", [("pcie_2x_nvsmi.txt", 2), ("pcie_4x_nvsmi.txt", 4)])
def test_no_p2p_no_p2p_kernels(fixture, nranks):
    """Without P2P between the ranks' GPUs (pcie_2x: none at all, a PHB path; pcie_4x: GPU 3 reaches the others
    only through SYS), none of our kernels can run, ring included (its hops are P2P too): every call goes to NCCL."""
    topo = T.load(str(FIX / fixture))
    assert any(topo.p2p_usable(a, b) is not None for a in range(nranks) for b in range(a + 1, nranks))  # premise
    c, impl = comm(fixture, nranks, chosen=True)
    sizes = [1 << k for k in range(3, 31, 3)]
    for nbytes in sizes:
        c.all_reduce(big(nbytes))
        usable = [f"custom:{x['algorithm']}" for x in T.candidates(topo, "all_reduce", nbytes) if x["usable"]
                  and x["backend"] == "custom"]
        assert not usable, f"{fixture} at {nbytes} B: the model offers {usable} without P2P"
    assert [k[0] for k in impl.calls] == ["nccl"] * len(sizes), impl.calls


def test_p2p_kernels_where_p2p_works():
    """The control of the test above: GPUs 0-2 of pcie_4x have P2P (PIX/PXB), and small calls take our kernels."""
    c, impl = comm("pcie_4x_nvsmi.txt", 3, chosen=True)
    c.all_reduce(big(8 << 10))
    assert impl.calls[0][0] == "custom", impl.calls


def test_failed_probe_takes_a_pair_out():
    c, impl = comm("h100_8x_nvsmi.txt", 2, chosen=True)
    c.all_reduce(big(8 << 10))
    c._ops.selector.mark_p2p_failed([(0, 1)])
    c.all_reduce(big(8 << 10))
    assert [k[0] for k in impl.calls] == ["custom", "nccl"]


def test_unknown_topology():
    # auto: NCCL, which detects the machine itself; explicit custom: the backend's own size rule (algo as given).
    c, impl = comm("h100_8x_nvsmi.txt", 2, chosen=True, gpus="unknown")
    c.all_reduce(big(8 << 10))
    c2, impl2 = comm("h100_8x_nvsmi.txt", 2, chosen=False, gpus="unknown")
    c2.all_reduce(big(8 << 10), algo="custom:tree")
    assert impl.calls[0][0] == "nccl" and impl2.calls == [("custom", "tree", 2048)]


def test_what_the_backend_tells_the_selector():
    """The custom backend's availability and failed pairs, from the P2P matrix its probe agreed on."""
    be = _custom_backend.Custom(None, rank=0, world_size=3, device=0, store=None, prefix="", timeout=1.0,
                                hosts=["a", "a", "a"], p2p=[1, 1, 0, 1, 1, 1, 1, 1, 1], nccl=None,
                                nccl_why="no NCCL here")
    assert be.p2p_failed_pairs() == [(0, 2)]
    a = be.availability()
    assert a.custom and not a.nccl and "no NCCL here" in a.nccl_why
    assert set(a.custom_algorithms) >= {"all_reduce:oneshot", "all_reduce:twoshot"}


def test_auto_never_takes_custom_without_a_gpu():
    if _C.cuda_probe().get("device_count"):
        pytest.skip("checks a machine without a CUDA device (this one has one, emulated or real)")
    assert not _custom_backend.takes_auto(2)


def test_nccl_backend_refuses_our_algorithms():
    impl = NcclRecorder()
    c = Communicator(rank=0, world_size=2, backend="nccl", ops=impl, store=None, timeout=5.0)
    x = big(4096)
    with pytest.raises(InvalidArgument, match="algo='oneshot' cannot run on backend='nccl'"):
        c.all_reduce(x, algo="oneshot")
    c.all_reduce(x, algo="nccl:ring")
    c.all_reduce(x)
    # both reach the backend's one entry point, with no algorithm forwarded (NCCL chooses its own)
    assert impl.calls == [("nccl", 1024), ("nccl", 1024)]
