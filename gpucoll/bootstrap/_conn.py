"""The store server's view of one connection and the limits it holds every connection to (see _server.py)."""

from __future__ import annotations

import collections
import dataclasses
import resource

from gpucoll.bootstrap import _wire as w


def _default_max_conns() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(32, min(4096, soft - 128))


@dataclasses.dataclass
class Limits:
    max_conns: int = dataclasses.field(default_factory=_default_max_conns)
    max_pending: int = 128
    handshake_timeout: float = w._HANDSHAKE_TIMEOUT
    frame_timeout: float = w._FRAME_TIMEOUT
    max_buffered: int = 256 << 20
    lost_grace: float = 3.0


class Conn:
    __slots__ = ("authed", "clean", "closed", "frame_since", "local", "nonce", "peer", "pid", "rank",
                 "rbuf", "since", "sock", "waiter", "wlen", "wq", "writing")

    def __init__(self, sock, peer, nonce: bytes, now: float):
        self.sock, self.peer, self.nonce = sock, peer, nonce
        self.rbuf = bytearray()
        # Replies not yet sent: [view, value] chunks; value is the stored bytes object a view shares (counted once
        # in the server's buffered bytes however many replies carry it), None for bytes of this connection's own.
        self.wq: collections.deque = collections.deque()
        self.wlen = 0
        self.authed = self.clean = self.closed = self.writing = False
        self.since = now  # accepted at (handshake deadline)
        self.frame_since = None  # first byte of the frame being received
        self.rank = self.pid = None
        self.local = False
        self.waiter = None
