"""Host-side logic of the custom allreduce backend, on the CPU: algorithm choice, launch shapes, the residency limit
of virtual ranks, staging pieces, every eligibility decline and its message, and the clear errors the Python API
raises where the backend cannot run (no CUDA build or no GPU). The kernels themselves: tests/custom/test_custom_gpu.py.
"""

from __future__ import annotations

import pytest

import gpucoll
from gpucoll import _C
from gpucoll.backends import custom as _custom_backend
from gpucoll.errors import InvalidArgument, Unsupported

KiB, MiB = 1 << 10, 1 << 20
P_VALUES = (1, 2, 3, 4, 8)


# -- algorithm and launch shape ---------------------------------------------------------------------------------------

def test_algo_names():
    assert [_C.custom_algo_name(n) for n in ("oneshot", "twoshot", "ring", "tree", "dbt")] == [
        "oneshot", "twoshot", "ring", "tree", "tree"]
    with pytest.raises(InvalidArgument, match="oneshot, twoshot, ring, tree"):
        _C.custom_algo_name("nvls")


@pytest.mark.parametrize("P", P_VALUES)
def test_auto_choice_one_shot_small_two_shot_large(P):
    assert _C.custom_choose_algo(8 * KiB, P) == "oneshot"
    assert _C.custom_choose_algo(64 * MiB, P) == "twoshot"
    # The one-shot window shrinks with P: it pulls (P-1)N bytes per rank.
    limit = {1: MiB, 2: MiB, 3: 512 * KiB, 4: 512 * KiB, 8: 256 * KiB}[P]
    assert _C.custom_choose_algo(limit, P) == "oneshot"
    assert _C.custom_choose_algo(limit + 1, P) == "twoshot"


@pytest.mark.parametrize("algo", ("oneshot", "twoshot", "ring", "tree"))
@pytest.mark.parametrize("P", P_VALUES)
def test_launch_shape_bounds(algo, P):
    for nbytes in (0, 16, 8 * KiB, 256 * KiB, 64 * MiB, 1 << 34):
        for sms in (1, 8, 132):
            blocks, threads = _C.custom_launch_shape(algo, nbytes, P, sms)
            assert threads == _C.CUSTOM_THREADS == 512
            assert 1 <= blocks <= min(_C.CUSTOM_MAX_BLOCKS, sms)
            capped, _ = _C.custom_launch_shape(algo, nbytes, P, sms, 3)
            assert 1 <= capped <= 3 and capped == min(blocks, 3)


def test_launch_shape_grows_with_the_bytes_a_block_row_moves():
    # 512 threads x 16 B = 8 KiB per block pass: one-shot's row is the message, two-shot's/ring's one of P chunks,
    # the tree's one of its two halves.
    assert _C.custom_launch_shape("oneshot", 8 * KiB, 8, 132)[0] == 1
    assert _C.custom_launch_shape("oneshot", 8 * KiB + 1, 8, 132)[0] == 2
    assert _C.custom_launch_shape("oneshot", 256 * KiB, 8, 132)[0] == 32
    assert _C.custom_launch_shape("twoshot", 256 * KiB, 8, 132)[0] == 4
    assert _C.custom_launch_shape("ring", 256 * KiB, 4, 132)[0] == 8
    assert _C.custom_launch_shape("tree", 256 * KiB, 4, 132)[0] == 16
    assert _C.custom_launch_shape("twoshot", 64 * MiB, 8, 132)[0] == 64  # kMaxBlocks
    assert _C.custom_launch_shape("twoshot", 64 * MiB, 8, 20)[0] == 20  # at most one block per SM


# -- residency limit of virtual ranks ----------------------------------------------------------------------------------

def test_max_blocks_per_rank():
    assert _C.custom_max_blocks_per_rank(8, 132, 4) == 64  # 528 // 8 = 66, capped at kMaxBlocks
    assert _C.custom_max_blocks_per_rank(8, 132, 1) == 16
    assert _C.custom_max_blocks_per_rank(3, 10, 1) == 3
    assert _C.custom_max_blocks_per_rank(8, 4, 1) == 0  # not even one block each
    assert _C.custom_max_blocks_per_rank(0, 132, 4) == 0
    assert _C.custom_max_blocks_per_rank(2, 132, 0) == 0


