"""The rendezvous store's bounds hold for its own job: a timeout of any length the API takes, a memory cap that the
connection causing the pressure pays for, keys per request, strict counters and keys that must encode.

Each test here failed before its fix (issue 27, items 1-4): the loop died of an OverflowError on a month-long
timeout; five readers of a large value got a sixth rank's small request dropped; one WAIT frame of 4 M keys grew
the server by 2 GB; ``" 7 "`` counted as a counter and a lone surrogate raised UnicodeEncodeError.
"""

import socket
import struct
import threading
import time

import helpers
import pytest

import gpucoll
from gpucoll.bootstrap import TCPStore
from gpucoll.bootstrap import _wire as w
from gpucoll.bootstrap._server import Limits
from gpucoll.errors import InvalidArgument, InvalidUsage

HOST = "127.0.0.1"
MONTH = 3e6  # 35 days: past epoll's INT_MAX ms (24.8 days)


@pytest.fixture(autouse=True)
def _job_secret(monkeypatch):
    monkeypatch.setenv("GPUCOLL_STORE_SECRET", "bounds-test-secret-0123456789abcdef")


def _server(**limits):
    return TCPStore(HOST, 0, is_server=True, timeout=10.0, limits=Limits(**limits) if limits else None)


def _client(server, timeout=10.0):
    return TCPStore(HOST, server.port, is_server=False, timeout=timeout)


def _request(sock, writer):
    sock.sendall(writer.frame())


def _reply(sock) -> w._Reader:
    magic, length = w._HEADER.unpack(w._recv_exact(sock, w._HEADER.size))
    assert magic == w.MAGIC
    return w._Reader(w._recv_exact(sock, length))


def _slow_reader(port):
    """A member that asks and then does not read: what it is sent waits in the server."""
    s = helpers.store_socket(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 17)  # little kernel buffer to hide the reply in
    return s


# -- 1. timeouts -----------------------------------------------------------------------------------------------------

def test_a_month_long_wait_leaves_the_loop_serving():
    server = _server()
    try:
        a, b = _client(server, timeout=MONTH), _client(server)
        got = []
        t = threading.Thread(target=lambda: got.append(a.get("late")))  # parked with a 35-day deadline
        t.start()
        time.sleep(0.3)  # the loop is idle with that deadline ahead: before the fix select() raised here
        assert server._server._thread.is_alive()
        b.set("late", b"v")
        t.join(10)
        assert got == [b"v"]
        time.sleep(0.3)  # the answered request's deadline is still 35 days ahead in the heap
        assert server._server._thread.is_alive()
        assert a.get("late", timeout=gpucoll.MAX_TIMEOUT) == b"v"
        b.set("k", b"1")
        assert a.add("n", 2) == 2
    finally:
        server.close()


def _month_worker(comm):
    import numpy as np

    x = np.full(4, comm.rank + 1, dtype=np.float32)
    comm.all_reduce(x)
    time.sleep(0.5)  # the store's loop idles with the init's 35-day deadlines in its heap
    comm.barrier()
    y = np.full(4, comm.rank + 1, dtype=np.float32)
    comm.all_reduce(y)
    return x.tolist(), y.tolist()


@pytest.mark.spawns
def test_init_with_a_month_long_timeout_runs():
    results = gpucoll.spawn(_month_worker, 2, backend="host", timeout=MONTH)
    assert results == [([3.0] * 4, [3.0] * 4)] * 2


@pytest.mark.parametrize("bad", [float("inf"), 1e8, float("nan"), 0, -1, True, "10"])
def test_a_timeout_no_layer_can_hold_is_refused_at_the_call(bad):
    with pytest.raises(InvalidArgument, match="timeout must be"):
        gpucoll.init(rank=0, world_size=1, backend="host", timeout=bad)
    with pytest.raises(InvalidArgument, match="timeout must be"):
        TCPStore(HOST, 0, is_server=True, timeout=bad)
    with pytest.raises(InvalidArgument, match="timeout must be"):
        gpucoll.spawn(_month_worker, 2, backend="host", timeout=bad)
    server = _server()
    try:
        with pytest.raises(InvalidArgument, match="timeout must be"):
            server.get("k", timeout=bad)
        with pytest.raises(InvalidArgument, match="timeout must be"):
            server.wait(["k"], timeout=bad)
    finally:
        server.close()


def test_the_ceiling_message_says_what_to_pass():
    with pytest.raises(InvalidArgument) as e:
        gpucoll.init(rank=0, world_size=1, backend="host", timeout=float("inf"))
    assert "at most 1e+07 s" in str(e.value) and "gpucoll.MAX_TIMEOUT" in str(e.value)


def test_torch_timedelta_of_any_length_is_held_to_the_ceiling():
    pytest.importorskip("torch")
    import datetime

    from gpucoll.torch import _call as torch_call

    assert torch_call._seconds(datetime.timedelta(days=36500)) == gpucoll.MAX_TIMEOUT
    assert torch_call._seconds(datetime.timedelta(minutes=5)) == 300.0


# -- 2. the memory cap -------------------------------------------------------------------------------------------

