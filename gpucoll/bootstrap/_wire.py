"""The rendezvous store's wire format (see store.py): the handshake, frames, request/reply fields, opcodes.

A connection starts with a challenge-response on the job's secret, before the server reads any command:

    server -> client   HELLO_MAGIC | version (u8) | server nonce (32 bytes)
    client -> server   HELLO_MAGIC | client nonce (32) | HMAC-SHA256(key, "client" | server nonce | client nonce)
    server -> client   AUTH_OK | HMAC-SHA256(key, "server" | client nonce | server nonce)      (or AUTH_DENIED /
                       AUTH_BUSY, then the server closes)

where key = SHA-256("gpucoll-store key" | secret). The secret never travels; fresh nonces on both sides make a
recorded exchange useless, and the server's answer proves to the client that it talks to its own job's store.

Then every frame, either way, is ``MAGIC (4 bytes) | payload length (u32, big-endian) | payload``; strings and byte
strings are ``u32 length | bytes``. Anything else is a ``_ProtocolError``, which the server answers by dropping the
connection.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from gpucoll.errors import InvalidArgument

MAGIC = b"GCS1"
HELLO_MAGIC = b"GCS2"
PROTOCOL_VERSION = 3  # 3: _OP_LOST
NONCE_BYTES = MAC_BYTES = 32
# The key under which the server lists where connections refused for a wrong secret came from (_server.py).
REFUSED_KEY = "gpucoll/store/refused"
HELLO_BYTES = len(HELLO_MAGIC) + 1 + NONCE_BYTES  # what the server sends first
RESPONSE_BYTES = len(HELLO_MAGIC) + NONCE_BYTES + MAC_BYTES  # the client's answer
AUTH_OK, AUTH_DENIED, AUTH_BUSY = 0, 1, 2  # first byte of the server's verdict
MIN_SECRET_BYTES = 16
MAX_FRAME = 64 << 20  # rendezvous values are small (an NCCL unique id is 128 bytes); 64 MiB is generous
MAX_KEYS = 1 << 16  # keys in one wait/check: a rank per key for the largest jobs, ~10 MiB of server memory
_HEADER = struct.Struct("!4sI")
_FRAME_TIMEOUT = 30.0  # a frame must arrive whole within this from its first byte (a stalled peer is dropped)
_HANDSHAKE_TIMEOUT = 5.0  # a connection that has not authenticated within this is dropped
_REPLY_GRACE = 10.0  # client waits this long beyond a blocking op's own timeout before blaming the network
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_OP_SET, _OP_GET, _OP_ADD, _OP_CHECK, _OP_DELETE, _OP_WAIT, _OP_REGISTER, _OP_BYE, _OP_LOST = range(1, 10)
_ST_OK, _ST_TIMEOUT, _ST_ERROR, _ST_LOST = 0, 1, 2, 3


def derive_key(secret: bytes) -> bytes:
    return hashlib.sha256(b"gpucoll-store key\0" + secret).digest()


def client_mac(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"client\0" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_mac(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"server\0" + client_nonce + server_nonce, hashlib.sha256).digest()

class _ProtocolError(Exception):
    """The peer sent something that is not a valid frame or command."""


class _Writer:
    def __init__(self):
        self._parts: list[bytes] = []

    def _pack(self, fmt: str, v) -> _Writer:
        self._parts.append(struct.pack(fmt, v))
        return self

    def u8(self, v: int) -> _Writer:
        return self._pack("!B", v)

    def u32(self, v: int) -> _Writer:
        return self._pack("!I", v)

    def i32(self, v: int) -> _Writer:
        return self._pack("!i", v)

    def i64(self, v: int) -> _Writer:
        return self._pack("!q", v)

    def f64(self, v: float) -> _Writer:
        return self._pack("!d", v)

    def blob(self, b: bytes) -> _Writer:
        self._parts += [struct.pack("!I", len(b)), bytes(b)]
        return self

    def str(self, s: str) -> _Writer:
        return self.blob(s.encode("utf-8"))

    def strs(self, items: list[str]) -> _Writer:
        self.u32(len(items))
        for s in items:
            self.str(s)
        return self

    def frame(self) -> bytes:
        payload = b"".join(self._parts)
        if len(payload) > MAX_FRAME:
            raise InvalidArgument(f"request of {len(payload)} bytes exceeds the store's frame limit of "
                                  f"{MAX_FRAME} bytes: keep values small (they are rendezvous data)")
        return _HEADER.pack(MAGIC, len(payload)) + payload


class _Reader:
    def __init__(self, data: bytes):
        self._data = data
        self._pos = 0
        self.status = _ST_OK

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise _ProtocolError(f"payload truncated (wanted {n} bytes at offset {self._pos} of {len(self._data)})")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return struct.unpack("!I", self._take(4))[0]

    def i32(self) -> int:
        return struct.unpack("!i", self._take(4))[0]

    def i64(self) -> int:
        return struct.unpack("!q", self._take(8))[0]

    def f64(self) -> float:
        return struct.unpack("!d", self._take(8))[0]

    def blob(self) -> bytes:
        return self._take(self.u32())

    def str(self) -> str:
        try:
            return self.blob().decode("utf-8")
        except UnicodeDecodeError:
            raise _ProtocolError("key is not valid UTF-8") from None

    def strs(self, limit: int = MAX_KEYS) -> list[str]:
        n = self.u32()
        if n > limit:  # refused before any is decoded: each costs the server ~100 bytes more than on the wire
            raise _ProtocolError(f"{n} keys in one request (at most {limit})")
        return [self.str() for _ in range(n)]

    def end(self) -> None:
        if self._pos != len(self._data):
            raise _ProtocolError(f"{len(self._data) - self._pos} unexpected trailing bytes")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read n bytes; fewer only if the peer closed. Grows as data arrives, so a lying length costs nothing."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)
