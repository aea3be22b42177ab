"""The NCCL backend against what only gpucoll's NCCL stand-in can do (GPUCOLL_CUDA=emulate builds; skipped with the
reason elsewhere): injected faults (a rank that never arrives at init or at an operation, an asynchronous error),
other NCCL versions (NCCL_EMU_VERSION) and device shapes (GPUCOLL_EMU_*), argument errors NCCL returns at once, and
messages of many channel chunks (NCCL_EMU_CHUNK_BYTES). The stand-in is csrc/emulation/nccl/; faults are described
in its faults.cc.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import helpers
import nccl_ranks
import numpy as np
import pytest
from nccl_ranks import Arrays

import gpucoll
from gpucoll import _C
from gpucoll._spawn import free_port
from gpucoll.errors import CollectiveTimeout, NcclError, Unsupported

pytestmark = [pytest.mark.spawns, pytest.mark.gpu,
              pytest.mark.skipif(not _C.build_info().get("cuda_emulated"),
                                 reason="needs gpucoll's emulated device and its NCCL stand-in (GPUCOLL_CUDA=emulate)")]


def stand_in():
    """The loaded stand-in, for its ncclEmuInjectFault."""
    from gpucoll import _nccl

    lib = ctypes.CDLL(_nccl.load()["path"])
    lib.ncclEmuInjectFault.argtypes = [ctypes.c_char_p]
    lib.ncclEmuInjectFault.restype = ctypes.c_int
    return lib


def device_of(comm) -> int:
    return int(comm.device.split(":")[1])


def test_the_loader_defaults_to_the_stand_in():
    from gpucoll import _nccl

    state = _nccl.load()
    assert state["loaded"] and state["source"] == "emulator", state
    assert state["path"].endswith("/_emu/libnccl-emu.so")
    out = subprocess.run([sys.executable, "-m", "gpucoll", "info"], capture_output=True, text=True, timeout=120,
                         check=True)
    assert "NCCL stand-in for the emulated device (not NVIDIA's NCCL" in out.stdout, out.stdout


# -- faults ------------------------------------------------------------------------------------------------------

def _async_error_worker(comm):
    """Every rank's second operation meets an injected asynchronous error: the communicator must be aborted with
    NCCL's reason, whoever finds the error first (the call polling NCCL, or the watchdog), and the Work and every
    later call raise it."""
    assert stand_in().ncclEmuInjectFault(b"error:op=2:code=6") == 0
    A = Arrays("device_array", device_of(comm))
    x = A.put(np.arange(32, dtype=np.float32), "float32")
    comm.all_reduce(x)
    problems = []

    def named(e) -> None:
        for part in ("asynchronous error", "ncclRemoteError", "injected fault", f"rank {comm.rank}"):
            if part not in str(e):
                problems.append(f"the error does not say {part!r}: {e}")

    try:
        comm.all_reduce(x, async_op=True).synchronize()  # released by the abort
        problems.append("synchronize() did not raise")
    except NcclError as e:
        named(e)
    try:
        comm.all_reduce(x)
        problems.append("a later call did not raise")
    except NcclError as e:
        named(e)
    return problems


def test_injected_async_error_aborts_with_the_reason():
    assert gpucoll.spawn(_async_error_worker, 2, backend="nccl", timeout=60.0) == [[], []]


def _error_found_by_a_call_worker(comm):
    """With the watchdog slowed down, a later call is what finds the asynchronous error (NCCL keeps it on the
    communicator): the Works issued before it must not report completion, and later calls raise the same error."""
    assert stand_in().ncclEmuInjectFault(b"error:op=2:code=2") == 0
    A = Arrays("device_array", device_of(comm))
    x = A.put(np.arange(32, dtype=np.float32), "float32")
    comm.all_reduce(x)
    works, found = [], None
    deadline = time.monotonic() + 60.0
    while found is None and time.monotonic() < deadline:
        try:
            works.append(comm.all_reduce(x, async_op=True))  # queued behind the failed one, released by the abort
        except NcclError as e:
            found = e
    if found is None:
        return ["no call found the error"]
    problems = [] if "ncclSystemError" in str(found) else [f"the call's error does not name it: {found}"]
    for i, w in enumerate(works):
        try:
            w.synchronize()
            problems.append(f"operation #{i + 2}, aborted, reported completion")
        except NcclError:
            pass
    try:
        comm.all_reduce(x)
        problems.append("a later call did not raise")
    except NcclError:
        pass
    return problems


def test_async_error_found_by_a_call_fails_earlier_works(monkeypatch):
    monkeypatch.setenv("GPUCOLL_NCCL_WATCHDOG_MS", "600000")
    assert gpucoll.spawn(_error_found_by_a_call_worker, 2, backend="nccl", timeout=60.0) == [[], []]


def _hang_worker(comm):
    """Rank 1's second operation never arrives on the device (NCCL_EMU_FAULT=hang:op=2:rank=1): both ranks have
    issued it, so both watchdogs must time out and say the operation is stuck on the GPU side."""
    A = Arrays("device_array", device_of(comm))
    x = A.put(np.arange(32, dtype=np.int32), "int32")
    comm.all_reduce(x)
    try:
        comm.all_reduce(x, async_op=True).synchronize()
        problems = ["no CollectiveTimeout"]
    except CollectiveTimeout as e:
        ok = "all_reduce #2" in str(e) and "every rank had issued operation #2" in str(e)
        problems = [] if ok else [f"wrong timeout: {e}"]
    # Rank 0 serves the rendezvous store, which the other rank's watchdog reads to say who had issued what: it
    # leaves only when that rank has its error (a file each, not a sleep).
    done = os.path.join(os.environ["HANG_TEST_DIR"], f"rank{comm.rank}")
    open(done, "w").close()
    if comm.rank == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(os.environ["HANG_TEST_DIR"], "rank1")) and time.monotonic() < deadline:
            time.sleep(0.01)
    return problems


def test_operation_that_never_arrives_times_out_on_every_rank(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_EMU_FAULT", "hang:op=2:rank=1")
    monkeypatch.setenv("HANG_TEST_DIR", str(tmp_path))
    assert gpucoll.spawn(_hang_worker, 2, backend="nccl", timeout=3.0) == [[], []]


def _noop(comm):
    return None


def test_rank_that_never_arrives_at_init(monkeypatch):
    monkeypatch.setenv("NCCL_EMU_FAULT", "init_hang:rank=1")
    with pytest.raises(CollectiveTimeout, match="ncclCommInitRankConfig within the timeout") as info:
        gpucoll.spawn(_noop, 2, backend="nccl", timeout=3.0)
    assert set(info.value.failures) == {0, 1}, info.value.failures  # every rank raised, none hung


# -- NCCL versions and device shapes ----------------------------------------------------------------------------------

def _run(code: str, **env) -> str:
    full = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         env=full, cwd=os.path.dirname(os.path.dirname(__file__)), check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_old_nccl_versions_are_gated():
    """NCCL 2.29 cannot put two ranks on one GPU; NCCL 2.23 has no fp8: both refused before any rank starts."""
    out = _run("""
        import gpucoll
        from gpucoll.errors import Unsupported
        try:
            gpucoll.spawn(print, 2, backend="nccl")
        except Unsupported as e:
            print("spawn:", e)
        """, NCCL_EMU_VERSION="22900")
    assert "spawn:" in out and "NCCL >= 2.30" in out and "2.29.0" in out, out
    out = _run("""
        import numpy as np, gpucoll
        from gpucoll._spawn import free_port
        from gpucoll.errors import Unsupported
        from gpucoll.testing import DeviceArray
        c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=60)
        try:
            c.all_gather(DeviceArray.from_host(np.zeros(4, np.uint8), dtype="float8_e4m3fn"))
        except Unsupported as e:
            print("fp8:", e)
        c.close()
        """, NCCL_EMU_VERSION="22300")
    assert "fp8:" in out and "NCCL >= 2.24" in out, out


def _sm80_worker(comm):
    A = Arrays("device_array", device_of(comm))
    x = A.put(np.ones(8, np.float32), "float8_e5m2")
    problems = []
    try:
        comm.all_reduce(x)
        problems.append("an fp8 all_reduce on sm_80 did not raise")
    except Unsupported as e:
        if "compute capability 9.0" not in str(e) or "8.0" not in str(e):
            problems.append(f"wrong refusal: {e}")
    nccl_ranks.check(A.get(comm.all_gather(x), "float8_e5m2"), np.ones(16, np.float32), "fp8 all_gather on sm_80",
                     problems)
    return problems


def test_fp8_reductions_refused_below_sm90(monkeypatch):
    monkeypatch.setenv("GPUCOLL_EMU_COMPUTE_CAPABILITY", "8.0")  # the spawned ranks' emulated GPU
    assert gpucoll.spawn(_sm80_worker, 2, backend="nccl", timeout=60.0) == [[], []]


def _duplicate_gpu_worker(comm):
    """Two ranks on one GPU without NCCL_MULTI_RANK_GPU_ENABLE: NCCL refuses the init, gpucoll says why."""
    port = np.array([free_port() if comm.rank == 0 else 0], np.int64)
    comm.all_reduce(port)  # the host backend, to agree on a port
    os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
    try:
        gpucoll.init(comm.rank, 2, backend="nccl", address="127.0.0.1", port=int(port[0]), timeout=60.0, device=0)
    except NcclError as e:
        return [] if "Duplicate GPU detected" in str(e) and "ncclInvalidUsage" in str(e) else [f"wrong error: {e}"]
    return ["init did not fail"]


def test_ranks_sharing_a_gpu_need_nccls_multi_rank_mode():
    assert gpucoll.spawn(_duplicate_gpu_worker, 2, backend="host", timeout=60.0) == [[], []]


# -- argument errors NCCL returns at once ---------------------------------------------------------------------------

def test_argument_error_poisons_and_aborts_the_communicator():
    """NCCL returns an argument error at once and keeps it on a non-blocking communicator (every later call fails
    with it): gpucoll must abort that communicator and say so, and later calls name the first error. Here the buffer
    claims more elements than its allocation holds (a GPU faults on that; the stand-in checks it)."""
    c = gpucoll.init(0, 1, backend="nccl", address="127.0.0.1", port=free_port(), timeout=60.0)
    try:
        A = Arrays("device_array", 0)
        x = A.put(np.arange(16, dtype=np.float32), "float32")

        class Overrun:
            @property
            def __cuda_array_interface__(self):
                return dict(x.__cuda_array_interface__, shape=(1 << 20,))

        with pytest.raises(NcclError, match="ncclInvalidArgument.*leave its allocation.*aborted"):
            c.all_reduce(Overrun())
        with pytest.raises(NcclError, match="ncclInvalidArgument.*leave its allocation"):
            c.all_reduce(x)  # the communicator's failure, recorded
    finally:
        c.close()


# -- many chunks per message ------------------------------------------------------------------------------------

def _chunked_worker(comm):
    failures: list = []
    A = Arrays("device_array", device_of(comm))
    for dtype in ("float64", "bfloat16", "int8"):
        for op in ("sum", "max", "avg"):
            nccl_ranks.reductions(comm, A, dtype, op, failures)
        nccl_ranks.movement(comm, A, dtype, failures)
    nccl_ranks.p2p(comm, A, failures)
    return failures


def test_messages_of_many_chunks(monkeypatch):
    """64-byte channel slots: every message of the battery spans many chunks and wraps the slots many times."""
    monkeypatch.setenv("NCCL_EMU_CHUNK_BYTES", "64")
    results = gpucoll.spawn(_chunked_worker, 3, backend="nccl", timeout=120.0)
    failures = helpers.merge_rank_failures([{"f": r} for r in results], "f")
    assert not failures, helpers.format_failures(failures)


def test_every_peer_over_the_network_transport(monkeypatch):
    """NCCL's NCCL_P2P_DISABLE=1 with NCCL_SHM_DISABLE=1 leaves ranks of one host nothing but the network: the
    stand-in's socket transport (net.cc) then carries every peer, so it runs here without the multi-node fixture
    (tests/multinode/test_nccl_nodes.py runs it between hosts). 64-byte chunks: many frames per message, wrapping
    the receiver's slots."""
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    monkeypatch.setenv("NCCL_EMU_CHUNK_BYTES", "64")
    results = gpucoll.spawn(_chunked_worker, 3, backend="nccl", timeout=120.0)
    failures = helpers.merge_rank_failures([{"f": r} for r in results], "f")
    assert not failures, helpers.format_failures(failures)


def test_the_unique_id_holds_the_interface_nccl_socket_ifname_names(monkeypatch):
    """The bootstrap root listens where NCCL_SOCKET_IFNAME says (NCCL's grammar: prefixes, '=' exact, '^' to
    exclude), for ranks on other hosts; a name that matches no interface fails ncclGetUniqueId with the reason."""
    lib = stand_in()
    lib.ncclGetLastError.restype = ctypes.c_char_p

    def root_address(ifname: str):
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", ifname)
        uid = ctypes.create_string_buffer(128)
        if lib.ncclGetUniqueId(uid) != 0:
            return lib.ncclGetLastError(None).decode()
        # The id's layout (bootstrap.cc): magic, nonce, host hash (8 bytes each), the Unix name (48), the sockaddr.
        family = int.from_bytes(uid.raw[72:74], "little")
        return ".".join(str(b) for b in uid.raw[76:80]) if family == 2 else f"family {family}"

    assert root_address("=lo") == "127.0.0.1"
    assert root_address("lo") == "127.0.0.1"
    assert "no usable network interface (NCCL_SOCKET_IFNAME=no-such-if)" in root_address("no-such-if")
    assert root_address("^lo") != "127.0.0.1"  # the machine's first other interface (or none: then the reason)
