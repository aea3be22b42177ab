"""The rendezvous store's server: one thread, one event loop (epoll through ``selectors``) over every connection.

It lives in rank 0's process and must keep serving the job whatever else reaches its port, so every resource a
peer can make it spend is bounded:

* nothing is read from a connection that has not answered the challenge (_wire.py) with the job's secret but the
  fixed-size answer itself, within ``handshake_timeout``; a wrong magic (HTTP, a port scanner) is dropped at the
  fourth byte;
* at most ``max_pending`` connections may be unauthenticated at once: a new one evicts the oldest (a rank that
  answers in a round trip is never the oldest for long, an idle attacker always is), and ``max_conns`` bounds all
  of them (from the file-descriptor limit, so rank 0 keeps descriptors of its own);
* a frame must arrive whole within ``frame_timeout`` of its first byte (one byte every 20 s does not keep it
  open), at most ``MAX_FRAME`` long;
* what the server holds for its connections together (frames being received, replies not yet sent, parked
  requests' keys) stays under ``max_buffered``. When it would pass, the connection holding the most pays: it is
  dropped, or, if it is the one asking, refused with an error reply. A reply carries a stored value by reference
  (one copy however many ranks read it), and one request names at most ``MAX_KEYS`` keys.

Blocking requests (``get``, ``wait``) park the connection, not a thread. Ranks register on their connection
(``_OP_REGISTER``); a registered rank whose last connection closes without a goodbye is *lost* once there is
evidence: its process is gone (same kernel and pid namespace: checked at once), or it has not come back within
``lost_grace`` (another host). Every parked request, and every later one that would have to wait, is then
answered ``_ST_LOST`` naming it, so a rank killed during rendezvous is named in milliseconds, not after the
timeout.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import math
import re
import secrets
import selectors
import socket
import threading
import time

from gpucoll import errors
from gpucoll.bootstrap import _wire as w
from gpucoll.bootstrap._conn import Conn, Limits
from gpucoll.bootstrap._liveness import Members
from gpucoll.bootstrap._waits import Waiter, Waits
from gpucoll.errors import RemoteError

_COUNTER = re.compile(rb"-?[0-9]{1,19}")  # what add() stores: ASCII decimal, nothing int() would also forgive


# epoll sleeps at most INT_MAX ms (24.8 days) and raises OverflowError beyond: the loop wakes at least this often.
_MAX_SLEEP = 3600.0


class Server:
    """The store's data and its event loop; ``close()`` stops it. Used by TCPStore(is_server=True)."""

    def __init__(self, host: str, port: int, key: bytes, warn, limits: Limits | None = None):
        self._key, self._warn = key, warn
        self.limits = limits or Limits()
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as e:
            raise errors.InvalidArgument(f"host={host!r} cannot be resolved to an address to bind: {e}") from None
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
        self._lsock.setblocking(False)
        self.address = self._lsock.getsockname()
        self._data: dict = {}
        self._refused: dict = {}  # address -> connections refused for a wrong secret (_note_refused)
        self._conns: set = set()
        self._pending: dict = {}  # unauthenticated connections, oldest first (dicts keep insertion order)
        self._receiving: set = set()  # connections in the middle of a frame
        self._waits = Waits(self._data)
        self._pinned: dict = {}  # id(value) -> [value, replies holding it]: stored values in flight, counted once
        self._members = Members(self.limits.lost_grace)
        self._lost = self._members.lost  # rank -> why
        self._buffered = 0
        self._warned: dict = {}  # message kind -> (last time, warnings skipped since): the rate limit
        self._dropped: dict = {}  # kind -> connections dropped for it
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"gpucoll-store:{self.address[1]}", daemon=True)
        self._thread.start()

    # -- observability (tests) ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"conns": len(self._conns), "pending": len(self._pending), "buffered": self._buffered,
                "keys": len(self._data), "lost": dict(self._lost), "dropped": dict(self._dropped)}

    # -- the loop -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._on_readable(conn)
                self._on_timers()
        except Exception as e:  # noqa: BLE001 - a bug must be reported, not kill the job silently
            self._warn(f"rendezvous store: the server loop failed: {type(e).__name__}: {e}")
        finally:
            self._shutdown()

    def _next_timeout(self) -> float:
        timeout = _MAX_SLEEP
        deadline = self._waits.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        if self._pending or self._receiving or self._members.suspects:
            timeout = min(timeout, 0.02)
        return timeout

    def _on_timers(self) -> None:
        now = time.monotonic()
        for waiter in self._waits.expired(now):
            if not waiter.done:  # an earlier one's reply may have closed its connection
                self._finish(waiter, self._timeout_reply(waiter))
        for conn in [c for c in self._pending if now - c.since > self.limits.handshake_timeout]:
            self._drop(conn, f"no authentication within {self.limits.handshake_timeout:g} s", "slow")
        for conn in [c for c in self._receiving if now - c.frame_since > self.limits.frame_timeout]:
            self._drop(conn, f"a frame did not arrive whole within {self.limits.frame_timeout:g} s", "slow")
        if self._members.suspects:
            self._judge_suspects(now)

    # -- connections ----------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections must not starve the established ones
            try:
                sock, peer = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ECONNABORTED...: keep serving the others
                self._warn_limited("accept", f"rendezvous store: accept() failed: {e}")
                if self._pending:
                    self._drop(next(iter(self._pending)), "evicted to free a descriptor", "evict", w.AUTH_BUSY)
                return
            if self._pending and (len(self._pending) >= self.limits.max_pending
                                  or len(self._conns) >= self.limits.max_conns):
                self._drop(next(iter(self._pending)), "evicted by a newer unauthenticated connection", "evict",
                           w.AUTH_BUSY)
            if len(self._conns) >= self.limits.max_conns:
                self._warn_limited("full", f"rendezvous store: refusing {peer}: {len(self._conns)} connections open")
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock, peer, secrets.token_bytes(w.NONCE_BYTES), time.monotonic())
            self._conns.add(conn)
            self._pending[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, w.HELLO_MAGIC + bytes([w.PROTOCOL_VERSION]) + conn.nonce)

    def _on_readable(self, conn: Conn) -> None:
        room = w.RESPONSE_BYTES - len(conn.rbuf) if not conn.authed else 1 << 20
        try:
            data = conn.sock.recv(room)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._close(conn, f"connection error: {e}")
            return
        if not data:
            partial = bool(conn.rbuf) and conn.authed
            self._close(conn, "closed inside a frame" if partial else None)
            return
        if not conn.authed:
            self._handshake(conn, data)
            return
        if self._make_room(conn, len(data)):
            self._drop(conn, f"the store's buffers would exceed {self.limits.max_buffered} bytes", "memory")
            return
        if not conn.rbuf:
            conn.frame_since = time.monotonic()
            self._receiving.add(conn)
        conn.rbuf += data
        self._buffered += len(data)
        self._take_frames(conn)

    def _handshake(self, conn: Conn, data: bytes) -> None:
        conn.rbuf += data
        head = bytes(conn.rbuf[:len(w.HELLO_MAGIC)])
        if head != w.HELLO_MAGIC[:len(head)]:
            self._drop(conn, f"bad magic {head!r} (not a gpucoll client?)", "magic")
            return
        if len(conn.rbuf) < w.RESPONSE_BYTES:
            return
        nonce = bytes(conn.rbuf[4:4 + w.NONCE_BYTES])
        mac = bytes(conn.rbuf[4 + w.NONCE_BYTES:])
        conn.rbuf.clear()
        if not hmac.compare_digest(mac, w.client_mac(self._key, conn.nonce, nonce)):
            self._drop(conn, "authentication failed (it does not know this job's secret)", "auth", w.AUTH_DENIED)
            return
        conn.authed = True
        del self._pending[conn]
        self._send(conn, bytes([w.AUTH_OK]) + w.server_mac(self._key, conn.nonce, nonce))

    def _take_frames(self, conn: Conn) -> None:
        buf = conn.rbuf
        while conn.waiter is None and not conn.closed and len(buf) >= w._HEADER.size:
            magic, length = w._HEADER.unpack_from(buf)
            if magic != w.MAGIC:
                self._drop(conn, f"bad frame magic {bytes(magic)!r}", "magic")
                return
            if length > w.MAX_FRAME:
                self._drop(conn, f"frame length {length} exceeds {w.MAX_FRAME}", "frame")
                return
            end = w._HEADER.size + length
            if len(buf) < end:
                return
            payload = bytes(buf[w._HEADER.size:end])
            del buf[:end]
            self._buffered -= end
            if buf:
                conn.frame_since = time.monotonic()
            else:
                self._receiving.discard(conn)
            try:
                reply = self._dispatch(conn, payload)
            except w._ProtocolError as e:
                self._drop(conn, f"undecodable command: {e}", "protocol")
                return
            if reply is not None:
                self._send(conn, reply)
        if conn.waiter is not None:
            self._receiving.discard(conn)  # what follows a parked request waits; its deadline starts later

    @staticmethod
    def _held(conn: Conn) -> int:
        return len(conn.rbuf) + conn.wlen + (conn.waiter.cost if conn.waiter is not None else 0)

    def _make_room(self, conn: Conn, extra: int) -> bool:
        """Makes room for `extra` more bytes held for `conn` under the cap by dropping whichever other connections
        hold more than `conn` would; True when `conn` itself holds the most (the caller refuses it). The ranks whose
        small requests arrive while another connection fills the store never pay for it."""
        while self._buffered + extra > self.limits.max_buffered:
            hog = max((c for c in self._conns if c.authed and c is not conn), key=self._held, default=None)
            if hog is None or self._held(hog) <= self._held(conn) + extra:
                return True
            self._drop(hog, f"the store's buffers would exceed {self.limits.max_buffered} bytes, and this "
                            f"connection held the most ({self._held(hog)} bytes)", "memory")
        return False

    def _send(self, conn: Conn, reply) -> None:
        """Queues `reply` (bytes, or (head, stored value) for a reply that carries a value) and sends what it can."""
        head, value = (reply, None) if isinstance(reply, bytes) else reply
        size = len(head) + (len(value) if value is not None else 0)
        if conn.wlen + size > w.MAX_FRAME + (1 << 20):
            self._drop(conn, "it does not read its replies", "memory")
            return
        extra = len(head) + (len(value) if value is not None and id(value) not in self._pinned else 0)
        if self._make_room(conn, extra) and value is not None:
            head, value = self._error(errors.InvalidUsage, (
                f"the rendezvous store cannot send this {len(value)}-byte value now: replies and requests it holds "
                f"would pass its cap of {self.limits.max_buffered} bytes. Store values are rendezvous data: keep "
                f"them small")), None
        conn.wq.append([memoryview(head), None])
        conn.wlen += len(head)
        self._buffered += len(head)
        if value is not None:
            pin = self._pinned.setdefault(id(value), [value, 0])
            if pin[1] == 0:
                self._buffered += len(value)
            pin[1] += 1
            conn.wq.append([memoryview(value), value])
            conn.wlen += len(value)
        self._flush(conn)

    def _unpin(self, value: bytes) -> None:
        pin = self._pinned[id(value)]
        pin[1] -= 1
        if pin[1] == 0:
            del self._pinned[id(value)]
            self._buffered -= len(value)

    def _flush(self, conn: Conn) -> None:
        while conn.wq:
            chunk = conn.wq[0]
            view, value = chunk
            try:
                sent = conn.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._close(conn, f"connection error: {e}")
                return
            conn.wlen -= sent
            if value is None:
                self._buffered -= sent
            if sent < len(view):
                chunk[0] = view[sent:]
                break
            conn.wq.popleft()
            if value is not None:
                self._unpin(value)
        writing = bool(conn.wq)
        if writing != conn.writing:
            conn.writing = writing
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            self._sel.modify(conn.sock, events, conn)

    def _drop(self, conn: Conn, why: str, kind: str, verdict: int | None = None) -> None:
        self._dropped[kind] = self._dropped.get(kind, 0) + 1
        if kind == "auth" and isinstance(conn.peer, tuple):
            self._note_refused(str(conn.peer[0]))
        message = f"rendezvous store: dropping {conn.peer}: {why}"
        if conn.authed:
            self._warn(message)  # a member's mistake: each one is worth seeing
        else:
            self._warn_limited(kind, message)
        if verdict is not None:
            with contextlib.suppress(OSError):
                conn.sock.send(bytes([verdict]))
        self._close(conn, None, dropped=True)

    def _close(self, conn: Conn, why: str | None, dropped: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        if why is not None and conn.authed and not conn.clean:
            self._warn_limited("closed", f"rendezvous store: connection from {conn.peer}: {why}")
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        self._receiving.discard(conn)
        self._buffered -= len(conn.rbuf) if conn.authed else 0
        for view, value in conn.wq:
            if value is None:
                self._buffered -= len(view)
            else:
                self._unpin(value)
        conn.rbuf, conn.wq, conn.wlen = bytearray(), collections.deque(), 0
        if conn.waiter is not None:
            self._unpark(conn.waiter)
            conn.waiter = None
        if conn.rank is not None:
            for rank, reason in self._members.closed(conn, time.monotonic(), serving=not self._closed):
                self._mark_lost(rank, reason)

    # -- liveness ---------------------------------------------------------------------------------------------------
    def _judge_suspects(self, now: float) -> None:
        for rank, why in self._members.judge(now):
            self._mark_lost(rank, why)

    def _mark_lost(self, rank: int, why: str) -> None:
        self._lost[rank] = why
        for waiter in self._waits.parked():
            if not waiter.done:
                self._finish(waiter, self._tell_lost(waiter.conn))

    def _tell_lost(self, conn: Conn) -> bytes:
        if conn.rank is not None:
            self._members.told.add(conn.rank)
        return self._lost_reply()

    def _lost_reply(self) -> bytes:
        out = w._Writer().u8(w._ST_LOST).u32(len(self._lost))
        for rank, why in self._lost.items():  # in the order they were lost: the first is the root cause
            out.i32(rank).str(why)
        return out.frame()

    def _note_refused(self, address: str) -> None:
        """Where connections without this job's secret came from, readable by members under REFUSED_KEY: a rank
        that waits in vain for a key can then say that ranks on that machine were turned away (another secret: nodes
        that do not share a home directory) instead of only that the key never came. A few addresses at most."""
        seen = self._refused
        if address in seen or len(seen) < 8:
            seen[address] = seen.get(address, 0) + 1
            self._data[w.REFUSED_KEY] = ",".join(f"{a}={n}" for a, n in seen.items()).encode()

    # -- commands -----------------------------------------------------------------------------------------------------
    def _dispatch(self, conn: Conn, payload: bytes) -> bytes | None:
        r = w._Reader(payload)
        op = r.u8()
        out = w._Writer()
        data = self._data
        if op == w._OP_SET:
            key, value = r.str(), r.blob()
            r.end()
            data[key] = value
            self._wake(key)
            out.u8(w._ST_OK)
        elif op == w._OP_GET:
            key, timeout = r.str(), self._timeout(r)
            r.end()
            if key in data:
                return self._value_reply(data[key])
            return self._park(conn, w._OP_GET, [key], timeout)
        elif op == w._OP_ADD:
            key, amount = r.str(), r.i64()
            r.end()
            old = data.get(key, b"0")
            if not _COUNTER.fullmatch(old):  # int() would also take " 7 " and "1_000"
                return self._error(errors.InvalidArgument, f"add: key {key!r} holds a value that is not a counter "
                                                           f"(a decimal integer): {old[:32]!r}")
            new = int(old) + amount
            if not w._INT64_MIN <= new <= w._INT64_MAX:
                return self._error(errors.InvalidArgument, f"add: counter {key!r} would overflow int64")
            # Counters are stored as ASCII decimal (as torch's TCPStore does), so get() reads them too.
            data[key] = str(new).encode("ascii")
            self._wake(key)
            out.u8(w._ST_OK).i64(new)
        elif op == w._OP_CHECK:
            keys = r.strs(w.MAX_KEYS)
            r.end()
            out.u8(w._ST_OK).blob(bytes(1 if k in data else 0 for k in keys))
        elif op == w._OP_DELETE:
            key = r.str()
            r.end()
            out.u8(w._ST_OK).u8(1 if data.pop(key, None) is not None else 0)
        elif op == w._OP_WAIT:
            timeout, keys = self._timeout(r), r.strs(w.MAX_KEYS)
            r.end()
            if all(k in data for k in keys):
                return out.u8(w._ST_OK).frame()
            return self._park(conn, w._OP_WAIT, keys, timeout)
        elif op == w._OP_REGISTER:
            rank, pid, identity = r.i32(), r.i64(), r.str()
            r.end()
            if rank < 0 or not 0 < pid < 2**31:
                raise w._ProtocolError(f"register: rank {rank}, pid {pid}")
            self._members.register(conn, rank, pid, identity)
            out.u8(w._ST_OK)
        elif op == w._OP_BYE:
            failed = r.u8()
            r.end()
            conn.clean = True
            if failed and conn.rank is not None and not self._lost:  # else its error is a consequence
                self._mark_lost(conn.rank, "it gave up after an error of its own")
            return None
        elif op == w._OP_LOST:
            r.end()
            out.u8(w._ST_OK).u32(len(self._lost))
            for rank, why in self._lost.items():
                out.i32(rank).str(why)
        else:
            raise w._ProtocolError(f"unknown opcode {op}")
        return out.frame()

    def _park(self, conn: Conn, op: int, keys: list, timeout: float) -> bytes | None:
        if self._lost:
            return self._tell_lost(conn)  # whoever would set the key may be the rank that is gone
        missing = {k for k in keys if k not in self._data}
        # What a parked request holds: its keys (counted with CPython's per-object overhead) and its index entries.
        cost = sum(len(k) for k in keys) + 160 * len(keys)
        if self._make_room(conn, cost):
            return self._error(errors.InvalidUsage, f"the rendezvous store cannot park a wait on {len(keys)} keys "
                                                    f"now: it would pass its cap of {self.limits.max_buffered} bytes")
        waiter = Waiter(conn, op, keys, time.monotonic() + timeout, missing, cost)
        conn.waiter = waiter
        self._buffered += cost
        self._waits.park(waiter, compact_above=1024 + 4 * len(self._conns))
        return None

    def _wake(self, key: str) -> None:
        for waiter in self._waits.completed_by(key):
            if not waiter.done:  # finishing one may have closed another's connection
                ok = self._value_reply(self._data[key]) if waiter.op == w._OP_GET else w._Writer().u8(w._ST_OK).frame()
                self._finish(waiter, ok)

    def _unpark(self, waiter: Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self._buffered -= waiter.cost
        self._waits.forget(waiter)

    def _finish(self, waiter: Waiter, reply: bytes) -> None:
        self._unpark(waiter)
        conn = waiter.conn
        if conn.closed:
            return
        conn.waiter = None
        self._send(conn, reply)
        if conn.rbuf and not conn.closed:
            conn.frame_since = time.monotonic()
            self._receiving.add(conn)
            self._take_frames(conn)

    def _timeout_reply(self, waiter: Waiter) -> bytes:
        out = w._Writer().u8(w._ST_TIMEOUT)
        if waiter.op == w._OP_WAIT:
            out.strs([k for k in waiter.keys if k not in self._data])
        return out.frame()

    @staticmethod
    def _timeout(r: w._Reader) -> float:
        t = r.f64()
        if math.isnan(t):
            raise w._ProtocolError("timeout is NaN")
        return min(max(t, 0.0), 1e7)  # about 4 months: a deadline the heap can hold

    @staticmethod
    def _value_reply(value: bytes):
        # The value travels by reference (see _send): OK | u32 length, then the stored bytes object itself.
        return w._HEADER.pack(w.MAGIC, 5 + len(value)) + bytes([w._ST_OK]) + len(value).to_bytes(4, "big"), value

    @staticmethod
    def _error(exc_type, message: str) -> bytes:
        return w._Writer().u8(w._ST_ERROR).u8(exc_type.code).str(message).frame()

    def _warn_limited(self, kind: str, message: str) -> None:
        # An attack makes thousands of the same warning: one per kind per second is enough to see it.
        now = time.monotonic()
        last, skipped = self._warned.get(kind, (-math.inf, 0))
        if now - last < 1.0:
            self._warned[kind] = (last, skipped + 1)
            return
        self._warned[kind] = (now, 0)
        self._warn(message + (f" ({skipped} more like it in the last second)" if skipped else ""))

    # -- shutdown -------------------------------------------------------------------------------------------------
    def linger(self, world_size: int, seconds: float) -> None:
        """Keeps serving, at most `seconds`, until every rank of [0, world_size) is lost, has been told who was, or
        has gone: a rank that is slow to connect or to ask still learns why the job failed (who was lost),
        instead of finding nobody listening."""
        self._serve_until(seconds, lambda: set(range(world_size)) <= self._members.told | set(self._lost))

    def wait_for_ranks_to_leave(self, own: int | None, seconds: float) -> None:
        """Keeps serving, at most `seconds`, while a registered rank other than `own` still has a connection: a
        rank that came through the last barrier behind this one may still have a request on its way (the barrier's
        last arrival leaves at once; the others still wait for its 'done' key), and closing now would cut it off."""
        self._serve_until(seconds, lambda: all(r == own for r in list(self._members.live)))

    def _serve_until(self, seconds: float, done) -> None:
        # `done` reads the server thread's state without its lock: a dict changing size under list() is retried.
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._closed and self._thread.is_alive():
            try:
                if done():
                    return
            except RuntimeError:
                pass
            time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _shutdown(self) -> None:
        # Parked requests are answered (their ranks learn at once), then every connection closes.
        closed = w._Writer().u8(w._ST_ERROR).u8(RemoteError.code).str(
            "the rendezvous store server (rank 0) shut down while this request waited").frame()
        for waiter in self._waits.parked():
            if not waiter.done and not waiter.conn.closed:
                waiter.done = True
                with contextlib.suppress(OSError):
                    waiter.conn.sock.send(closed)
        for conn in list(self._conns):
            conn.clean = True
            self._close(conn, None)
        for sock in (self._lsock, self._wake_r, self._wake_w):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)
            sock.close()
        self._sel.close()

