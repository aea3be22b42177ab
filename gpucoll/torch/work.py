"""The Work objects the gpucoll process group returns to torch.distributed.

torch needs a subclass of ``torch.distributed._Work`` (a bare ``_Work()`` makes ``dist.all_reduce`` hang) with
``wait(timeout=...)``, ``is_completed()`` and ``get_future()`` returning a ``torch.futures.Future`` that holds the
list of output tensors; DDP's reducer chains its bucket handling on that future from C++.

What a gpucoll call hands back is one type, gpucoll.Work (gpucoll._C.Work), whatever ran it; a torch Work wraps the
gpucoll Works of its operation (``_works``) and adds what torch needs. Where the operation ran decides what waiting
means:

* host (CPU tensors): gpucoll's host backend finishes an operation before the call returns, so the Work is
  complete when it is made (no gpucoll Work).
* background (CPU all-reduces): issued with async_op to the host communicator's progress thread, which runs the
  communicator's operations in call order, so that DDP's backward goes on while a bucket is reduced (as gloo's
  threads let it); its gpucoll Work's wait() blocks, and the future is set (add_done_callback) when that thread has
  run it.
* CUDA tensors: the operations were enqueued on the caller's current CUDA stream; their gpucoll Works' wait() makes
  the current stream wait (the host does not block), as torch's NCCL Work does. Every gpucoll Work raises its
  operation's error, or its communicator's failure (``CollectiveTimeout``, ``NcclError``) once gpucoll's watchdog
  recorded one: the first such error is this Work's from then on.
* deferred point-to-point: ``send``/``recv`` are queued on the group and run together, as one gpucoll group (so
  matching pairs never deadlock, whatever their order), at the first ``wait()``/``is_completed()``/
  ``get_future()`` of any of them or before the group's next collective.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
import torch.distributed as dist

from gpucoll.errors import GpucollError
from gpucoll.torch.errors import raise_torch_errors_from, torch_error

__all__ = ["DoneWorks", "Work"]


def _value_or_raise(source):
    return source.value()  # raises the exception set on `source`


class Work(dist._Work):
    """One operation of a gpucoll process group, as torch sees it."""

    # What a completed host operation has; __init__ sets only what differs (_Done, on dist.all_reduce's one-call
    # path, sets none of them).
    _works = ()  # the gpucoll Works (gpucoll._C.Work) of the operation: a background one's, or the CUDA ones
    _pending = None  # the group whose p2p queue holds this operation, until it is flushed
    _event = None  # torch.cuda.Event recorded after everything this operation enqueued
    _device = None  # torch.device of a CUDA operation, else None
    _deps = ()  # torch Works of a delegate backend (cpu:gloo) this one stands for
    _error = None
    _future = None  # what get_future() returned
    _source = None  # a recv's source rank in the group (a recv from any source: known once it ran)

    def __init__(self, outputs, *, pending=None, works=(), event=None, device=None, deps=()):
        super().__init__()
        self._outputs = list(outputs)
        if pending is not None:
            self._pending = pending
        if works:
            self._works = tuple(works)
        if event is not None:
            self._event, self._device = event, device
        elif device is not None:
            self._device = device
        if deps:
            self._deps = tuple(deps)

    # Called by the group when it flushed (or failed to flush) the p2p queue holding this operation.
    def _settled(self, error=None) -> None:
        self._pending = None
        self._error = torch_error(error)

    def _settle(self) -> None:
        group = self._pending
        if group is not None:
            group._flush_p2p()
        if self._error is not None:
            raise self._error

    def _ask(self, call):
        """call() of a gpucoll Work; its error becomes this Work's (raised now and by every later call)."""
        try:
            return call()
        except GpucollError as e:
            self._error = torch_error(e)
            raise self._error from None

    def wait(self, timeout=None) -> bool:
        """Blocks until a CPU operation is done; for CUDA, orders the current stream after the operation.
        `timeout` is accepted for torch's signature; the group's own timeout (init_process_group's) applies."""
        self._settle()
        for w in self._deps:
            w.wait()
        for w in self._works:
            self._ask(w.wait)
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        """Whether the operation finished. A queued send/recv is run (with the rest of its queue) first."""
        self._settle()
        if not all(w.is_completed() for w in self._deps):
            return False
        done = True
        for w in self._works:
            done = self._ask(w.is_completed) and done  # each also raises its error or a recorded failure
        if self._event is not None:
            done = done and self._event.query()
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        for w in self._works:
            if self._error is None and w.done():
                with contextlib.suppress(GpucollError):  # what this returns: _ask keeps it in _error
                    self._ask(w.is_completed)
        return self._error

    def synchronize(self) -> None:
        """Blocks the host until the operation finished (CUDA included)."""
        self.wait()
        if self._event is not None:
            self._event.synchronize()

    def result(self):
        return self._outputs

    def _source_rank(self) -> int:
        """The rank (in the group) a recv took its message from; for a recv from any source it runs it first."""
        self._settle()
        if self._source is None:
            raise RuntimeError("_source_rank: this Work is not a recv")
        return self._source

    source_rank = _source_rank

    def get_future(self):
        """A torch.futures.Future holding the list of output tensors. For CUDA tensors it is a CUDA-aware future:
        its value is ready for work enqueued on the current stream after ``wait()`` on the future. A failed operation
        fails the future: its ``wait()``/``value()`` raise RuntimeError with the gpucoll error's type and text (as a
        gloo or NCCL future raises), and DDP's backward raises it."""
        if self._future is not None:
            return self._future
        source, future = self._chained_future()
        self._future = future
        if self._works and self._works[-1].device is None:  # a background operation: completed on the thread that
            self._works[-1].add_done_callback(lambda: self._ended(source))  # ran it (as on gloo's threads)
            return future
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits on it
            self._error = torch_error(e)
        self._complete(source)
        return future

    def _ended(self, source) -> None:
        with contextlib.suppress(GpucollError):  # kept in _error, which fails the future
            self._settle()
            for w in self._works:
                self._ask(w.is_completed)
        self._complete(source)

    def _chained_future(self):
        """(source, future): the future handed out is `source.then(...)`, so that a failure reaches it as a C++ error.
        torch's Future.set_exception, from Python, stores the exception object as the future's *value* (its Python
        wait() raises it); DDP's reducer reads the value in C++, takes it for the bucket's tensors and crashed the
        process (SIGSEGV in c10d::detail::parseCppCommHookResult) when a peer died during backward. An exception
        raised by a `then` callback is stored as an error, which C++ rethrows."""
        source = torch.futures.Future(devices=[self._device]) if self._device is not None else torch.futures.Future()
        return source, source.then(_value_or_raise)

    def _complete(self, source) -> None:
        if self._error is not None:
            source.set_exception(self._error)
        else:
            source.set_result(self._outputs)

    def __repr__(self) -> str:
        running = self._error is None and not all(w.done() for w in self._works)
        state = "queued" if self._pending is not None or running else ("failed" if self._error is not None else "issued")
        where = str(self._device) if self._device is not None else "cpu"
        return f"<gpucoll.torch.Work {where} {state}>"


# A failure that wait() and the rest raise is torch's type as well as gpucoll's (gpucoll/torch/errors.py).
raise_torch_errors_from(Work, private=("_source_rank",))


class _Done(Work):
    """The Work of an operation that finished before the call returned (host), made without __init__'s arguments
    (torch's base must still be initialised); its outputs are set by DoneWorks."""

    __init__ = dist._Work.__init__


class DoneWorks:
    """The completed Works of one process group's one-call path (ProcessGroupGpucoll.allreduce). The Work of the last
    call is handed out again while nothing but this holds it: dist.all_reduce(t) waits on its Work and drops it, and
    making a new one is a fifth of that call. Any holder keeps its Work from being reused: a Python reference
    (torch's C++ side holds a Python Work through one), or a weak reference."""

    __slots__ = ("_spare",)

    def __init__(self):
        self._spare = None

    def get(self, outputs: list) -> Work:
        work = self._spare
        # 3: the slot, `work`, getrefcount's argument.
        if work is not None and sys.getrefcount(work) == 3 and not weakref.getweakrefcount(work):
            work._outputs = outputs
            work._future = None
            return work
        work = self._spare = _Done()
        work._outputs = outputs
        return work
