"""What backends hand their callers: ``Work`` handles of ``async_op=True`` calls (the nccl backend's, and
``CompletedWork`` for a call that finished before it returned) and ``premul_sum`` ops (gpucoll.Work and
gpucoll.premul_sum)."""

from __future__ import annotations

import math
import numbers

from gpucoll import _cuda_buffers
from gpucoll.errors import InvalidArgument

# -- premul_sum -----------------------------------------------------------------------------------------------------

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


# -- Work -----------------------------------------------------------------------------------------------------------

class Work:
    """What an operation issued with ``async_op=True`` returns.

    * ``wait()``: the caller's current stream (torch's for tensors, CuPy's for arrays, else the legacy default
      stream) waits for the operation; the host does not block.
    * ``is_completed()``: whether the GPU finished it (never blocks).
    * ``synchronize()``: blocks the host until it finished.
    * ``result()``: what the synchronous call would have returned.

    All three raise the communicator's failure (CollectiveTimeout, NcclError) once the watchdog recorded one.
    ``wait(timeout=...)`` accepts torch's argument and ignores it: the communicator's own timeout applies.
    An operation captured into a CUDA graph has no eager completion: it reports completed, and wait() does nothing.
    """

    __slots__ = ("_backend", "_device", "_kind", "_native", "_result")

    def __init__(self, native, backend, kind: str, device: int, result=None):
        self._native = native
        self._backend = backend
        self._kind = kind
        self._device = device
        self._result = result

    def wait(self, timeout=None) -> bool:
        self._backend._raise_if_failed()
        self._native.wait_on(_cuda_buffers.current_stream(self._kind, self._device))
        return True

    def is_completed(self) -> bool:
        self._backend._raise_if_failed()
        return self._native.query()

    def synchronize(self) -> None:
        self._native.synchronize()
        self._backend._raise_if_failed()

    def result(self):
        return self._result

    @property
    def seq(self) -> int:
        return self._native.seq

    def __repr__(self) -> str:
        return f"<gpucoll.Work {self._native.what} {self._native.state}>"


class CompletedWork:
    """The Work of a backend whose operations complete before the call returns (host)."""

    __slots__ = ("_result",)

    def __init__(self, result=None):
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def result(self):
        return self._result

    def __repr__(self) -> str:
        return "<gpucoll.Work completed>"