def test_readers_of_one_large_value_share_it_and_an_innocent_request_passes():
    cap, size = 48 << 20, 16 << 20
    server = _server(max_buffered=cap)
    readers = []
    try:
        owner = _client(server)
        value = bytes(range(256)) * (size // 256)
        owner.set("big", value)
        for _ in range(5):  # 80 MiB of replies against a 48 MiB cap, if each reply were a copy
            s = _slow_reader(server.port)
            _request(s, w._Writer().u8(w._OP_GET).str("big").f64(5.0))
            readers.append(s)
        time.sleep(0.3)
        small = _client(server)
        small.set("small", b"1")  # before the fix: dropped, "lost the connection ... did rank 0 exit?"
        assert small.get("small") == b"1"
        stats = server.server_stats()
        assert stats["buffered"] <= cap and not stats["dropped"], stats
        for s in readers:  # every reader gets the whole value
            s.settimeout(10)
            r = _reply(s)
            assert r.u8() == w._ST_OK and r.blob() == value
        assert server.server_stats()["buffered"] < 4096
    finally:
        for s in readers:
            s.close()
        server.close()


def test_the_connection_holding_the_most_pays():
    cap = 24 << 20
    server = _server(max_buffered=cap)
    try:
        flood = helpers.store_socket(server.port)
        flood.sendall(struct.pack("!4sI", w.MAGIC, w.MAX_FRAME) + b"\x7f" * (16 << 20))  # a frame, never finished
        time.sleep(0.3)
        other = _client(server)
        other.set("v", b"x" * (12 << 20))  # 16 + 12 MiB > 24: the half-sent frame holds more, it goes
        assert other.get("v") == b"x" * (12 << 20)
        assert server.server_stats()["dropped"] == {"memory": 1}
        flood.settimeout(5)
        assert flood.recv(1) == b""
    finally:
        server.close()


def test_a_reader_that_would_pass_the_cap_is_told_why_not_cut_off():
    cap = 24 << 20
    server = _server(max_buffered=cap)
    try:
        owner = _client(server)
        owner.set("a", b"a" * (14 << 20))
        owner.set("b", b"b" * (14 << 20))
        first = _slow_reader(server.port)
        _request(first, w._Writer().u8(w._OP_GET).str("a").f64(5.0))
        time.sleep(0.3)
        with pytest.raises(InvalidUsage, match="cannot send this 14680064-byte value now.*keep them small"):
            owner.get("b")
        assert owner.get("a")[:3] == b"aaa"  # the same value again costs nothing: it is shared
        first.settimeout(10)
        r = _reply(first)
        assert r.u8() == w._ST_OK and len(r.blob()) == 14 << 20
    finally:
        server.close()


# -- 3. keys per request ---------------------------------------------------------------------------------------------

def test_one_wait_on_millions_of_keys_is_refused_before_it_is_read():
    server = _server()
    try:
        n = (32 << 20) // 8  # 32 MiB of 4-byte keys
        payload = bytearray(w._Writer().u8(w._OP_WAIT).f64(5.0).u32(n).frame()[w._HEADER.size:])
        payload += (struct.pack("!I", 4) + b"kkkk") * n
        s = helpers.store_socket(server.port)
        t0 = time.monotonic()
        s.sendall(w._HEADER.pack(w.MAGIC, len(payload)) + payload)
        s.settimeout(10)
        assert s.recv(1) == b""  # dropped: before the fix it parked, 1.9 GB and 27 s later
        assert time.monotonic() - t0 < 5
        assert server.server_stats()["dropped"] == {"protocol": 1}
        c = _client(server)
        c.set("still", b"serving")
        assert c.get("still") == b"serving"
    finally:
        server.close()


def test_a_client_asking_for_too_many_keys_gets_a_clear_error():
    server = _server()
    try:
        with pytest.raises(InvalidArgument, match=f"keys: {w.MAX_KEYS + 1} keys in one call; .*at most {w.MAX_KEYS}"):
            server.wait([f"k{i}" for i in range(w.MAX_KEYS + 1)], timeout=1)
        server.set("x", b"1")
        assert not server.check(["x", "y"])
    finally:
        server.close()


def test_a_wait_sees_a_key_deleted_before_the_last_one_came():
    server = _server()
    try:
        setter = _client(server)
        done = threading.Event()
        t = threading.Thread(target=lambda: (server.wait(["a", "b"], timeout=10), done.set()))
        t.start()
        setter.set("a", b"1")
        setter.delete("a")
        setter.set("b", b"1")
        assert not done.wait(0.3), "wait returned while key 'a' was missing"
        setter.set("a", b"2")
        assert done.wait(5)
        t.join(5)
    finally:
        server.close()


def test_a_barrier_roll_call_larger_than_one_request():
    server = _server()
    try:
        with pytest.raises(gpucoll.CollectiveTimeout, match=r"1 of 70000 ranks arrived; missing ranks: \[1, 2,"):
            server.barrier("big", 70000, timeout=0.3, rank=0)
    finally:
        server.close()


# -- 4. counters and keys ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stored", [b" 7 ", b"1_000", b"+5", b"\xd9\xa3", b"", b"7\n"])
def test_add_takes_only_decimal_counters(stored):
    server = _server()
    try:
        server.set("c", stored)
        with pytest.raises(InvalidArgument, match="'c' holds a value that is not a counter"):
            server.add("c", 1)
        server.set("c", b"-12")
        assert server.add("c", 2) == -10
    finally:
        server.close()


@pytest.mark.parametrize("call", [lambda s: s.set("\ud800", b"x"), lambda s: s.get("a\udc00b", timeout=1),
                                  lambda s: s.wait(["ok", "\udfff"], timeout=1), lambda s: s.add("\ud83d", 1),
                                  lambda s: s.check("\ud800"), lambda s: s.delete("\ud800")])
def test_a_key_that_cannot_be_utf8_is_an_invalid_argument(call):
    server = _server()
    try:
        with pytest.raises(InvalidArgument, match="must be valid Unicode text .*surrogates not allowed"):
            call(server)
        server.set("fine", b"1")  # the connection is intact
        assert server.get("fine") == b"1"
    finally:
        server.close()
