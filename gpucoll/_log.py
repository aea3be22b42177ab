"""Python-side logging through the core's logger: same GPUCOLL_LOG_LEVEL, same "[gpucoll RANK]" prefix."""

from __future__ import annotations

from gpucoll._native import _C

ERROR, WARN, INFO, DEBUG, TRACE = 0, 1, 2, 3, 4


def _emit(level: int, message: str) -> None:
    _C.log(level, message)


def error(message: str) -> None:
    _emit(ERROR, message)


def warn(message: str) -> None:
    _emit(WARN, message)


def info(message: str) -> None:
    _emit(INFO, message)


def debug(message: str) -> None:
    _emit(DEBUG, message)


def always(message: str) -> None:
    """INFO whatever GPUCOLL_LOG_LEVEL says: output a variable asked for by name (GPUCOLL_STRAGGLER_REPORT)."""
    _C.log(INFO, message, True)


def enabled(level: int) -> bool:
    return level <= _C.log_level()
