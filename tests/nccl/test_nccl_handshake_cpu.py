"""The NCCL backend's consumer side of the buffer protocols and its mapping of native failures, without a GPU.

* DLPack producers are asked for the legacy default stream explicitly (``__dlpack__(stream=1)``; torch does no
  synchronisation for ``stream=None``), with a fallback for producers that take no stream argument.
* An explicit ``stream=`` waits for the stream a producer made its data ready on (``__cuda_array_interface__``'s
  ``stream``, DLPack's legacy stream), for the input and the output; torch/CuPy buffers and interfaces without a
  stream need no join. The join itself (``_C.cuda_stream_wait``) is replaced by a recorder: the streams are fake.
* A native call that times out inside NCCL (an operation that never reached the stream, e.g. a lazy connection to a
  rank that never called it) raises the same CollectiveTimeout as the watchdog, with the missing ranks read from the
  store; a call cut short by the watchdog's abort raises the watchdog's recorded failure.
"""

from __future__ import annotations

import helpers
import pytest
from test_nccl_backend_cpu import FakeCAI, FakeComm, make_backend

from gpucoll import _C, _buffers, _cuda_buffers
from gpucoll.errors import CollectiveTimeout, InvalidUsage


class Producer:
    """A DLPack producer that records the stream it was asked for (capsule from a CPU torch tensor)."""

    def __init__(self, t, takes_stream=True):
        self._t, self.asked = t, []
        if not takes_stream:
            self.__dlpack__ = self._no_stream

    def __dlpack__(self, stream=None):
        self.asked.append(stream)
        return self._t.__dlpack__()

    def _no_stream(self):
        self.asked.append("no argument")
        return self._t.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


def test_dlpack_producer_is_asked_for_the_legacy_stream():
    torch = helpers.require("torch")
    p = Producer(torch.zeros(4))
    buf = _buffers.resolve(p, "x")
    assert p.asked == [1] and buf.kind == "dlpack"
    old = Producer(torch.zeros(4), takes_stream=False)
    assert _buffers.resolve(old, "x").count == 4 and old.asked == ["no argument"]


def test_ready_streams():
    assert _cuda_buffers.ready_stream(_buffers.resolve(FakeCAI(stream=77), "x")) == 77
    assert _cuda_buffers.ready_stream(_buffers.resolve(FakeCAI(stream=None), "x")) is None

    class Buf:
        kind = "dlpack"

    assert _cuda_buffers.ready_stream(Buf()) == 0
    Buf.kind = "torch"
    assert _cuda_buffers.ready_stream(Buf()) is None


@pytest.fixture
def joins(monkeypatch):
    seen = []
    monkeypatch.setattr(_C, "cuda_stream_wait", lambda *a: seen.append(a))
    return seen


def test_explicit_stream_waits_for_input_and_output_producers(store, joins):
    comm = FakeComm()
    backend = make_backend(store, comm, timeout=60.0)
    try:
        src = _buffers.resolve(FakeCAI(stream=55), "x")
        dst = _buffers.resolve(FakeCAI(stream=66, ptr=0xBEEF0000), "out")
        backend.collective(0, "auto", src, dst, 4, None, 0, None, False)
        assert comm.calls[-1][5] == 55 and joins == [(55, 66, 0)]  # on x's producer stream, after out's
        joins.clear()
        backend.collective(0, "auto", src, dst, 4, None, 0, 9, False)
        assert comm.calls[-1][5] == 9 and joins == [(9, 55, 0), (9, 66, 0)]
        joins.clear()
        ready = _buffers.resolve(FakeCAI(stream=None), "x")
        backend.collective(0, "auto", ready, ready, 4, None, 0, 9, False)
        assert joins == []  # "stream": None means the data is ready already
    finally:
        backend.close()


class TimingOut(FakeComm):
    """A native communicator whose next call times out inside NCCL (as NcclComm::wait_ready raises it)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def collective(self, *args):
        self.issued += 1
        raise self.error


def test_native_timeout_names_the_missing_ranks(store):
    native_error = CollectiveTimeout("all_reduce #3 (float32 x 4): NCCL did not finish ncclAllReduce within the "
                                     "timeout of 0.2 s; the communicator was aborted", call="ncclAllReduce")
    comm = TimingOut(native_error)
    comm.issued = 2
    store.set("t/seq/1", b"3")  # rank 1 issued operation 3, rank 2 did not
    store.set("t/seq/2", b"2")
    backend = make_backend(store, comm, timeout=60.0)
    try:
        src = _buffers.resolve(FakeCAI(), "x")
        with pytest.raises(CollectiveTimeout) as info:
            backend.collective(0, "auto", src, src, 4, None, 0, None, False)
        err = info.value
        assert err.ranks == (2,) and "ranks that had not reached operation #3: [2]" in str(err)
        assert "all_reduce #3" in str(err) and err.call == "ncclAllReduce"
        assert isinstance(backend._error, CollectiveTimeout) and comm.aborted  # recorded: later calls raise it
        with pytest.raises(CollectiveTimeout, match=r"\[2\]"):
            backend.collective(0, "auto", src, src, 4, None, 0, None, False)
    finally:
        backend.close()


def test_call_interrupted_by_the_watchdog_raises_its_failure(store):
    comm = TimingOut(InvalidUsage("all_reduce #1 was interrupted: the communicator is being aborted"))
    backend = make_backend(store, comm, timeout=60.0)
    try:
        src = _buffers.resolve(FakeCAI(), "x")
        with pytest.raises(InvalidUsage, match="interrupted"):
            backend.collective(0, "auto", src, src, 4, None, 0, None, False)  # no recorded failure: the native error as it is
        # The watchdog recorded a failure while the call was inside NCCL: that failure is what the caller sees.
        backend._error = CollectiveTimeout("broadcast #1 did not complete", ranks=(1,))
        mapped = backend._native_failed(InvalidUsage("interrupted"), 1)
        assert isinstance(mapped, CollectiveTimeout) and mapped.ranks == (1,) and mapped is not backend._error
        assert "broadcast #1" in str(mapped)
    finally:
        backend._error = None
        backend.close()
