"""dtype and reduction-op tables (csrc/core/types.h, bound as gpucoll._C.DType / RedOp), the Python tables that
must agree with them, and the semantics of the exact reference in tests/support/helpers.py that every distributed test
relies on."""

from __future__ import annotations

import helpers
import numpy as np
import pytest

from gpucoll import _C, _buffers, communicator

# name -> (enum value, size in bytes, floating?, nccl-tests name). The numeric values are part of the binding
# and of the data the CUDA kernels read: new entries go at the end.
DTYPES = {
    "float16": (0, 2, True, "half"),
    "bfloat16": (1, 2, True, "bfloat16"),
    "float32": (2, 4, True, "float"),
    "float64": (3, 8, True, "double"),
    "int8": (4, 1, False, "int8"),
    "uint8": (5, 1, False, "uint8"),
    "int32": (6, 4, False, "int32"),
    "int64": (7, 8, False, "int64"),
}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}


# fp8 follows the eight types above: NCCL-only (the host backend and gpucoll's kernels reject them).
FP8_DTYPES = {"float8_e4m3fn": 8, "float8_e5m2": 9}


def test_dtype_members_and_values():
    want = {n: v[0] for n, v in DTYPES.items()} | FP8_DTYPES
    assert {name: int(m) for name, m in _C.DType.__members__.items()} == want


@pytest.mark.parametrize("name", DTYPES)
def test_dtype_size_floating_and_names(name):
    _, size, floating, nccl = DTYPES[name]
    t = getattr(_C.DType, name)
    assert t.name == name
    assert _C.dtype_size(t) == size
    assert _C.dtype_is_floating(t) is floating
    assert _C.dtype_nccl_name(t) == nccl
    if name != "bfloat16":
        assert np.dtype(name).itemsize == size


def test_redop_members_and_values():
    assert {name: int(m) for name, m in _C.RedOp.__members__.items()} == OPS
    for name in OPS:
        assert getattr(_C.RedOp, name).name == name


def test_python_tables_agree_with_the_core():
    assert tuple(communicator.OPS) == tuple(OPS)
    assert tuple(_buffers.SUPPORTED) == tuple(DTYPES)
    assert helpers.DTYPES == tuple(DTYPES) and helpers.OPS == tuple(OPS)
    for alias, canonical in _buffers._DTYPES.items():
        assert canonical in DTYPES, alias


@pytest.mark.parametrize("name", [n for n in DTYPES if n != "bfloat16"])
def test_numpy_arrays_resolve_to_their_dtype(name):
    a = np.zeros((3, 5), dtype=name)
    buf = _buffers.resolve(a, "x")
    assert buf.dtype == getattr(_C.DType, name) and buf.dtype_name == name
    assert buf.count == 15 and buf.itemsize == DTYPES[name][1] and buf.nbytes == 15 * DTYPES[name][1]
    assert buf.ptr == a.ctypes.data and buf.kind == "numpy" and buf.device == "cpu"


def test_torch_tensors_resolve_to_their_dtype():
    torch = helpers.require("torch")
    for name in DTYPES:
        t = torch.zeros(4, dtype=getattr(torch, name))
        buf = _buffers.resolve(t, "x")
        assert buf.dtype == getattr(_C.DType, name) and buf.itemsize == DTYPES[name][1], name
        assert buf.kind == "torch" and buf.ptr == t.data_ptr()


# -- the reference that the distributed tests compare against ------------------------------------------------------

def test_integer_avg_truncates_toward_zero():
    total = np.array([7, -7, 6, -6, -1, 1, 0, -128, 127], dtype=np.int8)
    assert helpers.avg_int(total, 2, "int8").tolist() == [3, -3, 3, -3, 0, 0, 0, -64, 63]
    assert helpers.avg_int(np.array([-7, -8, 8], np.int64), 3, "int64").tolist() == [-2, -2, 2]
    assert helpers.avg_int(np.array([255, 7], np.uint8), 4, "uint8").tolist() == [63, 1]
    ref = helpers.reference([np.array([-3, 4], np.int32), np.array([-4, 3], np.int32)], "int32", "avg")
    assert ref.tolist() == [-3, 3]  # -7 / 2 -> -3 (floor would give -4)