def test_residency_check_passes_at_the_limit_and_names_it_beyond():
    _C.custom_check_residency(8, 16, 132, 1)  # 128 <= 132
    with pytest.raises(InvalidArgument) as e:
        _C.custom_check_residency(8, 17, 132, 1)  # 136 > 132
    msg = str(e.value)
    assert "8 virtual ranks x 17 blocks = 136" in msg and "holds 132" in msg and "132 SMs x 1 blocks" in msg
    with pytest.raises(InvalidArgument, match="at most 4"):
        _C.custom_check_residency(8, 1, 4, 1)


@pytest.mark.parametrize("P", P_VALUES)
def test_capped_shape_always_fits(P):
    for sms, bps in ((132, 1), (132, 4), (16, 2), (108, 3)):
        cap = _C.custom_max_blocks_per_rank(P, sms, bps)
        for nbytes in (16, MiB, 64 * MiB):
            blocks, _ = _C.custom_launch_shape("twoshot", nbytes, P, sms, cap)
            _C.custom_check_residency(P, blocks, sms, bps)


def test_piece_elems_whole_packs():
    assert _C.custom_piece_elems(32 * MiB, 4) == 8 * MiB
    assert _C.custom_piece_elems(4096 + 8, 2) == 2048  # rounded down to 16-byte packs
    assert _C.custom_piece_elems(4096, 8) * 8 % 16 == 0
    assert _C.custom_piece_elems(4096, 0) == 0


# -- eligibility ------------------------------------------------------------------------------------------------------

def facts(P=2, **kw):
    f = {"nranks": P, "hosts": ["node0"] * P, "p2p": [1] * (P * P), "dtype": _C.DType.float32,
         "op": _C.RedOp.sum, "premul": False, "count": 1000, "in_ptr": 0x10000, "out_ptr": 0x20000}
    f.update(kw)
    return _C.custom_eligibility(**f)


def declined(**kw) -> str:
    d = facts(**kw)
    assert not d["ok"]
    return d["reason"]


@pytest.mark.parametrize("P", P_VALUES)
def test_eligible(P):
    assert facts(P) == {"ok": True, "reason": "", "alignment": False}


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16", "float64", "int32"))
@pytest.mark.parametrize("op", ("sum", "min", "max", "avg"))
def test_supported_dtypes_and_ops(dtype, op):
    assert facts(dtype=getattr(_C.DType, dtype), op=getattr(_C.RedOp, op))["ok"]


def test_decline_reasons():
    assert "1 to 8 ranks" in declined(P=9)
    assert "different nodes" in declined(hosts=["a", "b"]) and "rank 1 on 'b'" in declined(hosts=["a", "b"])
    assert declined(P=3, p2p=[1, 1, 1, 1, 1, 0, 1, 1, 1]) == (
        "rank 1 cannot read rank 2's memory (a test copy through the peer mapping failed or returned wrong bytes)")
    assert "did not run" in declined(p2p=[])
    for dt in ("int8", "uint8", "int64", "float8_e4m3fn"):
        assert "has no custom kernel" in declined(dtype=getattr(_C.DType, dt)) and dt in declined(
            dtype=getattr(_C.DType, dt))
    assert "op prod has no custom kernel" in declined(op=_C.RedOp.prod)
    assert "premul_sum" in declined(premul=True)
    reason = declined(registered=True, registered_bytes=3999)
    assert "4000 bytes" in reason and "3999 bytes" in reason
    assert facts(registered=True, registered_bytes=4000)["ok"]


def test_alignment_is_flagged_as_a_per_rank_fact():
    d = facts(dtype=_C.DType.float32, in_ptr=0x10002)
    assert not d["ok"] and d["alignment"] and "element size (4 bytes)" in d["reason"]
    assert facts(dtype=_C.DType.float16, in_ptr=0x10002)["ok"]  # 2-byte aligned is enough for f16
    assert facts(dtype=_C.DType.float64, out_ptr=0x10004)["alignment"]


