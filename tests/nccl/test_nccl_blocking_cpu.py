"""GPUCOLL_NCCL_BLOCKING_OPS: the blocking split waits for every rank's init under the timeout, on CPU.

The split itself (ncclCommSplit) needs a GPU (tests/nccl/test_nccl_gpu.py, kind "blocking"); here a stand-in for
the native communicator records what the bootstrap asks of it.
"""

from __future__ import annotations

import threading
import types

import pytest

from gpucoll.backends import nccl as _nccl_backend
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


def _launch(rank, world_size):
    return types.SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)


def test_every_rank_splits_once_all_finished_init(store):
    comms = [SplitRecorder(), SplitRecorder()]
    errors = []

    def rank(r):
        client = TCPStore("127.0.0.1", store.port, is_server=False, timeout=10.0)
        try:
            _nccl_backend._split_blocking(comms[r], _launch(r, 2), client, "t/", 10.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and [c.split for c in comms] == [1, 1] and all(c.aborted is None for c in comms)


def test_a_rank_that_never_finished_init_is_named_and_nothing_splits(store):
    comm = SplitRecorder()
    with pytest.raises(CollectiveTimeout, match="before the blocking split") as info:
        _nccl_backend._split_blocking(comm, _launch(0, 3), store, "t2/", 0.5)
    assert info.value.ranks == (1, 2) and info.value.call == "ncclCommSplit"
    assert comm.split == 0 and comm.aborted


def test_an_nccl_without_split_keeps_the_non_blocking_communicator(store):
    class NoSplit(SplitRecorder):
        def split_blocking(self):
            raise Unsupported("NCCL 2.17.1 has no ncclCommSplit (2.18 or newer has): its communicators stay "
                              "non-blocking", call="ncclCommSplit")

    comm = NoSplit()
    _nccl_backend._split_blocking(comm, _launch(0, 1), store, "t3/", 10.0)
    assert comm.aborted is None


def test_the_variable_is_registered_and_off_by_default(monkeypatch):
    from gpucoll import config

    monkeypatch.delenv("GPUCOLL_NCCL_BLOCKING_OPS", raising=False)
    var = {v["name"]: v for v in config.variables()}["GPUCOLL_NCCL_BLOCKING_OPS"]
    assert var["default"] == "0" and "blocking" in var["description"]
    assert config.get_bool("GPUCOLL_NCCL_BLOCKING_OPS") is False

