"""gpucoll.premul_sum: the pre-multiplied sum reduction op (``PreMulSum``) the nccl and host backends take.
(The Work of an ``async_op=True`` call is gpucoll._C.Work, csrc/python/work.cc, on every backend.)"""

from __future__ import annotations

import math
import numbers

from gpucoll.errors import InvalidArgument


class PreMulSum:
    """The reduction op ``sum(scalar * x_r over ranks r)`` (NCCL's ncclRedOpCreatePreMulSum); see premul_sum."""

    __slots__ = ("scalar",)

    def __init__(self, scalar):
        object.__setattr__(self, "scalar", scalar)

    def __setattr__(self, name, value):
        raise AttributeError("PreMulSum is immutable")

    def __eq__(self, other):
        return type(other) is PreMulSum and other.scalar == self.scalar

    def __hash__(self):
        return hash(("premul_sum", self.scalar))

    def __reduce__(self):
        return (premul_sum, (self.scalar,))

    def __repr__(self):
        return f"gpucoll.premul_sum({self.scalar!r})"


def premul_sum(scalar) -> PreMulSum:
    """An ``op=`` for all_reduce, reduce and reduce_scatter on the nccl and host backends: every rank's input is
    multiplied by `scalar` before the sum (one fused pass, e.g. ``premul_sum(1 / world_size)`` for a mean of
    gradients). The custom backend hands it to NCCL (its kernels have no pre-multiplied sum other than avg).

    `scalar` must be a finite real number; it is converted to the reduction's dtype when the collective runs (an
    integer dtype needs an integer scalar that fits it)."""
    if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real):
        raise InvalidArgument(f"premul_sum scalar must be a real number (int or float); got {scalar!r}")
    value = int(scalar) if isinstance(scalar, numbers.Integral) else float(scalar)
    if not math.isfinite(value):
        raise InvalidArgument(f"premul_sum scalar must be finite; got {scalar!r}")
    return PreMulSum(value)
