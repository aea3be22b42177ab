"""gpucoll's native core (``gpucoll._C``, built from csrc/, bound in csrc/python/), loaded here and only here.

Every other module takes it from this one: ``from gpucoll._native import _C``. Where it cannot be loaded (a broken
or missing build), ``LOAD_ERROR`` says why and ``_C`` raises that ImportError at its first use, as the import itself
did before: so ``import gpucoll`` still works and ``python -m gpucoll info`` can report the broken build.
"""

from __future__ import annotations


class _Unloaded:
    """Stands in for ``_C`` when it failed to load: any use raises the ImportError it failed with."""

    def __init__(self, error: ImportError):
        self._error = error

    def __getattr__(self, name):
        raise ImportError(str(self._error)) from self._error


try:
    from gpucoll import _C
except ImportError as exc:  # a broken build must still be diagnosable
    _C = _Unloaded(exc)
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"
else:
    LOAD_ERROR = ""

__all__ = ["LOAD_ERROR", "_C"]
