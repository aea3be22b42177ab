"""Rendezvous key-value store over TCP: rank 0 hosts it, every rank (rank 0 included) is a client.

Wire protocol. Every frame, either way, is ``MAGIC (4 bytes) | payload length (u32, big-endian) | payload``.
A request payload is ``opcode (u8)`` followed by its fields; a reply payload is ``status (u8)`` followed by
fields. Strings and byte strings are ``u32 length | bytes`` (strings UTF-8). The magic lets the server tell a
gpucoll client from a port scanner or a stray HTTP request, and the length cap (``MAX_FRAME``) stops a peer from
making the server buffer gigabytes: such connections are dropped with a warning and the server keeps serving.

Blocking operations (``get``, ``wait``) wait server-side on a condition variable with the caller's timeout, so a
waiting rank costs one idle thread and no network traffic. The server runs one daemon thread per connection,
which suits a rendezvous (one connection per rank, short-lived traffic).
"""

from __future__ import annotations

import json
import math
import selectors
import socket
import sys
import threading
import time

from gpucoll import errors
from gpucoll.bootstrap._wire import (
    _FRAME_TIMEOUT,
    _HEADER,
    _INT64_MAX,
    _INT64_MIN,
    _OP_ADD,
    _OP_CHECK,
    _OP_DELETE,
    _OP_GET,
    _OP_SET,
    _OP_WAIT,
    _REPLY_GRACE,
    _ST_ERROR,
    _ST_OK,
    _ST_TIMEOUT,
    MAGIC,
    MAX_FRAME,
    _ProtocolError,
    _Reader,
    _recv_exact,
    _Writer,
)
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage, RemoteError

__all__ = ["MAGIC", "MAX_FRAME", "TCPStore"]

_BARRIER_PREFIX = "__gpucoll_barrier__/"


def _warn(message: str) -> None:
    # Logging must never take a server thread down (e.g. gpucoll._C unavailable during a rebuild).
    try:
        from gpucoll import _log

        _log.warn(message)
    except Exception:  # noqa: BLE001 - a warning must never raise
        sys.stderr.write(f"[gpucoll] WARN  {message}\n")


