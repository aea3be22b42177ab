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


class Members:
    """The store server's ledger of registered ranks: which are connected, which closed without a goodbye
    (suspects), which are lost and why, and which were told. A suspect becomes lost on evidence only: its process
    is gone (same kernel and pid namespace), or, on another host, it did not reconnect within `grace` seconds."""

    def __init__(self, grace: float):
        self.grace = grace
        self.identity = host_identity()
        self.live: dict = {}  # rank -> live registered connections
        self.suspects: dict = {}  # rank -> (pid or None, local, since): closed without a goodbye
        self.lost: dict = {}  # rank -> why, in the order they were lost: the first is the root cause
        self.told: set = set()  # ranks sent a lost reply, or gone (no live connection left)

    def register(self, conn, rank: int, pid: int, identity: str) -> None:
        conn.rank, conn.pid = rank, pid
        conn.local = bool(identity) and identity == self.identity
        self.live.setdefault(rank, set()).add(conn)
        self.suspects.pop(rank, None)

    def closed(self, conn, now: float, serving: bool) -> list:
        """`conn` closed: a rank whose last connection it was is gone, and a suspect unless it said goodbye.
        Returns the ranks found lost at once [(rank, why)]."""
        live = self.live.get(conn.rank)
        if live is None:
            return []
        live.discard(conn)
        if live:
            return []
        del self.live[conn.rank]
        self.told.add(conn.rank)
        if conn.clean or not serving:
            return []
        self.suspects[conn.rank] = (conn.pid, conn.local, now)
        return self.judge(now)

    def judge(self, now: float) -> list:
        """The suspects that the evidence now says are lost, [(rank, why)], taken off the suspects."""
        found = []
        for rank, (pid, local, since) in list(self.suspects.items()):
            if rank in self.live:  # it came back
                del self.suspects[rank]
            elif local and pid is not None and pid_exited(pid):
                del self.suspects[rank]
                found.append((rank, f"its process (pid {pid}) has exited"))
            elif now - since > self.grace:
                del self.suspects[rank]
                if not local:  # else alive on this host: it dropped the connection itself and will reconnect
                    found.append((rank, f"its connection closed and it did not reconnect within {self.grace:g} s"))
        return found