def test_decline_order_node_before_dtype():
    # The communicator-wide reasons come first: they are what the operator has to fix.
    assert "different nodes" in declined(hosts=["a", "b"], dtype=_C.DType.int8)


# -- the Python API without a GPU --------------------------------------------------------------------------------------

def _no_gpu() -> bool:
    return bool(_custom_backend.problems())


def test_problems_name_the_missing_pieces():
    assert _custom_backend.problems({"cuda_built": True}, {"device_count": 1, "runtime_device_count": 1}) == []
    no_build = _custom_backend.problems({"cuda_built": False}, {"device_count": 1})
    assert len(no_build) == 1 and "built without CUDA" in no_build[0]
    no_gpu = _custom_backend.problems({"cuda_built": True}, {"device_count": 0, "reason": "cuInit failed: X"})
    assert len(no_gpu) == 1 and "no usable CUDA GPU: cuInit failed: X" in no_gpu[0]


@pytest.mark.skipif(not _no_gpu(), reason="a GPU is usable here")
def test_init_custom_without_gpu_is_a_clear_error():
    with pytest.raises(Unsupported, match="backend='custom' cannot run here") as e:
        gpucoll.init(0, 1, backend="custom", address="127.0.0.1", port=1)
    assert "GPU" in str(e.value) or "CUDA" in str(e.value)


@pytest.mark.skipif(not _no_gpu(), reason="a GPU is usable here")
def test_virtual_ranks_without_gpu_is_a_clear_error():
    from gpucoll import testing

    with pytest.raises(Unsupported, match="virtual_ranks cannot run here"):
        testing.virtual_ranks(2)


def _nothing(comm):
    return None


@pytest.mark.skipif(not _no_gpu(), reason="a GPU is usable here")
def test_spawn_custom_without_gpu_fails_before_starting_workers():
    with pytest.raises(Unsupported, match="spawn\\(backend='custom', nranks=2\\) cannot run here"):
        gpucoll.spawn(_nothing, 2, backend="custom")


def test_virtual_ranks_argument_errors():
    from gpucoll import testing

    for bad in (0, 9, True, 2.0):
        with pytest.raises(InvalidArgument, match="nranks must be an int in \\[1, 8\\]"):
            testing.virtual_ranks(bad)
    with pytest.raises(InvalidArgument, match="device must be a CUDA device index"):
        testing.virtual_ranks(2, device=-1)


def _register_calls(comm):
    import numpy as np

    raised = []
    for call in (lambda: comm.register(np.zeros(4)), comm.register_graph_buffers, comm.graph_capture):
        try:
            call()
        except Unsupported as e:
            raised.append("backend='custom'" in str(e))
    return raised


@pytest.mark.spawns
def test_register_on_other_backends_is_unsupported():
    assert gpucoll.spawn(_register_calls, 1, backend="host") == [[True, True, True]]


def test_config_variables_registered():
    from gpucoll import config

    names = {v["name"]: v for v in config.variables()}
    assert names["GPUCOLL_CUSTOM_BUFFER_BYTES"]["default"] == "32M"
    assert names["GPUCOLL_CUSTOM_NCCL_FALLBACK"]["default"] == "1"
    assert _custom_backend.half_bytes() == 32 * MiB


def test_half_bytes_rejects_tiny(monkeypatch):
    monkeypatch.setenv("GPUCOLL_CUSTOM_BUFFER_BYTES", "1K")
    with pytest.raises(InvalidArgument, match="at least 4K"):
        _custom_backend.half_bytes()


# -- host-side ordering and failure handling, with CPU stand-ins for the native communicator -------------------------

class _FakeBuf:
    def __init__(self, ptr):
        self.ptr, self.count, self.dtype, self.nbytes, self.obj = ptr, 10, _C.DType.float32, 40, ptr


class _FakeComm:
    def __init__(self, rank, log, npieces):
        self.rank, self.log, self.npieces = rank, log, npieces

    def all_reduce(self, in_ptr, out_ptr, count, dtype, op, algo, stream, max_blocks=0, piece=-1):
        self.log.append((self.rank, piece))
        return self.npieces


