"""--compress: what the check of a compressed all_reduce counts, and --compare none, the same calls uncompressed.

A compressed result is not exact, so the check compares it with the exact sum of every rank's input (the bench's
patterns, tiled as run() saw them) and counts the elements outside gpucoll.compression.error_bound; it also
reports the largest error it saw. Every rank gets the same bits, so each rank's figures are everyone's.
"""

from __future__ import annotations

import numpy as np

from gpucoll import compression
from gpucoll.bench.colls import rank_input

_CHUNK = 1 << 20  # elements per bound computation (whole 256-element blocks): P float64 copies of it at a time


def _as_float(dt, storage: np.ndarray) -> np.ndarray:
    if dt.name == "bfloat16":
        return (storage.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return storage.astype(np.float32)


def errors(ctx, wire: str, got_storage: np.ndarray) -> tuple[int, float]:
    """(elements outside the error bound, largest |error|) of one rank's result `got_storage` (the dtype's storage)."""
    dt, op, P = ctx.dtype, ctx.op, ctx.nranks
    patterns = [_as_float(dt, rank_input(dt, op, q, P)) for q in range(P)]
    got = _as_float(dt, np.asarray(got_storage).reshape(-1))
    over, worst = 0, 0.0
    for lo in range(0, got.size, _CHUNK):
        hi = min(got.size, lo + _CHUNK)
        idx = np.arange(lo, hi) % patterns[0].size
        inputs = [p[idx] for p in patterns]
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0) / (P if op == "avg" else 1)
        err = np.abs(got[lo:hi].astype(np.float64) - exact)
        bound = compression.error_bound(inputs, wire, op, dt.gpucoll)
        over += int(np.count_nonzero(~(err <= bound)))
        worst = max(worst, float(err.max()) if err.size else 0.0)
    return over, worst
