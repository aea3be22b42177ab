"""gpucoll: GPU-native collective communication for Python.

Importing gpucoll loads only its own native core (gpucoll._C) and NumPy; torch and CuPy are imported when a
call needs them.
"""

from gpucoll import errors
from gpucoll._timeout import MAX_TIMEOUT
from gpucoll._version import __version__
from gpucoll.errors import (
    CollectiveTimeout,
    CudaError,
    GpucollError,
    InternalError,
    InvalidArgument,
    InvalidUsage,
    NcclError,
    RemoteError,
    Unsupported,
)

__all__ = [
    "MAX_TIMEOUT",
    "CollectiveTimeout",
    "Communicator",
    "CudaError",
    "GpucollError",
    "Group",
    "InternalError",
    "InvalidArgument",
    "InvalidUsage",
    "NcclError",
    "RemoteError",
    "Unsupported",
    "Work",
    "__version__",
    "errors",
    "init",
    "init_from_store",
    "join",
    "premul_sum",
    "spawn",
]


def __getattr__(name):
    # Lazy so that `import gpucoll` stays cheap, never drags in torch/CuPy, and does not load the native core: a
    # build that cannot load (e.g. a bad GPUCOLL_EMU_* setting) then fails at `import gpucoll._C` with its own
    # message. These are the package's only function-level imports of its own modules (tests/project/import_graph.py).
    if name == "Group":
        from gpucoll.group import Group

        return Group
    if name == "Communicator":
        from gpucoll.communicator import Communicator

        return Communicator
    if name in ("init", "init_from_store", "join"):
        from gpucoll import _make

        return getattr(_make, name)
    if name == "premul_sum":
        from gpucoll.backends.premul import premul_sum

        return premul_sum
    if name == "Work":
        from gpucoll._native import _C

        return _C.Work
    if name == "spawn":
        from gpucoll._spawn import spawn

        return spawn
    raise AttributeError(f"module 'gpucoll' has no attribute {name!r}")
