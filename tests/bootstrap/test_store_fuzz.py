"""Fuzzing the rendezvous store's wire protocol (hypothesis), bounded in examples and time.

Before authentication: arbitrary bytes. After it (a member gone wrong): sequences of frames, each a well-formed
header with a payload that starts with a real opcode or any byte and goes on with arbitrary fields, or raw bytes.
After every example the server must still answer a real client at once (no crash, no hang), and at the end it
must hold no connection and no buffered byte of the fuzzer's, with its memory bounded.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import helpers
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucoll.bootstrap import TCPStore
from gpucoll.bootstrap import _wire as w

pytestmark = helpers.timeout_mark(240)

SECRET = "fuzz-test-secret-0123456789abcdef"
EXAMPLES = 300


def _rss() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) << 10


@pytest.fixture(scope="module")
def store():
    from gpucoll.bootstrap._server import Limits

    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=5.0, secret=SECRET,
                      limits=Limits(handshake_timeout=1.0, frame_timeout=1.0))
    server.set("probe", b"ok")
    server.rss0 = _rss()
    yield server
    server.close()


def _still_serves(server):
    c = TCPStore("127.0.0.1", server.port, is_server=False, timeout=5.0, secret=SECRET)
    try:
        c.set("probe", b"ok")
        assert c.get("probe", timeout=2.0) == b"ok"
    finally:
        c.close()


def _send_and_close(sock, chunks):
    sock.settimeout(2.0)
    with contextlib.suppress(OSError):
        for chunk in chunks:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):  # the server answers or drops; either way the connection ends
            pass
    sock.close()


opcodes = st.one_of(st.integers(1, 8), st.integers(0, 255))
fields = st.binary(max_size=48)
frame = st.one_of(
    st.builds(lambda op, body: struct.pack("!4sI", w.MAGIC, 1 + len(body)) + bytes([op]) + body, opcodes, fields),
    st.builds(lambda op, body, lie: struct.pack("!4sI", w.MAGIC, lie) + bytes([op]) + body, opcodes, fields,
              st.integers(0, 2**32 - 1)),
    st.binary(max_size=64),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.binary(max_size=200))
def test_unauthenticated_bytes(store, data):
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=2.0)
    _send_and_close(sock, [data])
    _still_serves(store)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(frames=st.lists(frame, max_size=6))
def test_member_frames(store, frames):
    sock = helpers.store_socket(store.port, SECRET)
    _send_and_close(sock, frames)
    _still_serves(store)


def test_nothing_of_the_fuzzers_is_left(store):
    """Runs after the fuzz tests above (file order)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        stats = store.server_stats()
        if stats["conns"] == 1 and stats["pending"] == 0 and stats["buffered"] == 0:
            break
        time.sleep(0.1)
    assert stats["conns"] == 1 and stats["pending"] == 0 and stats["buffered"] == 0, stats  # the store's own client
    assert _rss() - store.rss0 < 64 << 20
    _still_serves(store)
