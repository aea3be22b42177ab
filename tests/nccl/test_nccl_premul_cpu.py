"""``gpucoll.premul_sum``: argument validation and the scalar bytes handed to ncclRedOpCreatePreMulSum (host-immediate,
in the reduction's own dtype), fp8 included, checked against torch's own float8 conversion where torch is installed.
"""

from __future__ import annotations

import pickle

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import _C
from gpucoll.errors import InvalidArgument


def test_premul_sum_validation():
    op = gpucoll.premul_sum(0.5)
    assert op.scalar == 0.5 and repr(op) == "gpucoll.premul_sum(0.5)"
    assert gpucoll.premul_sum(3).scalar == 3 and gpucoll.premul_sum(np.float32(2.0)).scalar == 2.0
    assert pickle.loads(pickle.dumps(op)) == op and hash(op) == hash(gpucoll.premul_sum(0.5))
    for bad in (True, "2", None, float("nan"), float("inf"), [1.0]):
        with pytest.raises(InvalidArgument, match="premul_sum scalar"):
            gpucoll.premul_sum(bad)
    with pytest.raises(AttributeError):
        op.scalar = 2.0
    from gpucoll.communicator import _parse_op

    assert _parse_op(op) is op
    with pytest.raises(InvalidArgument, match="premul_sum"):
        _parse_op("mean")


def test_premul_scalar_encoding():
    enc = _C.premul_scalar_bytes
    D = _C.DType
    assert enc(D.float16, 0.5) == np.float16(0.5).tobytes()
    assert enc(D.float32, 0.1) == np.float32(0.1).tobytes()
    assert enc(D.float64, 0.1) == np.float64(0.1).tobytes()
    assert enc(D.bfloat16, 1.5) == (np.float32(1.5).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    assert enc(D.int8, -3) == np.int8(-3).tobytes() and enc(D.uint8, 255) == np.uint8(255).tobytes()
    assert enc(D.int64, -(2**62)) == np.int64(-(2**62)).tobytes()
    for dtype, scalar, pattern in ((D.int32, 0.5, "not an integer"), (D.uint8, -1, "does not fit"),
                                   (D.int8, 128, "does not fit"), (D.float16, 1e5, "overflows float16"),
                                   (D.float32, 1e39, "overflows float32"), (D.float64, float("nan"), "finite")):
        with pytest.raises(InvalidArgument, match=pattern):
            enc(dtype, scalar)
    # fp8: round to nearest even, subnormals kept, overflow refused (e4m3fn's 448 and e5m2's 57344 are the largest).
    for dtype, pairs in ((D.float8_e4m3fn, [(1.0, 0x38), (-2.0, 0xC0), (0.5, 0x30), (448.0, 0x7E), (2.0**-9, 0x01),
                                            (1.0625, 0x38), (1.1875, 0x3A), (-0.0, 0x80)]),
                         (D.float8_e5m2, [(1.0, 0x3C), (57344.0, 0x7B), (2.0**-16, 0x01), (1.125, 0x3C)])):
        for scalar, bits in pairs:
            assert enc(dtype, scalar) == bytes([bits]), (dtype, scalar)
    with pytest.raises(InvalidArgument, match="overflows float8_e4m3fn"):
        enc(D.float8_e4m3fn, 480.0)
    with pytest.raises(InvalidArgument, match="overflows float8_e5m2"):
        enc(D.float8_e5m2, 61440.0)


def test_fp8_scalars_round_like_torch():
    torch = helpers.require("torch")
    rng = np.random.default_rng(5)
    values = list(rng.normal(size=2000) * rng.choice([1e-5, 1e-2, 1.0, 30.0], 2000))
    values += [k * 2.0**e for e in range(-20, 9) for k in (1.0, 1.0625, 1.125, 1.1875, 1.5, 1.75, 1.9375)]
    for dtype, tdtype, largest in ((_C.DType.float8_e4m3fn, torch.float8_e4m3fn, 448.0),
                                   (_C.DType.float8_e5m2, torch.float8_e5m2, 57344.0)):
        for v in values:
            ref = torch.tensor([v], dtype=torch.float32).to(tdtype)
            if abs(float(ref.float())) >= largest or abs(v) > largest:
                continue  # torch saturates; gpucoll refuses what overflows
            assert _C.premul_scalar_bytes(dtype, float(np.float32(v))) == bytes([int(ref.view(torch.uint8))]), v
