"""Read access to the GPUCOLL_* registry of the C++ core (csrc/core/config.cc is the one reader)."""

from __future__ import annotations

from gpucoll._native import _C


def variables():
    """Every registered variable: dicts with name, type, default, description, value, is_set."""
    return _C.config_vars()


def get(name: str) -> str:
    return _C.config_raw(name)


def get_bool(name: str) -> bool:
    return _C.config_bool(name)


def get_int(name: str) -> int:
    return _C.config_int(name)


def get_bytes(name: str) -> int:
    return _C.config_bytes(name)


def is_set(name: str) -> bool:
    return _C.config_is_set(name)
