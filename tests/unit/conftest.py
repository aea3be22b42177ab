"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def store(monkeypatch):
    """A TCPStore server on a free loopback port (the rendezvous store the backends bootstrap through); the test's
    environment holds its job secret, for the clients the test makes."""
    from gpucoll.bootstrap.store import TCPStore, new_secret

    monkeypatch.setenv("GPUCOLL_STORE_SECRET", new_secret())
    s = TCPStore("127.0.0.1", 0, is_server=True, timeout=10.0)
    yield s
    s.close()
