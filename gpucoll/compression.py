"""The compressed all-reduce's wire formats in NumPy: ``all_reduce(x, compress=...)``'s result, bit for bit, and its
error bound.

The formats are csrc/core/quant.h's. Values travel in blocks of 256 elements numbered from the vector's first, so
the result depends on the inputs alone, not on how a backend cuts the vector: ``reference`` computes it from every
rank's input (tests compare the backends with it bit for bit), and ``error_bound`` says how far it may lie from the
exact sum, per element (docs/compression.md derives it).

- int8: one float32 scale per block, ``m / 126`` (``m``: the block's largest finite magnitude); codes in
  [-126, 126]; 127, -127 and -128 stand for +Inf, -Inf and NaN.
- fp8: e4m3 codes of the values scaled to ``|v| <= 416`` (scale ``m / 416``); ±448 stand for ±Inf, 0x7F/0xFF
  for NaN.
- bf16: bfloat16 values, rounded to nearest even; no scale.

Each rank's input is encoded and decoded, the decoded values are summed in float32 in rank order (avg then divides
by the number of ranks), and the sum is encoded and decoded once more: that is what every rank gets.
"""

from __future__ import annotations

import numpy as np

from gpucoll.errors import InvalidArgument

WIRES = ("int8", "fp8", "bf16")
BLOCK = 256

_F = np.float32
_INT8_MAX = _F(126)
_FP8_MAX = _F(416)
_TINY = _F(2.0 ** -100)
_LIFT = _F(2.0 ** 100)
_MAGIC = _F(12582912.0)  # 1.5 * 2^23: (t + M) - M rounds |t| < 2^22 to an integer, to nearest even
_U = 2.0 ** -24          # float32's unit roundoff
_ABS_TINY = 2.0 ** -118  # what a block below 2^-100 may lose outright (its scale underflows)


def check_call(compress, algo) -> None:
    """all_reduce(compress=...)'s arguments that Python checks (the format's name, dtype and op: the backend)."""
    if type(compress) is not str:
        raise InvalidArgument(f"compress must be 'int8', 'fp8', 'bf16' or None; got {compress!r}")
    if algo is not None and algo != "auto":
        raise InvalidArgument(f"compress={compress!r} runs its own two-shot schedule; leave algo='auto' (got {algo!r})")


def _check_wire(wire: str) -> str:
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}; got {wire!r}")
    return wire


