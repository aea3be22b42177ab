"""The custom backend: gpucoll's own allreduce kernels over peer memory
(``csrc/backends/custom/kernels/{one_shot,two_shot,ring,tree}.cu``), with NCCL for everything they do not cover.

Each rank allocates a staging buffer (two halves of ``GPUCOLL_CUSTOM_BUFFER_BYTES``) and a signal area on its GPU,
publishes the CUDA IPC handle through the rendezvous store, and maps every peer's. Ranks may share a GPU (P
processes on one device: correct but slow, since spinning kernels only progress when the GPU switches between
processes); ``gpucoll.testing.virtual_ranks`` runs P ranks in one process instead.

Per call, an allreduce runs on the custom kernels when it is eligible (csrc/backends/custom/eligibility.h: same
node, P2P proven by a real copy at set-up, dtype float32/float16/bfloat16/float64/int32, op sum/min/max/avg),
checked, its algorithm chosen and the kernel enqueued in one native call (``CustomComm.run_all_reduce``); otherwise
the reason is logged once (INFO) and NCCL runs the call, or ``Unsupported`` is raised when
``GPUCOLL_CUSTOM_NCCL_FALLBACK=0`` or NCCL is unavailable. Every fact in the decision is the same on every rank, so
ranks never split between backends. ``stats`` counts the calls each path ran.

Registration (zero copy): ``register(x)`` is collective (every rank, same order) and makes later calls whose
input is exactly ``x`` read every rank's input in place. Inside ``graph_capture()``, inputs first seen during
capture are registered when the block exits (``register_graph_buffers``), so replays read in place too; captured
calls outside that block stage their input inside the kernel, which also works under graphs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket

from gpucoll import _cuda_buffers, _log, _nccl, config, flight_recorder
from gpucoll._native import _C
from gpucoll.backends import nccl, select
from gpucoll.backends.base import ALL_REDUCE, BLOCKED, FAST_OPS, Backend, plain_cuda_array
from gpucoll.backends.premul import PreMulSum
from gpucoll.backends.usable import CUSTOM_ALGORITHMS as ALGORITHMS
from gpucoll.backends.usable import MULTI_RANK_ENV, pick_device
from gpucoll.backends.usable import check_custom_usable as check_usable
from gpucoll.backends.usable import custom_problems as problems
from gpucoll.backends.usable import custom_takes_auto as takes_auto
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage, Unsupported

# This module's own names for its checks, which live in usable.py (below every backend); tests and tools use them.
__all__ = ["ALGORITHMS", "Custom", "check_usable", "half_bytes", "init_backend",
           "problems", "resolve_algo", "spawn_plan", "takes_auto"]

_ALL_REDUCE = 0


def spawn_plan(nranks: int, env=None):
    """(backend, extra worker environment) for ``gpucoll.spawn(backend='custom')``: ranks beyond the GPU count
    share GPUs, and NCCL (the fallback) is told it may do the same."""
    check_usable(f"gpucoll.spawn(backend='custom', nranks={nranks})")
    count = int(_C.cuda_probe()["device_count"])
    extra = {}
    if nranks > count:
        extra[MULTI_RANK_ENV] = "1"
    return "custom", extra


def half_bytes() -> int:
    size = int(config.get_bytes("GPUCOLL_CUSTOM_BUFFER_BYTES"))
    if size < 4096:
        raise InvalidArgument(f"GPUCOLL_CUSTOM_BUFFER_BYTES must be at least 4K; got {size}")
    return size // 256 * 256


def resolve_algo(algo, nbytes: int, nranks: int) -> str:
    if algo is None or algo == "auto":
        return _C.custom_choose_algo(nbytes, nranks)
    if not isinstance(algo, str):
        raise InvalidArgument(f"algo must be 'auto' or one of oneshot, twoshot, ring, tree; got {algo!r}")
    return _C.custom_algo_name(algo)


class Custom(Backend):
    """backend='custom': each collective goes to our kernels or to NCCL, as the topology-aware selector (select.py,
    built at set-up) or ``algo=`` decides. `impl` is this rank's gpucoll._C.CustomComm; the NCCL fallback (send/recv,
    groups, barrier and what the kernels decline run there) is an nccl backend this one holds. It takes CUDA buffers.

    It holds NCCL and does not extend the nccl backend: a subclass inherited the nccl backend's split and shrink,
    which do not apply to the custom kernels (85994ba). A child gets new peer memory and its own NCCL fallback, a
    fresh create over the child's store: Backend's can_split and can_shrink (False) say so."""

    name = "custom"
    on_gpu = True

    def __init__(self, native, *, rank, world_size, device, store, prefix, timeout, hosts, p2p, nccl, nccl_why,
                 placement: str = "", trace_key: str = "", who=None):
        """`device`: the CUDA device ordinal (``ordinal``; Backend.device is its "cuda:N"). `nccl`: the fallback's
        nccl backend, or None (`nccl_why` says why). `placement`: why the kernels can never run on this
        communicator ('' when they can), as CustomComm.set_placement settled it at set-up."""
        super().__init__(native, rank=rank, world_size=world_size)
        self._trace_key = trace_key  # the communicator's name in flight-recorder dumps, alike on every rank
        self._who = list(who or [None] * world_size)  # [host, pid] of every rank, for the hang report
        self.ordinal = device
        self._store, self._prefix, self._timeout = store, prefix, float(timeout)
        self._hosts, self._p2p = list(hosts), list(p2p)
        self._nccl, self._nccl_why = nccl, nccl_why
        self._sum = _C.RedOp.sum
        self._logged: set = set()
        self._exchanges = 0
        # Registered buffers stay alive as long as the communicator: registration is keyed by address, so a freed
        # buffer whose address the allocator hands out again would be read by peers as if it were still registered.
        self._registered = []
        self._closed = False
        self._broken = False
        self.stats = {"custom": 0, "nccl": 0}
        self.static_reason = placement
        if self.static_reason:
            _log.warn(f"custom backend: its kernels cannot run on this communicator ({self.static_reason}); "
                      f"{'NCCL runs every call' if nccl is not None else 'calls will raise Unsupported'}")

    @classmethod
    def create(cls, launch, store, *, timeout: float, local_size: int, device, chosen: bool = False):
        backend = init_backend(launch, store, timeout, device)
        try:
            backend.selector = select.build(store, launch.rank, launch.world_size, device=backend.ordinal,
                                            local_size=local_size, avail=backend.availability(),
                                            p2p_failed=backend.p2p_failed_pairs(), timeout=timeout)
        except BaseException:
            backend.close()
            raise
        backend.local_size, backend.chosen = local_size, chosen
        return backend

    @property
    def native(self):
        """gpucoll._C.CustomComm (tests and tools)."""
        return self.impl

    @property
    def device(self) -> str:
        return f"cuda:{self.ordinal}"

    def check_buffer(self, buf, arg: str) -> None:
        _cuda_buffers.check_device(buf, arg, self.ordinal)

    def check_timeout(self) -> None:
        """Where the kernels are known to have finished: a timed-out wait (CollectiveTimeout, the communicator is
        unusable), or a call the kernels found mismatched across ranks (InvalidArgument; it moved no data and the
        communicator stays usable)."""
        if self.impl.timed_out():
            # Every later wait of this communicator gives up at once (the flag stays set): refuse further calls
            # instead of returning garbage.
            self._broken = True
            late = list(self.impl.late_ranks())
            err = CollectiveTimeout(f"a custom allreduce on rank {self.rank} (cuda:{self.ordinal}) waited longer than "
                                    f"{self._timeout:g} s for rank(s) {late} (their kernels never arrived); its "
                                    f"results are invalid and the communicator is unusable", call="all_reduce",
                                    ranks=late)
            # The hang report (where every rank is, and the dump), here where the timeout is found: the Work or the
            # barrier that finds it raises past the Communicator.
            flight_recorder.on_failure(flight_recorder.Source(self.rank, self.world_size, self._timeout, "custom",
                                                              self.trace, self.trace_key, self.peer_states,
                                                              lambda r: self._who[r]),
                                       self._store, err)
            raise err
        self.impl.check_calls()

    # -- the flight recorder and stragglers -----------------------------------------------------------------------
    def trace(self, last: int) -> dict:
        """The kernels' calls (csrc/backends/custom/cuda/kernel_trace.h: enqueue time on the host; start, end and
        state as the device recorded them) and, merged by enqueue time, the NCCL fallback's, whose names carry
        "nccl:" (the two number their collectives apart, alike on every rank, so each keeps its numbers)."""
        t = self.impl.trace(last)
        if self._nccl is None:
            return t
        other = self._nccl.trace(last)
        for e in other["entries"]:
            e["op"] = f"nccl:{e['op']}"
        entries = sorted(t["entries"] + other["entries"], key=lambda e: e["enqueue_ns"])
        t["entries"] = entries[-last:] if last > 0 else entries
        t["capacity"] += other["capacity"]
        t["recorded"] += other["recorded"]
        return t

    def trace_key(self) -> str:
        return self._trace_key

    def stragglers(self, reset: bool) -> dict:
        """The kernels' own measure (barrier 0 of each call; NCCL fallback calls are not in it)."""
        return self.impl.stragglers(bool(reset))

    def peer_states(self):
        """Where every rank's kernels are, read from its own ring through the IPC mapping (so a rank that cannot
        answer is seen too), with its process: HostComm.peer_states' shape, numbered as the kernels' calls. None
        where some rank's ring is not readable here (its recorder off, another node)."""
        here = socket.gethostname()
        procs = [flight_recorder.proc_state(int(w[1])) if w and w[0] == here else "" for w in self._who]
        # A dead rank's memory may be gone under its mapping: its ring is not read (the kernels never touch it).
        calls = self.impl.peer_calls([r for r, p in enumerate(procs) if p == "exited"])
        out = []
        for r, c in enumerate(calls):
            if c is None and procs[r] != "exited":
                return None
            c = c or {"entered": 0, "done": None, "in_for_s": 0.0, "done_ago_s": 0.0}  # dead: not read
            out.append({"pid": int(self._who[r][1]) if procs[r] else 0, "exited": procs[r] == "exited",
                        "proc": procs[r], "broken": False, "entered": c["entered"], "in_coll": 0,
                        "in_for_s": c["in_for_s"], "done": c["done"], "done_coll": 0, "done_ago_s": c["done_ago_s"],
                        "in_p2p": False, "device": True, "where": f"its GPU is still in all_reduce #{c['entered']}"})
        return out

    # -- calls ----------------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidUsage("the custom backend is closed")
        if self._broken:
            raise InvalidUsage("a custom allreduce of this communicator timed out waiting for a peer; the "
                               "communicator is unusable: close it and create a new one")

    def _stream(self, stream, src, dst):
        """The stream a call runs on: stream=, else the arrays' own (the caller's current one), ordered after it."""
        return _cuda_buffers.op_stream(self.ordinal, stream, src, dst if dst is not src else None)

    def _enqueued(self, s, async_op: bool, kind: str):
        """A call the kernels took on stream `s`: counted, and its Work for async_op."""
        self.stats["custom"] += 1
        if not async_op:
            return None
        # A CUDA event after the call; synchronize() then reads the kernels' timeout flag (check_timeout), which only
        # a finished call can have set.
        return _C.Work.after_stream(s, kind, self.ordinal, "custom all_reduce", self.check_timeout)

    def _modelled(self) -> bool:
        """Whether the selector decides: 'custom' asked where the GPU topology is unknown (no NVML) leaves each call
        to the backend's own size rule."""
        sel = self.selector
        return sel is not None and (sel.gpus is not None or self.chosen)

    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        if not self._modelled():
            algo = algo[7:] if isinstance(algo, str) and algo.startswith("custom:") else algo
            return self._run(coll, src, dst, count, redop, root, stream, async_op, algo)
        nbytes = count * src.itemsize * (self.world_size if coll in BLOCKED else 1)  # the selector counts it so
        choice = self.selector.choose(coll, nbytes, src.dtype_name, algo, backend="auto" if self.chosen else "custom")
        if choice.backend == "custom":
            return self._run(coll, src, dst, count, redop, root, stream, async_op, choice.algorithm)
        return self.nccl_collective(choice.reason, coll, src, dst, count, redop, root, stream, async_op)

    def _run(self, coll: int, src, dst, count: int, redop, root: int, stream, async_op: bool, algo):
        """The kernels where they take the call (`algo`: theirs or 'auto'), else NCCL with the reason logged."""
        self._check_usable()
        if coll != _ALL_REDUCE:
            reason = f"{_C.coll_names()[coll]} has no custom kernel (they do all_reduce)"
            return self._fallback(reason, coll, src, dst, count, redop, root, stream, async_op)
        if algo is None:
            algo = "auto"
        elif not isinstance(algo, str):
            raise InvalidArgument(f"algo must be 'auto' or one of oneshot, twoshot, ring, tree; got {algo!r}")
        premul = type(redop) is PreMulSum
        s = self._stream(stream, src, dst)
        # Eligibility, algorithm and launch in one crossing (CustomComm::run_all_reduce); a misaligned pointer, a
        # per-rank fact that would split the ranks between two backends, raises there instead of declining.
        reason = self.impl.run_all_reduce(src.ptr, dst.ptr, count, src.dtype,
                                          self._sum if premul or redop is None else redop, premul, algo, s)
        if reason:
            return self._fallback(reason, coll, src, dst, count, redop, root, stream, async_op)
        return self._enqueued(s, async_op, src.kind)

    def compressed_all_reduce(self, src, dst, redop, compress: str, stream, async_op: bool):
        """all_reduce(compress=...) on the kernels (backends/custom/kernels/compressed.cu); no NCCL fallback: NCCL
        has no compressed path, so where the kernels cannot run this raises Unsupported saying why."""
        self._check_usable()
        if type(redop) is PreMulSum:
            raise InvalidArgument(f"compress={compress!r} reduces with op sum or avg only; got premul_sum")
        s = self._stream(stream, src, dst)
        self.impl.compressed_all_reduce(src.ptr, dst.ptr, src.count, src.dtype, redop, compress, s)
        return self._enqueued(s, async_op, src.kind)

    def fast_all_reduce(self, x, op, algo, stream, async_op) -> bool:
        """all_reduce(x) in place, sync, algo 'auto', on x's own stream, of an array that only exports
        __cuda_array_interface__: one native call, the selector's answer for its size and dtype read from a table
        (Selector.fast_choices) that this fills the first time a size bucket is seen. Where the answer is NCCL, the
        fallback's own one-call path. False where anything else was asked or a native call declines; the general
        path then runs the call, with its errors and its fallback's log."""
        if stream is not None or async_op is not False or type(op) is not str or algo != "auto":
            return False
        redop = FAST_OPS.get(op)
        if redop is None or not plain_cuda_array(x):
            return False
        choices = self.selector.fast_choices if self._modelled() else None
        for _ in range(2):  # at most one table miss: the second call finds the key
            done = self.all_reduce_array(x, redop, choices)
            if type(done) is not int:
                break
            if not self._fill(choices, done):
                return False
        if done == "nccl":
            return self.nccl_all_reduce_array(x, redop)
        return done is True

    def _fill(self, choices: dict, key: int) -> bool:
        """The selector's answer for all_reduce of dtype key // 64 in the size bucket 2 ** (key % 64) into
        `choices`; False (the general path then asks, and raises) where the selector refuses."""
        try:
            dtype = _C.DType(key // 64).name
            choice = self.selector.choose(ALL_REDUCE, 1 << (key % 64), dtype, "auto",
                                          backend="auto" if self.chosen else "custom")
        except Exception:  # noqa: BLE001 - the general path asks the same question and raises the typed error
            return False
        choices[key] = choice.algorithm if choice.backend == "custom" else None
        if choice.backend != "custom":
            self.log_fallback("all_reduce", choice.reason)
        return True

    def all_reduce_array(self, x, redop, choices) -> object:
        """all_reduce(x) in place of a plain __cuda_array_interface__ array, sync, algo auto, in one native call
        (CustomComm.all_reduce_array, which documents `choices` and what it returns): True when it ran on the
        kernels; "nccl", a table key or False, with nothing enqueued, otherwise."""
        if self._closed or self._broken:
            return False  # the general path raises why
        done = self.impl.all_reduce_array(x, redop, choices)
        if done is True:
            self.stats["custom"] += 1
        return done

    def nccl_all_reduce_array(self, x, redop) -> bool:
        """The selector gave this all_reduce to NCCL (its reason logged when the table was filled): the fallback's
        one-call path (Nccl.all_reduce_array)."""
        if self._nccl is None or self._closed:
            return False  # the general path raises why
        done = self._nccl.all_reduce_array(x, redop)
        if done:
            self.stats["nccl"] += 1
        return done

    def log_fallback(self, coll_name: str, reason: str) -> None:
        """Once per distinct reason: why NCCL runs a call."""
        if reason not in self._logged:
            self._logged.add(reason)
            _log.info(f"custom backend: NCCL runs {coll_name}: {reason}")

    def _require_nccl(self, what: str):
        if self._nccl is None:
            raise Unsupported(f"the custom backend cannot run {what}, and it has no NCCL fallback: {self._nccl_why}")
        return self._nccl

    def nccl_collective(self, reason, coll, src, dst, count, redop, root, stream, async_op):
        """A call the selector gave NCCL (`reason`: the model's, logged once per distinct reason)."""
        if self._closed:
            raise InvalidUsage("the custom backend is closed")
        return self._fallback(reason, coll, src, dst, count, redop, root, stream, async_op)

    # -- what the selector needs (select.py) ----------------------------------------------------------------------
    def availability(self):
        """This rank's backends for the selector: our kernels (all_reduce ones), and NCCL when it was set up."""
        return select.probe_availability(nccl=True if self._nccl is not None else self._nccl_why, custom=True,
                                          custom_algorithms=ALGORITHMS)

    def p2p_failed_pairs(self) -> list:
        """Rank pairs on one host whose real-copy P2P probe failed (the agreed matrix every rank holds)."""
        P = self.world_size
        return [(a, b) for a in range(P) for b in range(a + 1, P)
                if self._hosts[a] == self._hosts[b] and not (self._p2p[a * P + b] and self._p2p[b * P + a])]

    def _fallback(self, reason, coll, src, dst, count, redop, root, stream, async_op):
        nccl = self._require_nccl(f"this call ({reason})")
        self.log_fallback(_C.coll_names()[coll], reason)
        self.stats["nccl"] += 1
        return nccl.collective(coll, "auto", src, dst, count, redop, root, stream, async_op)

    def p2p(self, send: bool, peer: int, buf, stream=None, async_op=False):
        return self._require_nccl("send/recv").p2p(send, peer, buf, stream, async_op)

    def group(self):
        return self._require_nccl("group()").group()

    def barrier(self) -> None:
        """Every rank's GPU work issued so far is done, then a store barrier."""
        self.impl.synchronize()
        self.check_timeout()
        self._store.barrier(self._key("barrier"), self.world_size, timeout=self._timeout, rank=self.rank)

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        if not self._modelled():
            return "custom"
        choice = self.selector.choose(coll, nbytes, dtype, algo, backend="auto" if self.chosen else "custom")
        return f"custom:{choice.algorithm}" if choice.backend == "custom" else "nccl"

    def registrar(self, what: str):
        return self

    # -- registration ---------------------------------------------------------------------------------------------
    def _key(self, what: str) -> str:
        self._exchanges += 1
        return f"{self._prefix}{what}/{self._exchanges}"

    def _allgather(self, what: str, value) -> list:
        """Every rank's `value` (JSON-able) through the store, in rank order."""
        key = self._key(what)
        self._store.set_json(f"{key}/{self.rank}", value)
        return [self._store.get_json(f"{key}/{r}", timeout=self._timeout) for r in range(self.world_size)]

    def register(self, buf) -> None:
        """Collective: map every rank's `buf` into every rank (see the module docstring)."""
        handle, offset = self.impl.export_buffer(buf.ptr)
        rows = self._allgather("register", [handle.hex(), int(offset), int(buf.nbytes)])
        sizes = {row[2] for row in rows}
        if len(sizes) != 1:
            raise InvalidArgument(f"register needs a buffer of the same size on every rank; got sizes {sorted(sizes)}")
        self.impl.register_ipc(buf.ptr, buf.nbytes, [(bytes.fromhex(h), off) for h, off, _ in rows])
        self._registered.append(buf.obj)

    def register_graph_buffers(self) -> int:
        """Collective: register the inputs first seen during graph capture; returns how many."""
        pending = self.impl.pending()
        mine = []
        for ptr, _nbytes in pending:
            handle, offset = self.impl.export_buffer(ptr)
            mine.append([handle.hex(), int(offset)])
        rows = self._allgather("graph", mine)
        counts = {len(row) for row in rows}
        if len(counts) != 1:
            raise InvalidUsage(f"ranks captured different numbers of new buffers ({[len(r) for r in rows]}); every "
                               f"rank must capture the same calls")
        self.impl.register_pending_ipc([[(bytes.fromhex(rows[q][i][0]), rows[q][i][1])
                                            for q in range(self.world_size)] for i in range(len(pending))])
        return len(pending)

    @contextlib.contextmanager
    def graph_capture(self):
        self.impl.set_defer_registration(True)
        try:
            yield
        finally:
            self.impl.set_defer_registration(False)
        self.register_graph_buffers()

    # -- teardown -------------------------------------------------------------------------------------------------
    def abort(self, reason: str = "abort() was called") -> None:
        if self._nccl is not None:
            self._nccl.abort(reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.impl.synchronize()
            # No rank frees (and unmaps) memory a peer may still read: everyone's kernels finished first.
            self._store.barrier(f"{self._prefix}close", self.world_size, timeout=min(self._timeout, 60.0),
                                rank=self.rank)
        except Exception as e:  # noqa: BLE001 - teardown never raises; a dead peer cannot read anything anyway
            _log.debug(f"custom backend close: {e}")
        self.impl.close()
        self._registered.clear()
        if self._nccl is not None:
            self._nccl.close()


def _shared_gpu_problems(places) -> list:
    """Why NCCL cannot run beside the custom kernels on these ranks' (host, GPU) places: [] or one sentence."""
    if len(set(places)) == len(places):
        return []
    loaded = _nccl.load()
    if nccl.multi_rank_enabled(int(loaded.get("version") or 0)):
        return []
    return [(f"ranks share a GPU, which NCCL allows only from {nccl.version_text(_C.NCCL_MULTI_RANK_GPU_VERSION)} "
             f"with {MULTI_RANK_ENV}=1 (the loaded NCCL is {loaded.get('version_string') or loaded.get('version')}, "
             f"{MULTI_RANK_ENV}={os.environ.get(MULTI_RANK_ENV, '')!r})")]


def _mps_control_pipe() -> str | None:
    """The CUDA MPS control pipe a client of this process would use, when it exists (the daemon is running)."""
    pipe = os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control")
    return pipe if os.path.exists(pipe) else None


def _time_slice_warning(rank: int, places, emulated: bool) -> str | None:
    """Why this rank's calls will be slow, when other processes share its GPU without MPS, or None. Without MPS the
    GPU runs one process's context at a time and switches on a time slice; kernels that spin on each other's flags
    then wait for the slice to turn on every call (measured on an H200: 4.5 ms per 8-byte allreduce of 2 processes,
    47 us under MPS; bench/results/h200-2026-11-27-second)."""
    mine = places[rank]
    sharing = [r for r, p in enumerate(places) if p == mine]
    if emulated or len(sharing) < 2 or _mps_control_pipe() is not None:
        return None
    return (f"custom backend: ranks {sharing} are separate processes on one GPU and no CUDA MPS daemon runs (no "
            f"control pipe in {os.environ.get('CUDA_MPS_PIPE_DIRECTORY') or '/tmp/nvidia-mps'}): the GPU time-slices "
            f"between them and every call waits for a slice (milliseconds). Start MPS first "
            f"(nvidia-cuda-mps-control -d), or run the ranks in one process (gpucoll.testing.virtual_ranks)")


def init_backend(launch, store, timeout: float, device=None) -> Custom:
    """This rank's custom backend, its selector not yet built (Custom.create): allocate, exchange IPC handles and SM counts through `store`, map the
    peers, prove P2P with a real copy, agree on the P2P matrix, and set up the NCCL fallback."""
    check_usable()
    P, rank = launch.world_size, launch.rank
    if P > _C.CUSTOM_MAX_RANKS:
        raise Unsupported(f"backend='custom' serves at most {_C.CUSTOM_MAX_RANKS} ranks; got world_size {P}")
    probe = _C.cuda_probe()
    dev = pick_device(launch.local_rank, device, int(probe["device_count"]), True)
    generation = (store.add("gpucoll/custom/count", 1) - 1) // P
    prefix = f"gpucoll/custom/{generation}/"
    native = _C.CustomComm(rank, P, dev, half_bytes(), float(timeout))
    try:
        devices = probe.get("devices") or []
        gpu = str(devices[dev].get("pci_bus_id") or dev) if dev < len(devices) else str(dev)  # the same GPU by any index
        store.set_json(f"{prefix}hello/{rank}", [socket.gethostname(), native.ipc_handle().hex(), native.sms,
                                                 native.half_bytes, gpu, os.getpid(), native.records_handle().hex(),
                                                 native.record_capacity])
        hello = [store.get_json(f"{prefix}hello/{r}", timeout=timeout) for r in range(P)]
        halves = [int(h[3]) for h in hello]
        if len(set(halves)) != 1:
            # Every rank must cut a call into the same pieces: the kernels compare each piece's call, not its length.
            raise InvalidArgument(f"every rank needs the same GPUCOLL_CUSTOM_BUFFER_BYTES; the ranks' staging halves "
                                  f"are {halves} bytes")
        hosts = [h[0] for h in hello]
        if len(set(hosts)) == 1:
            here = (hello[rank][0], hello[rank][4])
            native.connect_ipc([bytes.fromhex(h[1]) for h in hello], min(int(h[2]) for h in hello),
                               sum(1 for h in hello if (h[0], h[4]) == here))
            native.connect_records([bytes.fromhex(h[6]) for h in hello], [int(h[7]) for h in hello])
            row = list(native.p2p_row)
        else:
            row = [0] * P  # other nodes: nothing to map; eligibility names the nodes
        store.set_json(f"{prefix}p2p/{rank}", row)
        p2p = []
        for r in range(P):
            p2p += list(store.get_json(f"{prefix}p2p/{r}", timeout=timeout))
        # The placement half of eligibility (nodes, P2P), settled once: run_all_reduce checks each call's half.
        placement = native.set_placement(hosts, p2p)
        fallback, why = None, "GPUCOLL_CUSTOM_NCCL_FALLBACK=0"
        if config.get_bool("GPUCOLL_CUSTOM_NCCL_FALLBACK"):
            # Every rank decides from the same table, so all of them build NCCL or none does (its init is
            # collective). Ranks sharing a GPU need NCCL's multi-rank mode: without it ncclCommInitRank fails
            # ("Duplicate GPU detected") and would take the custom kernels, which share GPUs fine, down with it.
            found = nccl.problems() or _shared_gpu_problems([(h[0], h[4]) for h in hello])
            if found:
                why = "; ".join(found)
            else:
                fallback = nccl.init_backend(launch, store, timeout, dev)
    except BaseException:
        native.close()
        raise
    slow = _time_slice_warning(rank, [(h[0], h[4]) for h in hello], bool(probe.get("emulated")))
    if slow and rank == min(r for r, h in enumerate(hello) if (h[0], h[4]) == (hello[rank][0], hello[rank][4])):
        _log.warn(slow)
    _log.debug(f"custom communicator: rank {rank}/{P} on cuda:{dev}, {native.sms} SMs, P2P row {row}")
    key = "custom-" + hashlib.sha256(json.dumps([prefix, hello]).encode()).hexdigest()[:16]  # every IPC handle
    return Custom(native, rank=rank, world_size=P, device=dev, store=store, prefix=prefix, timeout=timeout,
                  hosts=hosts, p2p=p2p, nccl=fallback, nccl_why=why, placement=placement, trace_key=key,
                  who=[[h[0], h[5]] for h in hello])
