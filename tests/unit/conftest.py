"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def store():
    """A TCPStore server on a free loopback port (the rendezvous store the backends bootstrap through)."""
    from gpucoll.bootstrap.store import TCPStore

    s = TCPStore("127.0.0.1", 0, is_server=True, timeout=10.0)
    yield s
    s.close()
