"""The nccl backend: NCCL runs every call. Here: its Backend (``Nccl``: streams, async Work, the watchdog),
bootstrap through the rendezvous store, and the plan for ranks sharing GPUs.
Whether it can run here, and which GPU a rank uses, is checked in usable.py (named here too).

The C++ side (``csrc/backends/nccl_cuda/nccl_comm.*``, bound as ``gpucoll._C.NcclComm``) enqueues the NCCL calls and
records a CUDA event after each; this module decides streams, keeps async operations' buffers alive, and runs one
watchdog thread per communicator. Every ``GPUCOLL_NCCL_WATCHDOG_MS`` the watchdog polls the communicator: events of
finished operations are dropped, an asynchronous NCCL error is recorded as ``NcclError``, and an operation older
than the communicator's timeout becomes a ``CollectiveTimeout`` naming it, its sequence number and the ranks that
had not issued it. Either failure aborts the NCCL communicator (which ends its kernels, so nothing waits forever)
and is raised by the next call on the communicator, by ``Work.wait()`` and by ``Work.synchronize()``.

Ranks learn each other's progress through the store: the watchdog publishes this rank's count of issued
operations when it changed, at most every max(poll interval, 0.5 s), so the hot path never touches the network.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import re
import sys
import threading
import time
import weakref

from gpucoll import _cuda_buffers, _log, _nccl, config, flight_recorder
from gpucoll._call_check import StoreCallCheck
from gpucoll._native import _C
from gpucoll.backends.base import FAST_OPS, Backend, plain_cuda_array
from gpucoll.backends.nccl_arrivals import Arrivals
from gpucoll.backends.nccl_liveness import Heartbeat
from gpucoll.backends.nccl_plan import spawn_plan, version_text
from gpucoll.backends.premul import PreMulSum, premul_sum
from gpucoll.backends.usable import (
    MULTI_RANK_ENV,
    auto_selects_nccl,
    device_map,
    gpu_problems,
    multi_rank_enabled,
    pick_device,
)
from gpucoll.backends.usable import check_nccl_usable as check_usable
from gpucoll.backends.usable import nccl_problems as problems
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, InvalidUsage, NcclError, Unsupported

# This module's own names for the checks it shares with the custom backend (tests and tools use them from here).
__all__ = ["MULTI_RANK_ENV", "Nccl", "PreMulSum", "auto_selects_nccl",
           "check_usable", "device_map", "gpu_problems", "init_backend", "multi_rank_enabled", "pick_device",
           "premul_sum", "problems", "spawn_plan", "version_text"]
_ALL_REDUCE = 0  # gpucoll::algo::Coll::kAllReduce


# -- the backend ----------------------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet = weakref.WeakSet()
_atexit_registered = False


def _close_all() -> None:
    # Before the interpreter (and with it the CUDA runtime's teardown) starts: finalize NCCL while it still can.
    for backend in list(_LIVE):
        try:
            backend.close()
        except Exception as e:  # noqa: BLE001 - exit paths never raise
            _log.debug(f"closing an NCCL communicator at exit failed: {e}")


def _copy_error(err: GpucollError) -> GpucollError:
    # A fresh exception per raise: re-raising one object would pile every raise site onto its traceback.
    copy = type(err)(err.message, call=err.call, location=err.location, ranks=err.ranks)
    copy.__dict__.update(err.__dict__)
    return copy


class Nccl(Backend):
    """backend='nccl': NCCL runs every call (its own algorithms). `impl` is this rank's gpucoll._C.NcclComm."""

    name = "nccl"
    group_fuses = True  # a coalesced call's per-array collectives go in one ncclGroupStart/End (one launch)
    on_gpu = True

    def __init__(self, comm, *, rank: int, world_size: int, device: int, store, prefix: str, timeout: float,
                 trace_key: str = "", local_size: int = 0):
        """`device`: the CUDA device ordinal (``ordinal``; Backend.device is its "cuda:N")."""
        global _atexit_registered
        super().__init__(comm, rank=rank, world_size=world_size, local_size=local_size)
        self._trace_key = trace_key  # the communicator's name in flight-recorder dumps, alike on every rank
        self.ordinal = device
        self._store = store
        self._prefix = prefix
        self._timeout = float(timeout)
        self._sum = _C.RedOp.sum
        self._error = None
        self._failing = False  # _fail is writing the hang report of the first failure
        self._failed = threading.Event()  # set once _error is: a second failing thread waits for the first's error
        self._arrivals = Arrivals(comm, store, prefix, rank, world_size)  # stragglers() (nccl_arrivals.py)
        self._lock = threading.Lock()
        self._inflight = {}  # id(Work) -> (Work, objects it uses): async ops keep their buffers alive until done
        self._scratch = None
        self._closed = False
        self.origin = "ncclCommInitRankConfig"  # how the NCCL communicator was made (split(): "ncclCommSplit")
        # GPUCOLL_DEBUG_CHECKS: every collective compared across ranks before it is enqueued (_call_check.py).
        self._calls = StoreCallCheck(store, prefix, rank, world_size, timeout) \
            if config.get_bool("GPUCOLL_DEBUG_CHECKS") and world_size > 1 else None
        self._poll_s = max(int(config.get_int("GPUCOLL_NCCL_WATCHDOG_MS")), 1) / 1000.0
        self._publish_s = max(self._poll_s, 0.5)
        self._published = -1
        self._last_publish = 0.0
        self._stop = threading.Event()
        self._heartbeat = Heartbeat(store, prefix, rank, world_size, timeout)  # names the lost (nccl_liveness.py)
        self._thread = threading.Thread(target=_watchdog_main, args=(weakref.ref(self), self._stop, self._poll_s),
                                        name=f"gpucoll-nccl-watchdog-r{rank}", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True

    @classmethod
    def create(cls, launch, store, *, timeout: float, local_size: int, device, chosen: bool = False):
        return init_backend(launch, store, timeout, device, local_size=local_size)

    # -- state ----------------------------------------------------------------------------------------------------
    @property
    def native(self):
        """gpucoll._C.NcclComm (for tests and tools)."""
        return self.impl

    @property
    def device(self) -> str:
        return f"cuda:{self.ordinal}"

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            raise _copy_error(err)

    def _fail(self, err: GpucollError) -> None:
        """Records `err` as the communicator's failure and aborts it. On return `_error` is set: where another thread
        is recording a failure already (the watchdog naming lost ranks from their heartbeats takes seconds), this
        one waits for that error, the communicator's, rather than return before there is one to raise."""
        with self._lock:
            first = self._error is None and not self._failing
            self._failing = True
        if not first:
            # Bounded: the first thread's naming and hang report are (2 s of heartbeats, a quarter of the timeout).
            if not self._failed.wait(self._timeout + 30.0):
                _log.warn("the communicator's failure was not recorded in time; raising this thread's own error")
                with self._lock:
                    if self._error is None:
                        self._error = err
            return
        recorded = err
        try:
            if isinstance(err, NcclError) and "ncclRemoteError" in err.message:
                recorded = self._heartbeat.name_lost(err, self._stop.wait)
            # The hang report first (bounded: a quarter of the timeout, at most 10 s): every later raise of the
            # error, a synchronize() released by the abort below included, then carries where every rank is.
            trace = getattr(self.impl, "trace", None)  # tests stand in for the native communicator without one
            if isinstance(recorded, CollectiveTimeout) and trace is not None:
                try:
                    flight_recorder.on_failure(flight_recorder.Source(
                        self.rank, self.world_size, self._timeout, "nccl", trace, self.trace_key, lambda: None,
                        flight_recorder.who_in_store(self._store, f"{self._prefix}joined/")),
                        self._store, recorded)
                except Exception as e:  # noqa: BLE001 - the failure must be recorded and the communicator aborted
                    _log.warn(f"the flight recorder's report failed: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._error = recorded  # set before the abort: a synchronize() released by the abort must see it
            self._failed.set()
        _log.error(str(recorded))
        self.impl.abort(recorded.message)

    def check_buffer(self, buf, arg: str) -> None:
        _cuda_buffers.check_device(buf, arg, self.ordinal)

    # -- operations -----------------------------------------------------------------------------------------------
    def _native_failed(self, e: GpucollError, seq: int) -> GpucollError:
        """What to raise for an error of a native call. The communicator's own recorded failure where the call was
        cut short by its abort; for NCCL's own timeout (an operation that never got onto the stream, e.g. a
        connection to a rank that never called it), the same CollectiveTimeout the watchdog raises, with the
        ranks that had not reached operation `seq`. An NCCL error the call itself found (an asynchronous error NCCL
        reported while the call polled it, or one NCCL keeps on the communicator) aborted the communicator: it is
        recorded as the communicator's failure, as the watchdog records the ones it finds, so that Works issued
        before it and later calls raise it too instead of reporting an aborted operation as complete."""
        if isinstance(e, CollectiveTimeout):
            missing, note = self._missing_ranks(seq)
            if missing:
                text = f"{e.message}; ranks that had not reached operation #{seq}: {missing}"
            elif missing is not None:
                text = f"{e.message}; every rank had issued operation #{seq}"
            else:
                text = f"{e.message}; which ranks had not reached operation #{seq} is unknown {note}"
            err = CollectiveTimeout(text, call=e.call, location=e.location, ranks=missing or ())
            self._fail(err)
            return _copy_error(err)
        if isinstance(e, InvalidUsage) and self._error is not None:
            return _copy_error(self._error)
        if self._error is None and not self.impl.usable:
            self._fail(e)
            return _copy_error(self._error)
        return e

    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        if algo not in (None, "auto", "nccl") and not (isinstance(algo, str) and algo.startswith("nccl:")):
            raise InvalidArgument(f"algo={algo!r} cannot run on backend='nccl', which runs NCCL's own algorithms; "
                                  f"gpucoll's run on backend='custom' or 'auto'")
        return self._enqueue(coll, src, dst, count, redop, root, stream, async_op)

    def _enqueue(self, coll: int, src, dst, count: int, redop, root: int, stream, async_op: bool):
        if self._error is not None:
            self._raise_if_failed()
        s = _cuda_buffers.op_stream(self.ordinal, stream, src, dst if dst is not src else None)
        premul = None
        if redop is None:
            redop = self._sum
        elif type(redop) is PreMulSum:
            premul, redop = float(redop.scalar), self._sum
        if self._calls is not None:
            self._check_call(coll, int(src.dtype), int(redop), premul is not None, root, count)
        try:
            native = self.impl.collective(coll, src.ptr, dst.ptr, count, src.dtype, redop, root, s, async_op, premul)
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        self._arrivals.tick()
        if native is None:
            return None
        return self._track(native, src, (src, dst))

    def p2p(self, send: bool, peer: int, buf, stream=None, async_op=False):
        if self._error is not None:
            self._raise_if_failed()
        try:
            s = _cuda_buffers.op_stream(self.ordinal, stream, buf)
            native = self.impl.p2p([(send, peer, buf.ptr, buf.nbytes)], s, async_op)
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        if native is None:
            return None
        return self._track(native, buf, (buf,))

    def fast_all_reduce(self, x, op, algo, stream, async_op) -> bool:
        """all_reduce(x) in place, sync, on x's own stream, of an array that only exports __cuda_array_interface__
        (gpucoll's DeviceArray, Numba, ...), with algo 'auto' or 'nccl' and a lower-case op name: one native call.
        False where anything else was asked or the native call declines; the general path then runs the call."""
        if stream is not None or async_op is not False or type(op) is not str or type(algo) is not str:
            return False
        redop = FAST_OPS.get(op)
        return (redop is not None and (algo == "auto" or algo == "nccl") and plain_cuda_array(x)
                and self.all_reduce_array(x, redop))

    def all_reduce_array(self, x, redop) -> bool:
        """all_reduce(x) in place of a plain __cuda_array_interface__ array, sync, in one native call
        (NcclComm.all_reduce_array); False, with nothing enqueued, where the general path must run it: a recorded
        failure (it raises), the debug call check (it exchanges), or anything the native call declines."""
        if self._error is not None or self._calls is not None:
            return False
        try:
            done = self.impl.all_reduce_array(x, redop)
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        if done:
            self._arrivals.tick()
        return done

    def _check_call(self, coll: int, dtype: int, op: int, premul: bool, root: int, count: int) -> None:
        try:
            self._calls.check(coll, dtype, op, premul, root, count)
        except CollectiveTimeout as e:  # a rank that skipped a collective: the sequence is lost for good
            self._fail(e)
            raise _copy_error(e) from None

    def _track(self, native, src, bufs):
        """The gpucoll._C.Work of the NcclWork `native`, its buffers kept alive until the watchdog finds it done."""
        work = _C.Work.on_device(native, src.kind, self.ordinal, self._raise_if_failed)
        keep = tuple(b.obj for b in bufs) + tuple(b.keep for b in bufs if b.keep is not None)
        with self._lock:
            self._inflight[id(work)] = (work, keep)
        return work

    def barrier(self) -> None:
        """Returns once every rank called barrier() and the GPU work issued before it on the legacy default stream
        is done (an all_reduce of one int32, then a host wait)."""
        self._raise_if_failed()
        if self._calls is not None:
            self._check_call(-1, 0, 0, False, -1, 0)
        try:
            native = self.impl.collective(_ALL_REDUCE, self._scratch_ptr(), self._scratch_ptr(), 1, _C.DType.int32,
                                          self._sum, 0, 0, True, None)
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        native.synchronize()
        self._raise_if_failed()

    def _scratch_ptr(self) -> int:
        if self._scratch is None:
            # One int32 on the device, from the framework's allocator where one is loaded (it owns the memory
            # budget), else from the communicator's own 16 bytes.
            torch = sys.modules.get("torch")
            cupy = sys.modules.get("cupy")
            if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_available():
                t = torch.zeros(1, dtype=torch.int32, device=f"cuda:{self.ordinal}")
                self._scratch = (t, int(t.data_ptr()))
            elif cupy is not None:
                with cupy.cuda.Device(self.ordinal):
                    a = cupy.zeros(1, dtype=cupy.int32)
                self._scratch = (a, int(a.data.ptr))
            else:
                self._scratch = (None, int(self.impl.scratch()))
        return self._scratch[1]

    @contextlib.contextmanager
    def group(self):
        """ncclGroupStart/End around the block. The group is ended even when the block raises: NCCL's group depth is
        per thread and must balance (what was queued then launches)."""
        self._raise_if_failed()
        self.impl.group_start()
        try:
            yield
        finally:
            try:
                self.impl.group_end()
            except GpucollError as e:
                raise self._native_failed(e, self.impl.issued) from None

    def can_split(self) -> bool:
        """Whether split() can use ncclCommSplit: the loaded NCCL has it and this communicator is healthy."""
        return (not self._closed and self._error is None and self.impl.usable and self.impl.group_depth == 0
                and "ncclCommSplit" not in _nccl.load().get("missing_optional", ()))

    def split(self, color, key: int, store):
        """Collective over every rank (ncclCommSplit): the Nccl backend of this rank's child over `store`, or None
        for color None (which still takes part)."""
        self._raise_if_failed()
        try:
            child = self.impl.split(-1 if color is None else int(color), int(key))
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        return None if child is None else self._adopted(child, store, "ncclCommSplit")

    def can_shrink(self) -> bool:
        """Whether shrink() can use ncclCommShrink: the loaded NCCL has it and this communicator is healthy (no
        failure seen: NCCL_SHRINK_DEFAULT)."""
        return (not self._closed and self._error is None and self.impl.usable and self.impl.group_depth == 0
                and "ncclCommShrink" not in _nccl.load().get("missing_optional", ()))

    def shrink(self, gone: list, store):
        """Collective over the ranks not in `gone` (ncclCommShrink): this rank's Nccl backend among them."""
        self._raise_if_failed()
        try:
            child = self.impl.shrink([int(q) for q in gone])
        except GpucollError as e:
            raise self._native_failed(e, self.impl.issued) from None
        return self._adopted(child, store, "ncclCommShrink")

    def _adopted(self, child, store, origin: str):
        # The child's store is this one's under a prefix of its own (group.py): alike on the child's ranks only.
        key = _trace_key(f"{self._trace_key}/{origin}/{getattr(store, '_prefix', '')}/{child.nranks}".encode())
        made = Nccl(child, rank=child.rank, world_size=child.nranks, device=self.ordinal, store=store,
                    prefix="gpucoll/nccl/0/", timeout=self._timeout, trace_key=key)
        made.origin = origin
        return made

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        return "nccl"

    def trace(self, last: int) -> dict:
        return self.impl.trace(last)

    def trace_key(self) -> str:
        return self._trace_key

    def abort(self, reason: str = "abort() was called") -> None:
        self.impl.abort(reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        self._heartbeat.close()
        self.impl.close()
        with self._lock:
            self._inflight.clear()
        _LIVE.discard(self)

    # -- watchdog -------------------------------------------------------------------------------------------------
    def _watch_once(self) -> bool:
        """One watchdog step; False when the watchdog should stop."""
        try:
            st = self.impl.poll()
        except GpucollError as e:
            _log.debug(f"NCCL watchdog poll failed: {e}")
            return True
        self._prune()
        if not st["usable"]:
            return False
        now = time.monotonic()
        if st["issued"] != self._published and now - self._last_publish >= self._publish_s:
            self._publish(st["issued"])
        if st["async_error"]:
            pending = f"while {st['oldest_what']} was pending" if st["pending"] else "with no operation pending"
            self._fail(NcclError(f"NCCL reported an asynchronous error on rank {self.rank} (cuda:{self.ordinal}) "
                                 f"{pending}: {st['async_text']}; the NCCL communicator was aborted",
                                 call="ncclCommGetAsyncError"))
            return False
        if st["pending"] and st["oldest_age_s"] > self._timeout:
            self._on_timeout(st)
            return False
        return True

    def _prune(self) -> None:
        with self._lock:
            items = list(self._inflight.items())
        done = []
        for key, (work, _) in items:
            if work.done():  # finished, or failed: either way the GPU no longer reads the buffers
                done.append(key)
        if done:
            with self._lock:
                for key in done:
                    self._inflight.pop(key, None)

    def stragglers(self, reset: bool) -> dict:
        return self._arrivals.stats(reset)

    def _publish(self, issued: int) -> None:
        self._last_publish = time.monotonic()
        self._arrivals.publish()
        key, value = f"{self._prefix}seq/{self.rank}", str(int(issued)).encode()
        try:
            # Not behind a wait of this rank's main thread on the same store client (a barrier may take the whole
            # timeout): the watchdog would stall with it and name no timed-out operation. Tried again next poll.
            try_set = getattr(self._store, "try_set", None)
            if try_set is not None and not try_set(key, value):
                return
            if try_set is None:
                self._store.set(key, value)
            self._published = issued
        except Exception as e:  # noqa: BLE001 - the store may be gone (rank 0 exited); progress is best effort
            _log.debug(f"NCCL watchdog could not publish progress: {e}")

    def _missing_ranks(self, seq: int):
        """(ranks that had not issued operation `seq`, or None when unknown; a note for the message)."""
        self._publish(self.impl.issued)
        # Give the other ranks' watchdogs time to publish their latest counts.
        if self._stop.wait(2 * self._publish_s + self._poll_s):
            return None, "(the communicator was closed while looking)"
        missing = []
        try:
            for r in range(self.world_size):
                key = f"{self._prefix}seq/{r}"
                if not self._store.check(key) or int(self._store.get(key, timeout=5.0)) < seq:
                    missing.append(r)
        except Exception as e:  # noqa: BLE001
            return None, f"(could not read the other ranks' progress from the rendezvous store: {e})"
        return missing, ""

    def _on_timeout(self, st: dict) -> None:
        seq, what = int(st["oldest_seq"]), st["oldest_what"]
        head = (f"{what} did not complete within the timeout of {self._timeout:g} s on rank {self.rank} of "
                f"{self.world_size} (cuda:{self.ordinal})")
        if what.startswith(("send", "recv")):
            # Ranks issue different numbers of sends and receives, so counts say nothing here: name the peer.
            peer = re.search(r"rank (\d+)\)$", what)
            body = (f"its peer, rank {peer.group(1)}, did not post the matching operation in time" if peer else
                    "its peers did not post the matching operations in time")
            self._fail(CollectiveTimeout(f"{head}; {body}; the NCCL communicator was aborted",
                                         call=what.split(" ", 1)[0], ranks=(int(peer.group(1)),) if peer else ()))
            return
        missing, note = self._missing_ranks(seq)
        if missing:
            shown = ", ".join(map(str, missing[:64])) + (", ..." if len(missing) > 64 else "")
            body = f"ranks that had not reached operation #{seq}: [{shown}]"
        elif missing is not None:
            body = (f"every rank had issued operation #{seq}, so it is stuck on the GPU side (an earlier kernel that "
                    f"does not finish, a rank stuck in CUDA, or a network failure)")
        else:
            body = f"which ranks had not reached operation #{seq} is unknown {note}"
        self._fail(CollectiveTimeout(f"{head}; {body}; the NCCL communicator was aborted",
                                     call=what.split(" ", 1)[0], ranks=missing or ()))


def _watchdog_main(ref, stop: threading.Event, interval: float) -> None:
    # Holds the backend only while it works on it, so an unreferenced communicator can still be collected.
    while not stop.wait(interval):
        backend = ref()
        if backend is None:
            return
        try:
            keep_going = backend._watch_once()
        except Exception as e:  # noqa: BLE001 - the watchdog must never die silently
            _log.warn(f"NCCL watchdog step failed: {type(e).__name__}: {e}")
            keep_going = True
        del backend
        if not keep_going:
            return


# -- bootstrap ------------------------------------------------------------------------------------------------------

def init_backend(launch, store, timeout: float, device=None, local_size: int = 0) -> Nccl:
    """This rank's nccl backend: rank 0 makes the unique id and publishes it through `store`; every rank
    creates its communicator non-blocking, with `timeout` covering the init."""
    check_usable()
    probe = _C.cuda_probe()
    nccl = _nccl.load()
    shared_ok = multi_rank_enabled(nccl["version"])
    dev = pick_device(launch.local_rank, device, int(probe["device_count"]), shared_ok)
    # Several communicators may be built over one store (torch's, or repeated inits): each gets its own keys.
    generation = (store.add("gpucoll/nccl/count", 1) - 1) // launch.world_size
    prefix = f"gpucoll/nccl/{generation}/"
    store.set(f"{prefix}joined/{launch.rank}", flight_recorder.whoami())  # [host, pid]: a hang report's last resort
    if launch.rank == 0:
        uid = _C.nccl_unique_id()
        store.set(f"{prefix}uid", uid)
    else:
        uid = store.get(f"{prefix}uid", timeout=timeout)
    try:
        comm = _C.NcclComm(uid, launch.world_size, launch.rank, dev, float(timeout))
    except CollectiveTimeout as e:
        missing = []
        try:
            missing = [r for r in range(launch.world_size) if not store.check(f"{prefix}joined/{r}")]
        except Exception as store_error:  # noqa: BLE001 - the store may be unreachable; the timeout is the error
            _log.debug(f"could not read who joined the NCCL init: {store_error}")
        extra = f"; ranks that never started it: {missing}" if missing else ""
        raise CollectiveTimeout(e.message + extra, call=e.call, location=e.location, ranks=missing) from None
    if config.get_bool("GPUCOLL_NCCL_BLOCKING_OPS") and launch.world_size > 1:
        _split_blocking(comm, launch, store, prefix, timeout)
    _log.debug(f"NCCL communicator: rank {launch.rank}/{launch.world_size} on cuda:{dev}")
    return Nccl(comm, rank=launch.rank, world_size=launch.world_size, device=dev, store=store, prefix=prefix,
                timeout=timeout, trace_key=_trace_key(bytes(uid)), local_size=local_size)


def _trace_key(seed: bytes) -> str:
    """A communicator's name in flight-recorder dumps: hashed from what its ranks share (NCCL's unique id, random),
    as it goes into file names and store keys."""
    return "nccl-" + hashlib.sha256(seed).hexdigest()[:16]


def _split_blocking(comm, launch, store, prefix: str, timeout: float) -> None:
    """GPUCOLL_NCCL_BLOCKING_OPS: operations on a blocking communicator split off the non-blocking one.

    The split is polled under the timeout like init; it starts once every rank finished its init (a store barrier
    under the same timeout), so that a rank that never got there is named rather than waited for inside NCCL."""
    try:
        store.barrier(f"{prefix}ready", launch.world_size, timeout=timeout, rank=launch.rank)
    except CollectiveTimeout as e:
        comm.abort("a rank did not finish NCCL init")
        raise CollectiveTimeout(f"NCCL init (GPUCOLL_NCCL_BLOCKING_OPS=1, before the blocking split): {e.message}",
                                call="ncclCommSplit", ranks=e.ranks) from None
    try:
        comm.split_blocking()
    except Unsupported as e:  # NCCL < 2.18: raised before any NCCL call, on every rank alike
        _log.warn(f"GPUCOLL_NCCL_BLOCKING_OPS=1 has no effect: {e.message}")
