"""gloo ends an operation on a worker thread of its process group, which then releases the operation's tensors. One
that timed out here may end there after the caller moved on; at interpreter finalization that release cannot take
the GIL, and the process aborts ("terminate called without an active exception": seen in CI, a job that had
recovered from a lost node and finished, killed at exit; the core showed gloo's worker destroying the operation
while the main thread finalized). host_engines.py therefore destroys every gloo engine's process group at exit,
before finalization: its destructor joins the worker threads."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.spawns]

SCRIPT = str(Path(__file__).resolve().parent / "gloo_exit_rank.py")


def test_every_gloo_engine_is_closed_at_exit_before_the_interpreter_finalizes():
    done = subprocess.run([sys.executable, SCRIPT, secrets.token_hex(32)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["ran", "process group at exit: closed"], (done.stdout, done.stderr[-3000:])


def test_close_is_idempotent_and_forgets_the_engine():
    from gpucoll.backends import host_engines
    from gpucoll.bootstrap.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=30.0, secret=secrets.token_hex(32))
    try:
        engine = host_engines.Gloo(store, 0, 1, 30.0)
        assert engine in host_engines._LIVE
        engine.close()
        engine.close()
        assert engine.pg is None and engine not in host_engines._LIVE
    finally:
        store.close()
