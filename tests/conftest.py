"""Test-session set-up shared by every test directory.

* tests/ goes on sys.path, so test modules can `import helpers`. gpucoll.spawn starts workers with
  multiprocessing's "spawn" method, which ships the parent's sys.path to the children: functions defined at
  module level in a test file (and helpers) are importable there too.
* `@pytest.mark.gpu` tests (the marker is registered in pyproject.toml) are skipped with the reason when no CUDA
  GPU is usable. The decision uses gpucoll._C.cuda_probe() and never imports torch or CuPy, which would be slow
  and could initialise CUDA in the pytest process before workers fork or spawn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


def _gpu_unusable_reason():
    """None when a CUDA GPU is usable, else why not (computed once per session)."""
    try:
        from gpucoll import _C
    except Exception as exc:  # noqa: BLE001 - an unbuilt extension is a reason to skip, not to crash collection
        return f"gpucoll._C cannot be imported ({type(exc).__name__}: {exc})"
    probe = getattr(_C, "cuda_probe", None)
    if probe is None:
        return "gpucoll._C has no cuda_probe(): cannot tell whether a CUDA GPU is usable"
    try:
        info = probe()
    except Exception as exc:  # noqa: BLE001
        return f"gpucoll._C.cuda_probe() failed: {type(exc).__name__}: {exc}"
    try:
        count = int(info.get("device_count", 0) or 0)
    except (AttributeError, TypeError, ValueError):
        return f"gpucoll._C.cuda_probe() returned an unexpected value: {info!r}"
    if count < 1:
        why = info.get("reason") or info.get("runtime_reason") or "device_count is 0"
        return f"no usable CUDA GPU: {why}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