class _Server:
    """The store's data and its listening thread. Lives in rank 0's process."""

    def __init__(self, host: str, port: int):
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as e:
            raise InvalidArgument(f"host={host!r} cannot be resolved to an address to bind: {e}") from None
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR: a restarted job can take the port back while old connections sit in TIME_WAIT.
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind(sockaddr)
            self._lsock.listen(socket.SOMAXCONN)
        except OSError as e:
            self._lsock.close()
            raise errors.SystemError(f"cannot listen on {host}:{port} for the rendezvous store: {e.strerror or e} "
                                     f"(errno {e.errno})", call=f"bind({sockaddr!r})") from None
        self.address = self._lsock.getsockname()
        self._data = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns = set()
        self._threads = []
        self._conns_lock = threading.Lock()
        # The accept thread sleeps in select() on the listening socket and this pair: close() writes one byte to
        # wake it, so there is no polling interval and close() returns at once.
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"gpucoll-store:{self.address[1]}",
                                               daemon=True)
        self._accept_thread.start()

    # -- connection handling ------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._lsock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                ready = [key.fileobj for key, _ in sel.select()]
                if self._wake_r in ready or self._closed:
                    return
                try:
                    conn, peer = self._lsock.accept()
                except OSError as e:  # EMFILE, ECONNABORTED...: keep serving the others
                    _warn(f"rendezvous store: accept() failed: {e}")
                    time.sleep(0.05)
                    continue
                t = threading.Thread(target=self._serve_conn, args=(conn, peer), daemon=True,
                                     name=f"gpucoll-store-conn:{peer}")
                with self._conns_lock:
                    self._conns.add(conn)
                    self._threads = [x for x in self._threads if x.is_alive()]
                    self._threads.append(t)
                t.start()

    def _serve_conn(self, conn: socket.socket, peer) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                conn.settimeout(None)  # idle between frames is normal: ranks keep their connection for the job
                first = conn.recv(1)
                if not first:
                    return  # clean close at a frame boundary
                conn.settimeout(_FRAME_TIMEOUT)
                header = first + _recv_exact(conn, _HEADER.size - 1)
                if len(header) < _HEADER.size:
                    _warn(f"rendezvous store: dropping {peer}: connection closed inside a frame header")
                    return
                magic, length = _HEADER.unpack(header)
                if magic != MAGIC:
                    _warn(f"rendezvous store: dropping {peer}: bad magic {magic!r} (not a gpucoll client?)")
                    return
                if length > MAX_FRAME:
                    _warn(f"rendezvous store: dropping {peer}: frame length {length} exceeds {MAX_FRAME}")
                    return
                payload = _recv_exact(conn, length)
                if len(payload) < length:
                    _warn(f"rendezvous store: dropping {peer}: connection closed after {len(payload)} of "
                          f"{length} payload bytes")
                    return
                try:
                    reply = self._dispatch(payload)
                except _ProtocolError as e:
                    _warn(f"rendezvous store: dropping {peer}: undecodable command: {e}")
                    return
                conn.sendall(reply)
        except socket.timeout:
            _warn(f"rendezvous store: dropping {peer}: stalled for {_FRAME_TIMEOUT:g} s inside a frame")
        except OSError as e:
            if not self._closed:
                _warn(f"rendezvous store: connection from {peer} failed: {e}")
        except Exception as e:  # noqa: BLE001 - a bug here must cost one connection, never the server
            _warn(f"rendezvous store: dropping {peer} after an internal error: {type(e).__name__}: {e}")
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    # -- commands -------------------------------------------------------------------------------------------------

    def _dispatch(self, payload: bytes) -> bytes:
        r = _Reader(payload)
        op = r.u8()
        w = _Writer()
        if op == _OP_SET:
            key, value = r.str(), r.blob()
            r.end()
            with self._cond:
                self._data[key] = value
                self._cond.notify_all()
            w.u8(_ST_OK)
        elif op == _OP_GET:
            key, timeout = r.str(), self._timeout(r)
            r.end()
            with self._cond:
                self._cond.wait_for(lambda: key in self._data or self._closed, timeout)
                value = self._data.get(key)
            if value is not None:
                w.u8(_ST_OK).blob(value)
            elif self._closed:
                return self._closed_reply()
            else:
                w.u8(_ST_TIMEOUT)
        elif op == _OP_ADD:
            key, amount = r.str(), r.i64()
            r.end()
            with self._cond:
                old = self._data.get(key, b"0")
                try:
                    new = int(old.decode("ascii")) + amount
                except (UnicodeDecodeError, ValueError):
                    return self._error(errors.InvalidArgument, f"add: key {key!r} holds a value that is not a counter")
                if not _INT64_MIN <= new <= _INT64_MAX:
                    return self._error(errors.InvalidArgument, f"add: counter {key!r} would overflow int64")
                # Counters are stored as ASCII decimal (as torch's TCPStore does), so get() reads them too.
                self._data[key] = str(new).encode("ascii")
                self._cond.notify_all()
            w.u8(_ST_OK).i64(new)
        elif op == _OP_CHECK:
            keys = r.strs()
            r.end()
            with self._cond:
                present = bytes(1 if k in self._data else 0 for k in keys)
            w.u8(_ST_OK).blob(present)
        elif op == _OP_DELETE:
            key = r.str()
            r.end()
            with self._cond:
                existed = self._data.pop(key, None) is not None
            w.u8(_ST_OK).u8(1 if existed else 0)
        elif op == _OP_WAIT:
            timeout, keys = self._timeout(r), r.strs()
            r.end()
            with self._cond:
                self._cond.wait_for(lambda: self._closed or all(k in self._data for k in keys), timeout)
                missing = [k for k in keys if k not in self._data]
            if not missing:
                w.u8(_ST_OK)
            elif self._closed:
                return self._closed_reply()
            else:
                w.u8(_ST_TIMEOUT).strs(missing)
        else:
            raise _ProtocolError(f"unknown opcode {op}")
        return w.frame()

    @staticmethod
    def _timeout(r: _Reader) -> float:
        t = r.f64()
        if math.isnan(t):
            raise _ProtocolError("timeout is NaN")
        return min(max(t, 0.0), threading.TIMEOUT_MAX)  # Condition.wait rejects values above TIMEOUT_MAX

    @staticmethod
    def _error(exc_type, message: str) -> bytes:
        return _Writer().u8(_ST_ERROR).u8(exc_type.code).str(message).frame()

    def _closed_reply(self) -> bytes:
        return self._error(RemoteError, "the rendezvous store server (rank 0) shut down while this request waited")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # wake blocked get/wait handlers so they answer and exit
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._accept_thread.join(timeout=5.0)
        self._lsock.close()
        self._wake_r.close()
        self._wake_w.close()
        # Handler threads block in recv() on idle client connections; shutting the sockets down wakes them.
        with self._conns_lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


