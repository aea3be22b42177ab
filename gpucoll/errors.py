"""Typed errors raised by gpucoll.

Every error of the C++ core arrives here once, translated in ``csrc/python/errors.cc`` from its error code.
All classes are picklable (so a worker's error crosses process boundaries intact) and carry:

* ``message`` - what went wrong, naming the argument and what was expected where that applies;
* ``call`` - the failing call (``shm_open(...)``, ``ncclAllReduce``), or ``""``;
* ``location`` - ``file.cc:line`` in the C++ core, or ``""``;
* ``ranks`` - the ranks the error is about (missing ranks of a timeout, failed ranks of a remote error);
* ``trace_file`` - the flight-recorder dump a failed collective wrote on this rank (gpucoll/flight_recorder.py), or
  None.
"""

from __future__ import annotations

__all__ = [
    "CollectiveTimeout",
    "CudaError",
    "GpucollError",
    "InternalError",
    "InvalidArgument",
    "InvalidUsage",
    "NcclError",
    "RemoteError",
    "SystemError",
    "Unsupported",
    "error_class_for_code",
]


class GpucollError(Exception):
    """Base class of every gpucoll error."""

    code = 0
    trace_file = None

    def __init__(self, message: str = "", *, call: str = "", location: str = "", ranks=()):
        super().__init__(message)
        self.message = message
        self.call = call
        self.location = location
        self.ranks = tuple(int(r) for r in ranks)

    def __str__(self) -> str:
        text = self.message
        if self.call:
            text += f" [call: {self.call}]"
        if self.location:
            text += f" [at {self.location}]"
        return text

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.call, self.location, self.ranks, self.__dict__))


def _rebuild(cls, message, call, location, ranks, state):
    err = cls(message, call=call, location=location, ranks=ranks)
    err.__dict__.update(state)
    return err


class InvalidArgument(GpucollError, ValueError):
    """An argument is wrong: the message names it and says what was expected."""

    code = 1


class Unsupported(GpucollError, NotImplementedError):
    """A valid request that this build, backend or library version cannot serve."""

    code = 2


class InvalidUsage(GpucollError, RuntimeError):
    """The call is not allowed in the current state (closed or broken communicator, ...)."""

    code = 3


class CollectiveTimeout(GpucollError, TimeoutError):
    """A collective or rendezvous did not complete in time; ``ranks`` lists the ranks that were missing."""

    code = 4

    @property
    def missing_ranks(self):
        return self.ranks


class RemoteError(GpucollError, RuntimeError):
    """Another rank failed; ``ranks`` lists which."""

    code = 5


class NcclError(GpucollError, RuntimeError):
    """NCCL returned an error; the message holds NCCL's own text and the failing call."""

    code = 6


class CudaError(GpucollError, RuntimeError):
    """A CUDA runtime or driver call failed."""

    code = 7


class SystemError(GpucollError, OSError):
    """An operating-system call failed (message holds strerror and errno)."""

    code = 8

    def __init__(self, message: str = "", *, call: str = "", location: str = "", ranks=()):
        GpucollError.__init__(self, message, call=call, location=location, ranks=ranks)

    def __str__(self) -> str:
        return GpucollError.__str__(self)


class InternalError(GpucollError, RuntimeError):
    """A bug in gpucoll; please report it with the message."""

    code = 9


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, Unsupported, InvalidUsage, CollectiveTimeout, RemoteError,
                                     NcclError, CudaError, SystemError, InternalError)}


def error_class_for_code(code: int):
    return _BY_CODE.get(int(code), GpucollError)
