"""The one rule for a timeout a user passes (init, join, the store, torch's process group).

Every layer under a timeout has a ceiling of its own: epoll sleeps at most INT_MAX ms (24.8 days), a socket's
timeout and a thread's wait must fit a time_t, the C++ backends turn seconds into int64 nanoseconds. Rather than
let each one fail in its own way (the store's loop died of an OverflowError a month-long timeout raised), a timeout
is checked once, at the call, against one ceiling that every layer can hold. 1e7 s is about 116 days: longer than
any job waits for a peer on purpose, so "no timeout" is spelt ``MAX_TIMEOUT``.
"""

from __future__ import annotations

import math

from gpucoll.errors import InvalidArgument

MAX_TIMEOUT = 1e7


def check(timeout, name: str = "timeout") -> float:
    """``timeout`` as a float of seconds in (0, MAX_TIMEOUT]; InvalidArgument naming ``name`` otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds; got {timeout!r}")
    if timeout > MAX_TIMEOUT:
        raise InvalidArgument(f"{name} must be at most {MAX_TIMEOUT:g} s (about 116 days); got {timeout!r}. "
                              f"For 'wait as long as it takes' pass gpucoll.MAX_TIMEOUT")
    return float(timeout)


def clamp(seconds: float) -> float:
    """A timeout given through an API that allows any length (torch's timedelta), held to the ceiling."""
    return min(float(seconds), MAX_TIMEOUT)