def test_float_avg_reference_is_nccls_premultiplied_sum():
    """avg on floats: each input times NCCL's 1/n rounded to the dtype, then summed (no overflow where the mean fits:
    three float16 60000s average to 60000, a sum first would be inf)."""
    k = np.arange(-124, 125, dtype=np.float64)
    for dtype in ("float16", "float32", "float64"):
        ref = helpers.reference([k.astype(dtype), np.zeros_like(k).astype(dtype), np.zeros_like(k).astype(dtype)],
                                dtype, "avg")
        assert ref.dtype == np.dtype(dtype)
        s = np.dtype(dtype).type(np.float32(1 / 3)) if dtype != "float64" else 1 / 3
        assert np.array_equal(ref, k.astype(dtype) * s)  # NumPy multiplies in the dtype, correctly rounded
    big = [np.full(4, 60000, np.float16)] * 3
    assert helpers.reference(big, "float16", "avg").tolist() == [60000.0] * 4
    # NCCL's scalar goes through float32 first: for n = 8283 that double rounding gives another float16 than 1/n
    assert helpers.avg_scalar("float16", 8283) == float(np.float16(np.float32(1 / 8283))) != float(np.float16(1 / 8283))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_library_scales_avg_by_the_same_bits_as_nccl(dtype):
    """gpucoll's avg scalar (core/dispatch.h avg_scalar, through the host backend's binding) has NCCL's bits:
    float(1.0 / n) for float32, 1.0 / n for float64, float16/bfloat16 from float(1.0 / n)."""
    nd = {"float16": np.float16, "float32": np.float32, "float64": np.float64}.get(dtype)
    for n in [*range(1, 300), 1000, 4096, 8283, 18631, 55831, 65535]:
        raw = _C.avg_scalar_bytes(getattr(_C.DType, dtype), n)
        if dtype == "bfloat16":  # bf16's bits are the high half of a float32 (little-endian: the last two bytes)
            got = float(np.frombuffer(b"\0\0" + raw, np.float32)[0])
        else:
            got = float(np.frombuffer(raw, nd)[0])
        assert got == helpers.avg_scalar(dtype, n), (dtype, n, got)
    assert _C.avg_scalar_bytes(_C.DType.int32, 3) is None  # integers: sum, then divide


def test_round_to_precision_agrees_with_numpy():
    # round_to_precision(p=11) must agree with NumPy's float16 rounding, ties included
    k = np.arange(-124, 125, dtype=np.float64)
    q = np.concatenate([k / 3, k / 7, np.array([2049.0, 2051.0, 2053.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])])
    assert np.array_equal(helpers.round_to_precision(q, 11), q.astype(np.float16).astype(np.float64))
    assert np.array_equal(helpers.round_to_precision(q, 24), q.astype(np.float32).astype(np.float64))


def test_bf16_reference_rounding_matches_torch():
    torch = helpers.require("torch")
    q = np.arange(-124, 125, dtype=np.float64) / 3
    want = torch.from_numpy(q).to(torch.float32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = helpers.bf16_bits(helpers.round_to_precision(q, 8).astype(np.float32))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", helpers.DTYPES)
@pytest.mark.parametrize("op", helpers.OPS)
def test_inputs_make_every_result_exact(dtype, op):
    """Sums and products of the generated inputs never leave the exact range, in any order."""
    W = 4
    inputs = [helpers.make_input(dtype, op, 5000, r, W, seed=7) for r in range(W)]
    assert all(a.dtype == helpers.np_dtype(dtype) and a.shape == (5000,) for a in inputs)
    if dtype == "bfloat16":
        for a in inputs:
            helpers.bf16_bits(a)  # raises if a value is not bf16-representable
    if dtype in helpers.FLOAT_DTYPES and op in ("sum", "avg"):
        limit = 2.0 ** {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[dtype]
        terms = [helpers.avg_premul(a, dtype, W) if op == "avg" else a.astype(np.float64) for a in inputs]
        assert all(np.array_equal(t, np.rint(t)) for t in terms)  # integers: every partial sum is exact
        assert float(sum(np.abs(t) for t in terms).max()) <= limit
        if op == "avg":
            assert sum(np.count_nonzero(a) for a in inputs) > 0.9 * W * 5000  # few inputs fell back to 0
    forward = helpers.reference(inputs, dtype, op)
    backward = helpers.reference(inputs[::-1], dtype, op)
    assert helpers.compare_exact(forward, backward) is None
    assert len({a.tobytes() for a in inputs}) == W, "ranks must not all get the same data"


def test_compare_exact_sees_sign_of_zero_and_reports_first_difference():
    assert helpers.compare_exact(np.array([0.0, 1.0]), np.array([-0.0, 1.0])) is not None
    msg = helpers.compare_exact(np.array([1, 2, 3], np.int8), np.array([1, 5, 3], np.int8))
    assert "[1]" in msg and "1 of 3" in msg
