"""gpucoll: GPU-native collective communication for Python.

Importing gpucoll loads only its own modules, its native core (gpucoll._C, through gpucoll._native) and NumPy;
torch and CuPy are imported when a call needs them.
"""

from gpucoll import errors
from gpucoll._spawn import spawn
from gpucoll._version import __version__
from gpucoll.backends.work import Work, premul_sum
from gpucoll.communicator import Communicator, init
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
