"""On CPU: GPUCOLL_NCCL_BLOCKING_OPS (the blocking split waits for every rank's init under the timeout), and the
watchdog's timeout for a point-to-point operation (it names the peer).

The split itself (ncclCommSplit) needs a GPU (tests/gpu/test_nccl_gpu.py, kind "blocking"); here a stand-in for
the native communicator records what the bootstrap asks of it.
"""

from __future__ import annotations

import threading
import types

import pytest

from gpucoll import _nccl_backend
from gpucoll.bootstrap.store import TCPStore
from gpucoll.errors import CollectiveTimeout, Unsupported


class SplitRecorder:
    def __init__(self):
        self.split = 0
        self.aborted = None

    def split_blocking(self):
        self.split += 1

    def abort(self, why):
        self.aborted = why


@pytest.fixture
def server():
    s = TCPStore("127.0.0.1", 0, is_server=True, timeout=10.0)
    yield s
    s.close()


def _launch(rank, world_size):
    return types.SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)


def test_every_rank_splits_once_all_finished_init(server):
    comms = [SplitRecorder(), SplitRecorder()]
    errors = []

    def rank(r):
        store = TCPStore("127.0.0.1", server.port, is_server=False, timeout=10.0)
        try:
            _nccl_backend._split_blocking(comms[r], _launch(r, 2), store, "t/", 10.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and [c.split for c in comms] == [1, 1] and all(c.aborted is None for c in comms)


def test_a_rank_that_never_finished_init_is_named_and_nothing_splits(server):
    comm = SplitRecorder()
    with pytest.raises(CollectiveTimeout, match="before the blocking split") as info:
        _nccl_backend._split_blocking(comm, _launch(0, 3), server, "t2/", 0.5)
    assert info.value.ranks == (1, 2) and info.value.call == "ncclCommSplit"
    assert comm.split == 0 and comm.aborted


def test_an_nccl_without_split_keeps_the_non_blocking_communicator(server):
    class NoSplit(SplitRecorder):
        def split_blocking(self):
            raise Unsupported("NCCL 2.17.1 has no ncclCommSplit (2.18 or newer has): its communicators stay "
                              "non-blocking", call="ncclCommSplit")

    comm = NoSplit()
    _nccl_backend._split_blocking(comm, _launch(0, 1), server, "t3/", 10.0)
    assert comm.aborted is None


def test_the_variable_is_registered_and_off_by_default(monkeypatch):
    from gpucoll import config

    monkeypatch.delenv("GPUCOLL_NCCL_BLOCKING_OPS", raising=False)
    var = {v["name"]: v for v in config.variables()}["GPUCOLL_NCCL_BLOCKING_OPS"]
    assert var["default"] == "0" and "blocking" in var["description"]
    assert config.get_bool("GPUCOLL_NCCL_BLOCKING_OPS") is False


def test_a_stuck_send_names_its_peer_not_sequence_counts(server, monkeypatch):
    """Ranks issue different numbers of sends and receives: the timeout names the peer of the stuck one."""
    import time

    monkeypatch.setenv("GPUCOLL_NCCL_WATCHDOG_MS", "10")

    class StuckSend:
        issued = 7
        aborted = None

        def poll(self):
            return {"completed": [], "pending": True, "oldest_seq": 7, "oldest_age_s": 1.0, "issued": 7,
                    "oldest_what": "send #7 (4096 bytes to rank 2)", "async_error": "", "async_text": "",
                    "usable": self.aborted is None}

        def abort(self, why):
            self.aborted = why

        def close(self):
            pass

    server.set("t3/seq/1", b"0")  # rank 1 issued nothing: it is not part of this exchange and must not be named
    backend = _nccl_backend.NcclBackend(StuckSend(), rank=0, world_size=3, device=0, store=server, prefix="t3/",
                                        timeout=0.2)
    try:
        end = time.monotonic() + 10
        while backend._error is None and time.monotonic() < end:
            time.sleep(0.01)
        err = backend._error
        assert isinstance(err, CollectiveTimeout) and err.ranks == (2,) and err.call == "send"
        assert "its peer, rank 2, did not post the matching operation" in err.message
    finally:
        backend.close()
