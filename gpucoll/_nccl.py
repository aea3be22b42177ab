"""Finding and loading NCCL (libnccl.so.2) at run time.

The C++ core opens NCCL with dlopen (``csrc/backends/nccl/nccl_loader.cc``) in this order:
``GPUCOLL_NCCL_LIBRARY``, a copy already loaded in the process (torch's, CuPy's), the paths found here for
installed ``nvidia-nccl-cu13`` / ``-cu12`` wheels, then the system loader. This module supplies the wheel
paths, which only Python can find, without importing torch or CuPy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import threading

from gpucoll._native import _C

__all__ = ["WHEEL_DISTRIBUTIONS", "install_hint", "load", "state", "wheel_candidates"]

# cu13 first: it is the current CUDA major, and both wheels install to the same path anyway (one per env).
WHEEL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
_SONAME = "libnccl.so.2"

_lock = threading.Lock()
_cached: dict | None = None


def _add(out: list, path) -> None:
    path = os.path.realpath(str(path))
    if os.path.isfile(path) and path not in out:
        out.append(path)


def wheel_candidates() -> list:
    """Absolute paths of libnccl.so.2 shipped by installed nvidia-nccl wheels, best first; [] if none."""
    out: list = []
    # nvidia.nccl is a namespace package (no __init__.py): its directory comes from __path__, not __file__.
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for directory in list(spec.submodule_search_locations):
            _add(out, os.path.join(directory, "lib", _SONAME))
    # The distributions' file lists also cover layouts where nvidia/ is not importable from sys.path.
    for name in WHEEL_DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == _SONAME:
                _add(out, f.locate())
    return out


def load(refresh: bool = False) -> dict:
    """Load NCCL once and return its state.

    Keys: loaded, path, source, version (e.g. 23203), version_string ("2.32.3"), min_version_string,
    reason (why not loaded), tried (list of (candidate, error)), missing_optional, attempted.
    A missing NCCL is a state (loaded False with a reason), never an exception. ``refresh=True`` looks for
    wheels again (after a pip install in the same process); a library once loaded stays loaded.
    """
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = dict(_C.nccl_load(wheel_candidates()))
        return dict(_cached)


def state() -> dict:
    """The loader's current state without loading anything (attempted is False before the first load)."""
    return dict(_C.nccl_state())


def install_hint(driver_version: int | None = None) -> str:
    """How to install NCCL for this machine: the cu12 wheel where the driver predates CUDA 13."""
    flavour = "cu12" if driver_version and 0 < driver_version < 13000 else "cu13"
    return (
        f"pip install 'gpucoll[{flavour}]' (or just: pip install nvidia-nccl-{flavour}), "
        f"or set GPUCOLL_NCCL_LIBRARY=/path/to/libnccl.so.2"
    )
