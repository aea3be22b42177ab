"""Rendezvous key-value store over TCP: rank 0 hosts it, every rank (rank 0 included) is a client.

Only the job's members can use it: every connection first answers a challenge with an HMAC of the job's secret
(``secret=``, else ``GPUCOLL_STORE_SECRET``; ``gpucoll.spawn`` and ``init(mpi_comm=...)`` make one), and the
server reads no command from a connection that has not (_wire.py has the handshake and the frames). The server
(_server.py) is one event loop with every resource bounded, so it keeps serving the job whatever else reaches its
port. A client that passes ``rank=`` registers it: when that rank dies, requests that wait for keys fail at once
naming it, instead of after the timeout.

Blocking operations (``get``, ``wait``) wait server-side with the caller's timeout, so a waiting rank costs no
network traffic.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time

from gpucoll import _log, _timeout, config, errors
from gpucoll.bootstrap import _wire as w
from gpucoll.bootstrap._liveness import host_identity
from gpucoll.bootstrap._server import Limits, Server
from gpucoll.bootstrap._wire import (
    _HEADER,
    _INT64_MAX,
    _INT64_MIN,
    _OP_ADD,
    _OP_BYE,
    _OP_CHECK,
    _OP_DELETE,
    _OP_GET,
    _OP_LOST,
    _OP_REGISTER,
    _OP_SET,
    _OP_WAIT,
    _REPLY_GRACE,
    _ST_ERROR,
    _ST_LOST,
    _ST_TIMEOUT,
    MAGIC,
    MAX_FRAME,
    _ProtocolError,
    _Reader,
    _recv_exact,
    _Writer,
)
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage, RemoteError

__all__ = ["HOW_TO_SET_SECRET", "MAGIC", "MAX_FRAME", "SecretRefused", "TCPStore", "job_secret", "new_secret",
           "solo_secret"]

_BARRIER_PREFIX = "__gpucoll_barrier__/"
HOW_TO_SET_SECRET = ("set GPUCOLL_STORE_SECRET to the same random value on every rank (e.g. export "
                     "GPUCOLL_STORE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))') before "
                     "mpirun/srun, which pass the environment on), or pass secret=")


def _warn(message: str) -> None:
    # Logging must never take the server thread down (e.g. gpucoll._C unavailable during a rebuild).
    try:
        _log.warn(message)
    except Exception:  # noqa: BLE001 - a warning must never raise
        sys.stderr.write(f"[gpucoll] WARN  {message}\n")


class SecretRefused(InvalidArgument):
    """The store refused this rank's handshake: the rank does not hold the server's secret."""


def new_secret() -> str:
    """A fresh job secret: 32 random bytes in hex."""
    return secrets.token_hex(32)


def solo_secret(world_size: int, secret=None):
    """`secret`; for a one-rank job with none given or configured, a fresh one (nobody else is to connect)."""
    if secret is None and world_size == 1 and not config.is_set("GPUCOLL_STORE_SECRET"):
        return new_secret()
    return secret


def job_secret(secret=None) -> bytes:
    """The job's secret as bytes: `secret` (str or bytes), else GPUCOLL_STORE_SECRET. InvalidArgument saying how
    to set one when there is none or it is too short to resist guessing."""
    source = "secret="
    if secret is None:
        secret, source = config.get("GPUCOLL_STORE_SECRET"), "GPUCOLL_STORE_SECRET"
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise InvalidArgument(f"secret must be a str or bytes; got {type(secret).__name__}")
    if not secret:
        raise InvalidArgument(f"the rendezvous store admits only the job's members, and this rank knows no job "
                              f"secret: {HOW_TO_SET_SECRET}")
    if len(secret) < w.MIN_SECRET_BYTES:
        raise InvalidArgument(f"{source} is {len(secret)} bytes long; a job secret needs at least "
                              f"{w.MIN_SECRET_BYTES} (a short one can be guessed from one recorded handshake)")
    return bytes(secret)


class TCPStore:
    """A key-value store for rendezvous. ``is_server=True`` (rank 0) also hosts it; values are bytes.

    ``timeout`` (seconds) bounds connecting and is the default for ``get``/``wait``/``barrier``. Binds only to
    ``host`` (pass ``"0.0.0.0"`` to listen on every interface); ``port=0`` on the server picks a free port,
    readable as ``.port``. ``secret`` (str or bytes, 16 bytes at least) is the job's, the same on every rank;
    None reads GPUCOLL_STORE_SECRET. ``rank`` registers this client as that rank of the job, so that its death
    is noticed (see the module's docstring). Safe to share between threads (one request at a time per store
    object).
    """

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: float = 300.0, secret=None,
                 rank: int | None = None, limits: Limits | None = None, like: TCPStore | None = None):
        if not isinstance(host, str):
            raise InvalidArgument(f"host must be a string (host name or IP address), got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be an integer in [0, 65535], got {port!r}")
        self.timeout = _timeout.check(timeout)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise InvalidArgument(f"rank must be a non-negative int or None, got {rank!r}")
        # like=: a store for the same job (a communicator made from another one), admitting the same members.
        self._auth_key = like._auth_key if like is not None else w.derive_key(job_secret(secret))
        self.host = host
        self.is_server = bool(is_server)
        self.rank = rank
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._server: Server | None = None
        if self.is_server:
            self._server = Server(host, port, self._auth_key, _warn, limits)
            self.port = self._server.address[1]
        else:
            if port == 0:
                raise InvalidArgument("port=0 is only valid for the server (is_server=True); a client needs the "
                                      "server's actual port")
            self.port = port
        try:
            with self._lock:
                self._connect()
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    # -- plumbing -----------------------------------------------------------------------------------------------

    def _op_timeout(self, timeout) -> float:
        return self.timeout if timeout is None else _timeout.check(timeout)

    def reachable_address(self) -> str:
        """An address other processes can reach this store at: the host it listens on or connects to, or for a
        server listening on every interface, this host's address."""
        if self.host in ("", "0.0.0.0", "::"):
            return socket.gethostbyname(socket.gethostname())
        return self.host

    def local_address(self) -> str:
        """This process's address on the network that reaches the store (the server's own listening address, or
        the local end of a client's connection): where a store this process serves for the same members should
        listen, reachable by them and nowhere wider."""
        if self._server is not None:
            return self.reachable_address()
        with self._lock:
            if self._sock is None:
                self._connect()
            return self._sock.getsockname()[0]

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bound_address(self):
        """The server's listening socket address (``getsockname()``); None on a client."""
        return None if self._server is None else self._server.address

    def _connect(self) -> None:
        # The server may start after its clients (rank 0 slower to boot): retry with backoff until the timeout.
        # So does a connection the server dropped before authentication for being busy (under attack).
        target = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(f"could not connect to the rendezvous store at {self.endpoint} within "
                                        f"{self.timeout:g} s (last error: {last}); is rank 0 running and "
                                        f"reachable at that address?", ranks=(0,))
            try:
                sock = socket.create_connection((target, self.port), timeout=min(remaining, 10.0))
            except OSError as e:  # refused, unreachable, DNS not ready yet: all worth retrying
                last = e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(min(max(deadline - time.monotonic(), 0.1), w._HANDSHAKE_TIMEOUT))
                self._handshake(sock)
                self._sock = sock
                if self.rank is not None:
                    self._register(sock)
                return
            except _Transient as e:
                sock.close()
                last = e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
            except BaseException:
                sock.close()
                self._sock = None
                raise

    def _handshake(self, sock: socket.socket) -> None:
        """Answers the server's challenge and checks its answer (_wire.py)."""
        try:
            hello = _recv_exact(sock, w.HELLO_BYTES)
            if len(hello) < w.HELLO_BYTES:
                raise _Transient("the server closed the connection before its challenge (busy?)")
            if hello[:4] != w.HELLO_MAGIC:
                raise InvalidArgument(f"{self.endpoint} is not a gpucoll rendezvous store of this version (it "
                                      f"opened with {hello[:8]!r})")
            server_nonce = hello[5:]
            nonce = secrets.token_bytes(w.NONCE_BYTES)
            sock.sendall(w.HELLO_MAGIC + nonce + w.client_mac(self._auth_key, server_nonce, nonce))
            verdict = _recv_exact(sock, 1 + w.MAC_BYTES)
        except (socket.timeout, OSError) as e:
            raise _Transient(f"authentication did not complete: {e}") from None
        if verdict[:1] == bytes([w.AUTH_DENIED]):
            raise SecretRefused(f"the rendezvous store at {self.endpoint} refused this rank: it does not hold "
                                  f"the same job secret (GPUCOLL_STORE_SECRET must be equal on every rank), or "
                                  f"another job's store listens on that port")
        if len(verdict) < 1 + w.MAC_BYTES or verdict[0] != w.AUTH_OK:
            raise _Transient("the server dropped the connection during authentication (busy?)")
        if not hmac.compare_digest(verdict[1:], w.server_mac(self._auth_key, server_nonce, nonce)):
            raise InvalidArgument(f"the server at {self.endpoint} does not know this job's secret: it is not this "
                                  f"job's rendezvous store")

    def _register(self, sock: socket.socket) -> None:
        frame = _Writer().u8(_OP_REGISTER).i32(self.rank).i64(os.getpid()).str(host_identity()).frame()
        try:
            sock.sendall(frame)
            header = _recv_exact(sock, _HEADER.size)
            if len(header) < _HEADER.size:
                raise _Transient("the server closed the connection during registration")
            payload = _recv_exact(sock, _HEADER.unpack(header)[1])
        except (socket.timeout, OSError) as e:
            raise _Transient(f"registration did not complete: {e}") from None
        if payload[:1] != b"\x00":
            raise RemoteError(f"the rendezvous store at {self.endpoint} refused rank {self.rank}'s registration")

    def _drop_connection(self) -> None:
        # After a timeout or error mid-reply the byte stream is out of step: discard it, reconnect next time.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _request(self, writer: _Writer, io_timeout: float, waiting_for: str = "", if_idle: bool = False):
        """The reply (a _Reader); with if_idle, None at once when another thread's request holds this client."""
        frame = writer.frame()
        if not self._lock.acquire(blocking=not if_idle):
            return None
        try:
            if self._closed:
                raise InvalidUsage(f"the rendezvous store client for {self.endpoint} is closed")
            if self._sock is None:
                self._connect()
            sock = self._sock
            try:
                sock.settimeout(io_timeout)
                sock.sendall(frame)
                header = _recv_exact(sock, _HEADER.size)
                if len(header) < _HEADER.size:
                    raise ConnectionError("connection closed by the server")
                magic, length = _HEADER.unpack(header)
                if magic != MAGIC or length > MAX_FRAME:
                    raise ConnectionError(f"malformed reply header {header!r}")
                payload = _recv_exact(sock, length)
                if len(payload) < length:
                    raise ConnectionError("connection closed by the server inside a reply")
            except socket.timeout:
                self._drop_connection()
                raise CollectiveTimeout(f"no reply from the rendezvous store at {self.endpoint} within "
                                        f"{io_timeout:g} s") from None
            except OSError as e:
                self._drop_connection()
                if self._closed:
                    raise InvalidUsage(f"the rendezvous store client for {self.endpoint} was closed while a "
                                       f"request was in flight") from None
                raise RemoteError(f"lost the connection to the rendezvous store at {self.endpoint} "
                                  f"(did rank 0, which serves it, exit?): {e}", ranks=(0,)) from None
        finally:
            self._lock.release()
        r = _Reader(payload)
        try:
            status = r.u8()
            if status == _ST_ERROR:
                cls, message = errors.error_class_for_code(r.u8()), r.str()
                raise cls(message)
            if status == _ST_LOST:
                lost = [(r.i32(), r.str()) for _ in range(r.u32())]
                why = "; ".join(f"rank {rank} left the job: {reason}" for rank, reason in lost)
                raise CollectiveTimeout(f"{why} (seen by the rendezvous store while this rank waited for "
                                        f"{waiting_for or 'a key'}){self._refused_note()}",
                                        ranks=tuple(rank for rank, _ in lost))
        except _ProtocolError as e:
            raise RemoteError(f"malformed reply from the rendezvous store at {self.endpoint}: {e}") from None
        r.status = status
        return r

    @staticmethod
    def _key(key, name: str = "key") -> str:
        if not isinstance(key, str):
            raise InvalidArgument(f"{name} must be a str, got {key!r} ({type(key).__name__})")
        try:
            key.encode("utf-8")  # keys travel as UTF-8: a lone surrogate has no encoding
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"{name} must be valid Unicode text (it travels as UTF-8), got {key!r}: "
                                  f"{e.reason} at index {e.start}") from None
        return key

    def _keys(self, keys) -> list[str]:
        if isinstance(keys, str):
            return [self._key(keys, "keys")]
        try:
            out = [self._key(k, "keys[]") for k in keys]
        except TypeError:
            raise InvalidArgument(f"keys must be a str or an iterable of str, got {keys!r}") from None
        if len(out) > w.MAX_KEYS:
            raise InvalidArgument(f"keys: {len(out)} keys in one call; the store takes at most {w.MAX_KEYS} "
                                  f"(split the call, or use a counter: add())")
        return out

    # -- API ------------------------------------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"value must be bytes (use set_json for other objects), got "
                                  f"{type(value).__name__}")
        self._request(_Writer().u8(_OP_SET).str(self._key(key)).blob(bytes(value)), self.timeout)

    def try_set(self, key: str, value: bytes) -> bool:
        """set(), unless another thread's request holds this client (a get or barrier that may wait for up to its
        timeout): then False at once, and nothing was sent. For a value that the next one replaces (the NCCL
        watchdog's progress count), whose writer must not stall behind a wait."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"value must be bytes, got {type(value).__name__}")
        return self._request(_Writer().u8(_OP_SET).str(self._key(key)).blob(bytes(value)), self.timeout,
                             if_idle=True) is not None

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until some rank sets it; CollectiveTimeout after ``timeout`` seconds."""
        key, t = self._key(key), self._op_timeout(timeout)
        r = self._request(_Writer().u8(_OP_GET).str(key).f64(t), t + _REPLY_GRACE, f"key {key!r}")
        if r.status == _ST_TIMEOUT:
            raise CollectiveTimeout(f"timed out after {t:g} s waiting for key {key!r} in the rendezvous store at "
                                    f"{self.endpoint}{self._refused_note()}")
        return r.blob()

    def _refused_note(self) -> str:
        """What the server knows of connections it refused for a wrong secret (_server.py, _note_refused)."""
        try:
            if not self.check(w.REFUSED_KEY):
                return ""
            raw = self.get(w.REFUSED_KEY, timeout=1.0).decode()
        except errors.GpucollError:
            return ""
        return (f"; meanwhile the store refused connections that did not hold this job's secret, from {raw} "
                f"(address=count): the ranks there hold another secret (nodes that do not share a home directory "
                f"make their own per-user secret file): {HOW_TO_SET_SECRET}")

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the counter ``key`` (created at 0) and return the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int) or not _INT64_MIN <= amount <= _INT64_MAX:
            raise InvalidArgument(f"amount must be an int64 integer, got {amount!r}")
        return self._request(_Writer().u8(_OP_ADD).str(self._key(key)).i64(amount), self.timeout).i64()

    def _present(self, keys: list[str]) -> list[bool]:
        out = []
        for i in range(0, len(keys), w.MAX_KEYS):  # a barrier's roll call may name more ranks than one request may
            flags = self._request(_Writer().u8(_OP_CHECK).strs(keys[i:i + w.MAX_KEYS]), self.timeout).blob()
            out += [bool(f) for f in flags]
        return out

    def check(self, keys) -> bool:
        """True when every key in ``keys`` (a str or an iterable of str) exists. Does not wait."""
        return all(self._present(self._keys(keys)))

    def lost(self) -> dict:
        """{rank: why} for the ranks the store saw leave the job (their process exited, or their connection closed
        for good), in the order it saw them go. Does not wait."""
        r = self._request(_Writer().u8(_OP_LOST), self.timeout)
        out = {}
        for _ in range(r.u32()):
            rank = r.i32()
            out[rank] = r.str()
        return out

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        return bool(self._request(_Writer().u8(_OP_DELETE).str(self._key(key)), self.timeout).u8())

    def wait(self, keys, timeout: float | None = None) -> None:
        """Block until every key exists; CollectiveTimeout naming the missing keys after ``timeout`` seconds."""
        keys, t = self._keys(keys), self._op_timeout(timeout)
        r = self._request(_Writer().u8(_OP_WAIT).f64(t).strs(keys), t + _REPLY_GRACE, f"keys {keys!r}")
        if r.status == _ST_TIMEOUT:
            missing = r.strs()
            raise CollectiveTimeout(f"timed out after {t:g} s waiting for keys {missing!r} in the rendezvous store "
                                    f"at {self.endpoint}")

    def barrier(self, name: str, world_size: int, timeout: float | None = None, rank: int | None = None):
        """Return once all ``world_size`` ranks called ``barrier(name, ...)``; every rank passes its ``rank``.

        Reusable: the n-th call of each rank joins generation n (derived from a shared counter). After a timeout
        the name is out of step across ranks; use a fresh name.
        """
        name = self._key(name, "name")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgument(f"world_size must be an integer >= 1, got {world_size!r}")
        if rank is None:
            raise InvalidArgument("rank is missing: barrier records who arrived, pass rank= (0 <= rank < world_size)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgument(f"rank must be an integer with 0 <= rank < world_size={world_size}, got {rank!r}")
        t = self._op_timeout(timeout)
        deadline = time.monotonic() + t
        base = f"{_BARRIER_PREFIX}{name}/"
        count = self.add(base + "count", 1)
        gen = (count - 1) // world_size
        self.set(f"{base}{gen}/arrived/{rank}", b"1")
        done = f"{base}{gen}/done"
        if count == (gen + 1) * world_size:
            self.set(done, b"1")
        remaining = max(deadline - time.monotonic(), 1e-3)
        r = self._request(_Writer().u8(_OP_WAIT).f64(remaining).strs([done]), remaining + _REPLY_GRACE,
                          f"barrier {name!r}")
        if r.status != _ST_TIMEOUT:
            return
        arrived = self._present([f"{base}{gen}/arrived/{i}" for i in range(world_size)])
        missing = [i for i, here in enumerate(arrived) if not here]
        shown = ", ".join(map(str, missing[:64])) + (", ..." if len(missing) > 64 else "")
        raise CollectiveTimeout(f"barrier {name!r} timed out after {t:g} s: {world_size - len(missing)} of "
                                f"{world_size} ranks arrived; missing ranks: [{shown}]", ranks=missing)

    def set_json(self, key: str, obj) -> None:
        self.set(key, json.dumps(obj, separators=(",", ":")).encode("utf-8"))

    def get_json(self, key: str, timeout: float | None = None):
        return json.loads(self.get(key, timeout).decode("utf-8"))

    def close(self, wait_for_others: float = 0.0) -> None:
        """Close the client connection and, on the server, stop its thread and listening socket. Idempotent.
        A registered rank says goodbye first, so that the server does not take its going for a death. On the server,
        `wait_for_others` > 0 keeps serving up to that many seconds while other registered ranks are still
        connected (a communicator's clean close: peers still leaving its last barrier need the server)."""
        self._close(failed=False, wait=wait_for_others)

    def abandon(self, world_size: int | None = None, linger: float = 5.0) -> None:
        """close() after an error of this rank's own during set-up: the other ranks, waiting for keys this rank
        will never set, learn it at once and name it. On the server, with `world_size`, it first keeps serving
        (at most `linger` seconds) until every rank has connected, so that late ones learn it too."""
        self._close(failed=True, linger=(world_size, min(linger, self.timeout)) if world_size else None)

    def _close(self, failed: bool, linger=None, wait: float = 0.0) -> None:
        if self._closed:
            return
        if wait > 0 and self._server is not None:
            self._server.wait_for_ranks_to_leave(self.rank, wait)
        sock = self._sock
        if sock is not None and self._lock.acquire(blocking=False):
            try:
                sock.settimeout(1.0)
                sock.sendall(_Writer().u8(_OP_BYE).u8(1 if failed else 0).frame())
            except OSError:
                pass
            finally:
                self._lock.release()
        if linger is not None and self._server is not None:
            self._server.linger(*linger)
        self._closed = True
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes another thread blocked in a request on this client
            except OSError:
                pass
        with self._lock:  # that thread now fails fast and releases the lock; only then close the fd
            self._drop_connection()
        if self._server is not None:
            self._server.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def server_stats(self) -> dict | None:
        """The server's connection and buffer counts (tests); None on a client."""
        return None if self._server is None else self._server.stats()

    def __enter__(self) -> TCPStore:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "server" if self.is_server else "client"
        return f"TCPStore({self.endpoint}, {role}{', closed' if self._closed else ''})"


class _Transient(Exception):
    """A connection attempt failed in a way worth retrying (server busy, not up yet)."""
