"""The wire formats themselves (csrc/core/quant.h, gpucoll/compression.py), without ranks: known codes, the C++
encoder against the NumPy reference bit for bit, and the error bound on adversarial blocks (never exceeded, and not
vacuous: the worst case comes near it)."""

from __future__ import annotations

import numpy as np
import pytest

from gpucoll import _C, compression

F = np.float32


def _cpp_roundtrip(x: np.ndarray, wire: str) -> np.ndarray:
    y = np.empty_like(x)
    _C.wire_roundtrip(x.ctypes.data, y.ctypes.data, x.size, getattr(_C.DType, str(x.dtype)), wire)
    return y


def _adversarial(rng, n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(F)
    for b in range(-(-n // 256)):
        lo, hi = b * 256, min(n, b * 256 + 256)
        mode = rng.integers(0, 7)
        if mode == 0:
            x[lo + rng.integers(0, hi - lo)] = F(rng.choice([1e30, -3e4, 6e37]))
        elif mode == 1:
            x[lo:hi] = (rng.integers(-1000, 1000, hi - lo) * 1e-42).astype(F)  # denormals
        elif mode == 2:
            x[lo:hi] = F(rng.standard_normal())
        elif mode == 3:
            x[lo:hi] *= F(2.0 ** -105)  # tiny normals: the lifted scale
        elif mode == 4:
            x[lo:hi] = 0
        elif mode == 5:
            x[lo:hi] = rng.integers(-126, 127, hi - lo).astype(F)  # exact int8 codes when the max is 126
    return x


def test_int8_codes_known_values():
    x = np.array([126, -126, 0.5, 1.5, 2.5, -0.5, 63, np.inf, -np.inf, np.nan], F)
    got = compression.roundtrip(x, "int8")
    # scale 1 (m = 126): halves round to even; specials keep their meaning
    want = np.array([126, -126, 0, 2, 2, -0.0, 63, np.inf, -np.inf, np.nan], F)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(_cpp_roundtrip(x, "int8"), want, equal_nan=True)


def test_fp8_and_bf16_known_values():
    # fp8: m = 416 maps to scale 1; e4m3 keeps 3 mantissa bits: 17 -> 16 (tie to even), 19 -> 20, 416 stays
    x = np.array([416, 17, 19, 0.001953125, -3.0, np.inf], F)
    want = np.array([416, 16, 20, 0.001953125, -3.0, np.inf], F)
    assert np.array_equal(compression.roundtrip(x, "fp8"), want)
    assert np.array_equal(_cpp_roundtrip(x, "fp8"), want)
    # bf16: 8 significant bits, ties to even
    y = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -np.inf, 3.4e38], F)
    wy = np.array([1, 1 + 2.0 ** -6, -np.inf, np.inf], F)  # the largest floats round up to infinity in bf16
    assert np.array_equal(compression.roundtrip(y, "bf16"), wy)
    assert np.array_equal(_cpp_roundtrip(y, "bf16"), wy)


@pytest.mark.parametrize("wire", compression.WIRES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cpp_encoder_matches_the_reference_bit_for_bit(wire, dtype):
    rng = np.random.default_rng(7)
    for n in (1, 15, 16, 17, 255, 256, 257, 4099):
        x = _adversarial(rng, n)
        x[rng.integers(0, n)] = rng.choice([np.inf, -np.inf, np.nan])
        with np.errstate(over="ignore"):
            x = x.astype(dtype)  # float16: the huge values become infinities, which the formats carry too
        want = compression.roundtrip(x, wire).astype(dtype)
        got = _cpp_roundtrip(x, wire)
        bits = np.uint16 if dtype == "float16" else np.uint32
        keep = ~np.isnan(want)
        assert np.array_equal(got.view(bits)[keep], want.view(bits)[keep]), (wire, n)
        assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("wire", compression.WIRES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_error_bound_holds_and_is_not_vacuous(wire, op):
    rng = np.random.default_rng(11)
    worst = 0.0
    for trial in range(40):
        P = int(rng.integers(1, 9))
        n = int(rng.integers(1, 3000))
        inputs = [_adversarial(rng, n) for _ in range(P)]
        got = compression.reference(inputs, wire, op).astype(np.float64)
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0) / (P if op == "avg" else 1)
        bound = compression.error_bound(inputs, wire, op)
        ok = np.isfinite(exact) & (np.abs(exact) < 1e37)  # sums near float32's limit may overflow, as documented
        ratio = np.abs(got - exact)[ok] / bound[ok]
        assert ratio.max(initial=0) <= 1.0, (trial, P, n, float(ratio.max()))
        worst = max(worst, float(ratio.max(initial=0)))
    assert worst > 0.3, f"the bound is loose everywhere (worst ratio {worst:.3f})"


def test_f16_output_bound():
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(2000).astype(np.float16) for _ in range(4)]
    for wire in compression.WIRES:
        got = compression.reference(inputs, wire).astype(np.float16).astype(np.float64)
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        assert (np.abs(got - exact) <= compression.error_bound(inputs, wire, "sum", "float16")).all(), wire