class TCPStore:
    """A key-value store for rendezvous. ``is_server=True`` (rank 0) also hosts it; values are bytes.

    ``timeout`` (seconds) bounds connecting and is the default for ``get``/``wait``/``barrier``. Binds only to
    ``host`` (pass ``"0.0.0.0"`` to listen on every interface); ``port=0`` on the server picks a free port,
    readable as ``.port``. Safe to share between threads (one request at a time per store object).
    """

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: float = 300.0):
        if not isinstance(host, str):
            raise InvalidArgument(f"host must be a string (host name or IP address), got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be an integer in [0, 65535], got {port!r}")
        self.timeout = self._check_timeout(timeout, "timeout")
        self.host = host
        self.is_server = bool(is_server)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._server: _Server | None = None
        if self.is_server:
            self._server = _Server(host, port)
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

    @staticmethod
    def _check_timeout(timeout, name: str) -> float:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
                or math.isinf(timeout):
            raise InvalidArgument(f"{name} must be a positive, finite number of seconds, got {timeout!r}")
        return float(timeout)

    def _op_timeout(self, timeout) -> float:
        return self.timeout if timeout is None else self._check_timeout(timeout, "timeout")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bound_address(self):
        """The server's listening socket address (``getsockname()``); None on a client."""
        return None if self._server is None else self._server.address

    def _connect(self) -> None:
        # The server may start after its clients (rank 0 slower to boot): retry with backoff until the timeout.
        target = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(f"could not connect to the rendezvous store at {self.endpoint} within "
                                        f"{self.timeout:g} s (last error: {last}); is rank 0 running and "
                                        f"reachable at that address?")
            try:
                sock = socket.create_connection((target, self.port), timeout=min(remaining, 10.0))
            except OSError as e:  # refused, unreachable, DNS not ready yet: all worth retrying
                last = e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            return

    def _drop_connection(self) -> None:
        # After a timeout or error mid-reply the byte stream is out of step: discard it, reconnect next time.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _request(self, w: _Writer, io_timeout: float) -> _Reader:
        frame = w.frame()
        with self._lock:
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
                                  f"(did rank 0 exit?): {e}") from None
        r = _Reader(payload)
        try:
            status = r.u8()
            if status == _ST_ERROR:
                cls, message = errors.error_class_for_code(r.u8()), r.str()
                raise cls(message)
        except _ProtocolError as e:
            raise RemoteError(f"malformed reply from the rendezvous store at {self.endpoint}: {e}") from None
        r.status = status
        return r

    @staticmethod
    def _key(key, name: str = "key") -> str:
        if not isinstance(key, str):
            raise InvalidArgument(f"{name} must be a str, got {key!r} ({type(key).__name__})")
        return key

    def _keys(self, keys) -> list[str]:
        if isinstance(keys, str):
            return [keys]
        try:
            return [self._key(k, "keys[]") for k in keys]
        except TypeError:
            raise InvalidArgument(f"keys must be a str or an iterable of str, got {keys!r}") from None

    # -- API ------------------------------------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"value must be bytes (use set_json for other objects), got "
                                  f"{type(value).__name__}")
        self._request(_Writer().u8(_OP_SET).str(self._key(key)).blob(bytes(value)), self.timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until some rank sets it; CollectiveTimeout after ``timeout`` seconds."""
        key, t = self._key(key), self._op_timeout(timeout)
        r = self._request(_Writer().u8(_OP_GET).str(key).f64(t), t + _REPLY_GRACE)
        if r.status == _ST_TIMEOUT:
            raise CollectiveTimeout(f"timed out after {t:g} s waiting for key {key!r} in the rendezvous store at "
                                    f"{self.endpoint}")
        return r.blob()

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the counter ``key`` (created at 0) and return the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int) or not _INT64_MIN <= amount <= _INT64_MAX:
            raise InvalidArgument(f"amount must be an int64 integer, got {amount!r}")
        return self._request(_Writer().u8(_OP_ADD).str(self._key(key)).i64(amount), self.timeout).i64()

    def _present(self, keys: list[str]) -> list[bool]:
        flags = self._request(_Writer().u8(_OP_CHECK).strs(keys), self.timeout).blob()
        return [bool(f) for f in flags]

    def check(self, keys) -> bool:
        """True when every key in ``keys`` (a str or an iterable of str) exists. Does not wait."""
        return all(self._present(self._keys(keys)))

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        return bool(self._request(_Writer().u8(_OP_DELETE).str(self._key(key)), self.timeout).u8())

    def wait(self, keys, timeout: float | None = None) -> None:
        """Block until every key exists; CollectiveTimeout naming the missing keys after ``timeout`` seconds."""
        keys, t = self._keys(keys), self._op_timeout(timeout)
        r = self._request(_Writer().u8(_OP_WAIT).f64(t).strs(keys), t + _REPLY_GRACE)
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
        r = self._request(_Writer().u8(_OP_WAIT).f64(remaining).strs([done]), remaining + _REPLY_GRACE)
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

    def close(self) -> None:
        """Close the client connection and, on the server, stop its thread and listening socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
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

    def __enter__(self) -> TCPStore:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "server" if self.is_server else "client"
        return f"TCPStore({self.endpoint}, {role}{', closed' if self._closed else ''})"
