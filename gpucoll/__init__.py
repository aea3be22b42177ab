"""gpucoll: GPU-native collective communication for Python.

Importing gpucoll loads only its own native core (gpucoll._C) and NumPy; torch and CuPy are imported when a
call needs them.
"""

from gpucoll import errors
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
    "CollectiveTimeout",
    "Communicator",
    "CudaError",
    "GpucollError",
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
    "premul_sum",
    "spawn",
]


def __getattr__(name):
    # Lazy so that `import gpucoll` stays cheap and never drags in torch/CuPy.
    if name in ("init", "Communicator"):
        from gpucoll import communicator

        return getattr(communicator, name)
    if name in ("premul_sum", "Work"):
        from gpucoll import _nccl_backend

        return getattr(_nccl_backend, name)
    if name == "spawn":
        from gpucoll._spawn import spawn

        return spawn
    raise AttributeError(f"module 'gpucoll' has no attribute {name!r}")