def test_virtual_ranks_enqueue_piece_by_piece_across_ranks(monkeypatch):
    # Rank 0's piece 1 queued before rank 1's piece 0 deadlocks where the two streams share a hardware queue: every
    # rank's piece i must be enqueued before any rank's piece i + 1.
    from gpucoll import testing

    log = []
    vr = object.__new__(testing.VirtualRanks)
    vr.nranks, vr.device, vr._closed = 3, 0, False
    vr.comms = [_FakeComm(r, log, npieces=2) for r in range(3)]
    vr._streams = []
    monkeypatch.setattr(testing.VirtualRanks, "streams", property(lambda self: [10, 11, 12]))
    monkeypatch.setattr(vr, "_resolve_all", lambda xs, name, writable: [_FakeBuf(x) for x in xs])
    vr.all_reduce([1, 2, 3], algo="twoshot")
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_virtual_ranks_refuse_two_ranks_on_one_stream(monkeypatch):
    # Rank 1's kernel would queue behind rank 0's, which spins until rank 1 arrives: a hang, so an error up front.
    from gpucoll import testing

    log = []
    vr = object.__new__(testing.VirtualRanks)
    vr.nranks, vr.device, vr._closed = 3, 0, False
    vr.comms = [_FakeComm(r, log, npieces=1) for r in range(3)]
    vr._streams = []
    monkeypatch.setattr(vr, "_resolve_all", lambda xs, name, writable: [_FakeBuf(x) for x in xs])
    with pytest.raises(InvalidArgument, match="3 distinct streams"):
        vr.all_reduce([1, 2, 3], algo="oneshot", streams=[11, 12, 11])
    assert log == []  # nothing was enqueued
    vr.all_reduce([1, 2, 3], algo="oneshot", streams=[11, 12, 13])
    assert log == [(0, 0), (1, 0), (2, 0)]


class _TimedOutNative:
    def timed_out(self):
        return 2  # barrier 1 gave up

    def late_ranks(self):
        return [1]  # waiting for rank 1's flag


def test_timed_out_custom_backend_refuses_later_calls():
    backend = _custom_backend.Custom(_TimedOutNative(), rank=0, world_size=2, device=0, store=None, prefix="",
                                     timeout=1.0, hosts=["h", "h"], p2p=[1, 1, 1, 1], nccl=None, nccl_why="")
    with pytest.raises(gpucoll.errors.CollectiveTimeout, match=r"waited longer than 1 s for rank\(s\) \[1\]") as e:
        backend.check_timeout()
    assert e.value.ranks == (1,)
    with pytest.raises(gpucoll.errors.InvalidUsage, match="timed out waiting for a peer; the communicator is unusable"):
        backend.collective(0, "auto", None, None, 10, None, 0, None, False)


# -- processes sharing a GPU ------------------------------------------------------------------------------------------

def test_processes_sharing_a_gpu_without_mps_are_warned(tmp_path, monkeypatch):
    """Measured on an H200: 2 processes on one GPU take 4.5 ms per 8-byte allreduce without MPS and 47 us under
    it. The warning names the sharing ranks and the fix; it is silent under MPS, on distinct GPUs and on the
    emulated device (which does not time-slice)."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    places = [("h", "0000:01:00.0"), ("h", "0000:01:00.0"), ("h", "0000:02:00.0"), ("other", "0000:01:00.0")]
    why = _custom_backend._time_slice_warning(1, places, emulated=False)
    assert why is not None and "ranks [0, 1]" in why and "nvidia-cuda-mps-control -d" in why and str(tmp_path) in why
    assert _custom_backend._time_slice_warning(2, places, emulated=False) is None  # alone on its GPU
    assert _custom_backend._time_slice_warning(3, places, emulated=False) is None  # same bus id, other host
    assert _custom_backend._time_slice_warning(0, places, emulated=True) is None
    (tmp_path / "control").touch()  # the daemon's control pipe: MPS runs
    assert _custom_backend._time_slice_warning(0, places, emulated=False) is None