def _blocks(x: np.ndarray) -> np.ndarray:
    """x (float32, 1-D) as rows of BLOCK, the last padded with zeros (which change no block's largest magnitude)."""
    n = x.size
    padded = np.zeros(-(-n // BLOCK) * BLOCK, _F)
    padded[:n] = x
    return padded.reshape(-1, BLOCK)


def _finite_max(b: np.ndarray) -> np.ndarray:
    a = np.abs(b)
    return np.where(np.isfinite(a), a, _F(0)).max(axis=1).astype(_F)


def _scales(m: np.ndarray, code_max):
    with np.errstate(divide="ignore", over="ignore", under="ignore"):
        scale = (m / code_max).astype(_F)
        lift = np.where(m < _TINY, _LIFT, _F(1)).astype(_F)
        lifted = (m * lift).astype(_F)
        inv = np.where(m > 0, code_max / np.where(m > 0, lifted, _F(1)), _F(0)).astype(_F)
    return scale, lift, inv


def _scaled(b: np.ndarray, lift: np.ndarray, inv: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        return ((b * lift[:, None]).astype(_F) * inv[:, None]).astype(_F)


def _round_even(t: np.ndarray) -> np.ndarray:
    return ((t + _MAGIC).astype(_F) - _MAGIC).astype(_F)


def _int8_roundtrip(b: np.ndarray) -> np.ndarray:
    scale, lift, inv = _scales(_finite_max(b), _INT8_MAX)
    t = _scaled(b, lift, inv)
    t = np.where(t < -_INT8_MAX, -_INT8_MAX, t)
    t = np.where(t > _INT8_MAX, _INT8_MAX, t)
    t = np.where(np.isnan(t), _F(0), t)
    with np.errstate(under="ignore"):
        v = (_round_even(t) * scale[:, None]).astype(_F)
    v = np.where(np.isposinf(b), _F(np.inf), v)
    v = np.where(np.isneginf(b), _F(-np.inf), v)
    return np.where(np.isnan(b), _F(np.nan), v).astype(_F)


def _fp8_round(a: np.ndarray) -> np.ndarray:
    """|t| (0 <= a <= 416) rounded to e4m3's nearest value, ties to even: quant.h's fp8_code then fp8_unscaled."""
    sub = (_round_even((a * _F(512)).astype(_F)) * _F(2.0 ** -9)).astype(_F)
    bits = a.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) << np.uint32(20)
    return np.where(a < _F(2.0 ** -6), sub, rounded.astype(np.uint32).view(_F)).astype(_F)


def _fp8_roundtrip(b: np.ndarray) -> np.ndarray:
    scale, lift, inv = _scales(_finite_max(b), _FP8_MAX)
    t = _scaled(b, lift, inv)
    a = np.abs(t)
    a = np.where(a > _FP8_MAX, _FP8_MAX, a)
    a = np.where(np.isnan(a), _F(0), a).astype(_F)
    with np.errstate(under="ignore"):
        v = (np.copysign(_fp8_round(a), t) * scale[:, None]).astype(_F)
    v = np.where(np.isposinf(b), _F(np.inf), v)
    v = np.where(np.isneginf(b), _F(-np.inf), v)
    return np.where(np.isnan(b), _F(np.nan), v).astype(_F)


def _bf16_roundtrip(x: np.ndarray) -> np.ndarray:
    bits = x.astype(_F).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(x), _F(np.nan), rounded.astype(np.uint32).view(_F)).astype(_F)


def roundtrip(x, wire: str) -> np.ndarray:
    """What `x` (any float array, read as float32) is after one trip through the wire format."""
    _check_wire(wire)
    flat = np.ascontiguousarray(np.asarray(x), dtype=_F).reshape(-1)
    if wire == "bf16":
        return _bf16_roundtrip(flat)
    b = _blocks(flat)
    out = _int8_roundtrip(b) if wire == "int8" else _fp8_roundtrip(b)
    return out.reshape(-1)[:flat.size]


def reference(inputs, wire: str, op: str = "sum") -> np.ndarray:
    """all_reduce(x, compress=wire, op=op)'s result as float32, from every rank's input in rank order (arrays of one
    size, any float dtype). A float16/bfloat16 call returns this rounded to its dtype."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg'; got {op!r}")
    acc = None
    with np.errstate(over="ignore", invalid="ignore"):
        for x in inputs:
            d = roundtrip(x, wire)
            acc = d if acc is None else (acc + d).astype(_F)
        if op == "avg":
            acc = (acc / _F(len(inputs))).astype(_F)
    return roundtrip(acc, wire)


def error_bound(inputs, wire: str, op: str = "sum", dtype: str = "float32") -> np.ndarray:
    """The largest |result - exact| allowed per element (float64) for finite inputs whose sums do not overflow:
    docs/compression.md. S is the sum over ranks of each rank's largest finite magnitude in the element's block,
    X the sum of the element's magnitudes, P the number of ranks."""
    _check_wire(wire)
    xs = [np.ascontiguousarray(np.asarray(x), dtype=np.float64).reshape(-1) for x in inputs]
    P = len(xs)
    n = xs[0].size
    X = np.sum([np.abs(x) for x in xs], axis=0)
    S = np.zeros(n)
    for x in xs:
        a = np.abs(x)
        m = np.where(np.isfinite(a), a, 0)
        pad = np.zeros(-(-n // BLOCK) * BLOCK)
        pad[:n] = m
        S += np.repeat(pad.reshape(-1, BLOCK).max(axis=1), BLOCK)[:n]
    if wire == "int8":
        bound = 1.003 * S / 126 + (P - 1) * 2 * _U * (X + S) + (2 * P + 2) * _ABS_TINY
    elif wire == "fp8":
        bound = 0.1300 * X + (P - 1) * 2 * _U * X + 2.2 * 2.0 ** -10 * S / 416 + (2 * P + 2) * _ABS_TINY
    else:
        bound = (2.01 * 2.0 ** -8 + (P - 1) * 2 * _U) * X + (P + 1) * 2.0 ** -134
    if op == "avg":  # the average is requantised, and its absolute terms (denormal spacing) are not divided by P
        bound = (bound + 2 * _U * X) / P + (2.0 ** -134 if wire == "bf16" else _ABS_TINY)
    result = X / (P if op == "avg" else 1) + bound  # a bound on |result|
    if dtype == "float16":
        bound = bound + 2.0 ** -11 * result + 2.0 ** -25
    elif dtype == "bfloat16":
        bound = bound + 2.0 ** -8 * result + 2.0 ** -134
    return bound
