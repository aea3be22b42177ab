"""Whether a process the rendezvous store knows by pid is still alive: evidence for naming a dead rank at once
(the store server's liveness checks, the host backend's set-up) rather than after a timeout. A pid means something
only in the same kernel and pid namespace, which host_identity() tells."""

from __future__ import annotations

import os


def host_identity() -> str:
    """This kernel and pid namespace: equal on two processes iff a pid from one is meaningful to the other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def pid_exited(pid: int) -> bool:
    """True when `pid` is gone or a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, someone else's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return False
