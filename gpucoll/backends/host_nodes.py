"""The host backend when its ranks run on several machines: shared memory inside each machine, an engine between
them (torch's gloo, or MPI where the job was launched under MPI: host_engines.py).

gpucoll's host schedules (csrc/backends/host/) work through one shared-memory region, so they reach the ranks of one
machine only. Between machines this backend uses an engine that already moves CPU buffers over the network rather
than a transport of gpucoll's own. Without one (no torch, and not launched under MPI with mpi4py), a job across
machines cannot run, and the backend says so when it is built.

The reductions run in three steps (the hierarchical all-reduce of the seed notes): the ranks of each machine reduce
into its first rank (the leader) through shared memory, the leaders combine their machines' results through the
engine, and each leader broadcasts the result to its machine through shared memory. So the network carries one
copy per machine, not one per rank, and every rank ends with the leader's bits: the same result everywhere.
Reductions are exact on exact inputs, in a different order from the one-machine schedules (machine by machine). avg
is NCCL's: floating types scale every input by NCCL's 1/n for the whole world before the sum, integer types divide
the finished sum, truncating. Broadcast runs the same way in reverse. The other collectives (all-gather, all-to-all,
gather, scatter, send and receive) go through the engine over every rank, reduce-scatter through the all-reduce.

Every call is checked across the machines before data moves: a call that differs between ranks raises
InvalidArgument on every rank instead of letting the engine pair unrelated buffers (see _all_reduce and _agree).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import socket
import time

import numpy as np

from gpucoll import _buffers
from gpucoll._native import _C
from gpucoll.backends import base
from gpucoll.backends import host_engines as engines
from gpucoll.backends.base import ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, Backend
from gpucoll.bootstrap.prefix import PrefixStore
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, RemoteError, Unsupported

_NAMES = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", REDUCE: "reduce", base.ALL_GATHER: "all_gather",
          REDUCE_SCATTER: "reduce_scatter", base.ALL_TO_ALL: "all_to_all", base.GATHER: "gather",
          base.SCATTER: "scatter"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
# The leaders' exchange of every reduction: 64 bytes of header (the call's signature, and the ranks of this machine
# that made different calls, if any) and, where it fits, the machine's partial result. 4 KiB: results up to 4032
# bytes (a thousand float32) cost one exchange between machines, and the fixed size costs a few microseconds.
_RECORD_BYTES, _HEADER_BYTES = 4096, 64
# How long survivors wait for each other's roll call after a timeout between machines, to name the silent ones.
_ROLL_CALL_S = 0.5


def engine_missing(hosts: list, mpi) -> str | None:
    """Why this process cannot run the host backend across `hosts` (None when it can)."""
    if mpi is not None or engines.gloo_available():
        return None
    names = sorted(set(hosts))
    return (f"the host backend's ranks run on {len(names)} machines ({', '.join(names[:4])}"
            f"{' ...' if len(names) > 4 else ''}); between machines it moves data through torch's gloo, or through "
            f"MPI when launched under MPI with mpi4py installed, and neither is available here (pip install torch)")


def _scratch(buf, count: int):
    """A CPU buffer of `count` elements of `buf`'s dtype."""
    arr = np.empty(count * buf.itemsize, dtype=np.uint8)
    return _buffers.Buffer(arr, "numpy", arr.ctypes.data, count, buf.dtype, buf.dtype_name, buf.itemsize, (count,),
                           "cpu")


class HostNodes(Backend):
    """backend='host' with ranks on several machines: the machine's own host backend (`local`) and gloo (`leaders`
    among the machines' first ranks, `world` among every rank)."""

    name = "host"

    def __init__(self, local, leaders, world, *, rank: int, world_size: int, hosts: list, addresses: dict,
                 store=None, prefix: str = ""):
        super().__init__(local.impl, rank=rank, world_size=world_size, local_size=local.world_size)
        self._store, self._prefix = store, prefix
        self.local, self.leaders, self.world = local, leaders, world
        self.hosts = hosts  # by rank
        self.machines = list(dict.fromkeys(hosts))  # in order of their first rank
        self.node = self.machines.index(hosts[rank])
        self.first = [hosts.index(m) for m in self.machines]  # every machine's leader (its first rank)
        self._addresses = addresses  # IP address -> the ranks of that machine, to name a lost peer
        self._local_ranks = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        self._seq = 0
        self._group = None
        self.algo = f"hierarchical:shm+{world.name}"

    @classmethod
    def create(cls, launch, store, *, timeout: float, hosts: list, prefix: str, make_local):
        """Every rank together; `hosts`: every rank's host name; `make_local(launch, store, timeout)`: the host
        backend over this machine's ranks."""
        mpi = engines.mpi_world(launch.world_size, launch.rank)
        why = engine_missing(hosts, mpi)
        if why is not None:
            raise Unsupported(why)
        machines = list(dict.fromkeys(hosts))
        mine = [r for r, h in enumerate(hosts) if h == hosts[launch.rank]]
        node = machines.index(hosts[launch.rank])
        local_launch = _LocalLaunch(mine.index(launch.rank), len(mine))
        # The machine's own communicator waits longer than the engine does: a rank waiting on its leader, which
        # waits on the network, then hears the leader's verdict (which names the lost machine) instead of timing out
        # first and naming the leader. A leader that died is seen at once all the same (its process is gone).
        local = make_local(local_launch, PrefixStore(store, f"{prefix}machine{node}/"), timeout + _ROLL_CALL_S + 1.0)
        leading = mine[0] == launch.rank
        if mpi is not None:
            world = engines.Mpi(mpi)
            # Split is collective over every rank; the others get MPI's null communicator and drop it.
            split = mpi.Split(0 if leading else 1, launch.rank)
            leaders = engines.Mpi(split) if leading else None
        else:
            world = engines.Gloo(PrefixStore(store, f"{prefix}gloo/world/"), launch.rank, launch.world_size, timeout)
            leaders = (engines.Gloo(PrefixStore(store, f"{prefix}gloo/leaders/"), node, len(machines), timeout)
                       if leading else None)
        addresses = {}
        for m in machines:
            with contextlib.suppress(OSError):
                addresses.setdefault(socket.gethostbyname(m), []).extend(r for r, h in enumerate(hosts) if h == m)
        return cls(local, leaders, world, rank=launch.rank, world_size=launch.world_size, hosts=hosts,
                   addresses=addresses, store=store, prefix=prefix)

    @property
    def device(self) -> str:
        return "cpu"

    def check_buffer(self, buf, arg: str) -> None:
        self.local.check_buffer(buf, arg)

    def check_out(self, src, dst) -> None:
        self.local.check_out(src, dst)

    def algorithm_for(self, coll: int, nbytes: int, dtype: str, algo) -> str:
        return self.algo if coll in (ALL_REDUCE, REDUCE, REDUCE_SCATTER, BROADCAST) else self.world.name

    # -- errors --------------------------------------------------------------------------------------------------
    def _net(self, what: str, call, *args):
        """One engine call. Its failure becomes the typed error of a lost or late peer, naming the ranks of the
        machine at the address the engine names, or else of the machines that did not answer a roll call; the error
        is left in the store and this rank abandons its machine's host communicator, so that the ranks waiting on
        this one (a leader's machine, in the middle of a reduction) raise the same error at once."""
        try:
            return call(*args)
        except engines.EngineFailure as e:
            text = str(e)
            named = {r for a, rs in self._addresses.items() if re.search(rf"(?<![\d.]){re.escape(a)}(?!\d)", text)
                     for r in rs}
            ranks = sorted(named) or self._roll_call()
            where = f"; lost: rank(s) {ranks} (machine(s) {sorted({self.hosts[r] for r in ranks})})" if ranks else ""
            engine = self.world.name
            failure = {"timeout": e.timed_out, "ranks": ranks,
                       "message": f"{what} between machines ({engine}) {'timed out' if e.timed_out else 'failed'}"
                                  f"{where}: {text}"}
            self._publish_failure(failure)
            raise _failure_error(failure) from None

    def _roll_call(self) -> list:
        """The ranks of the machines none of whose ranks reached this call's roll call within _ROLL_CALL_S: after
        a timeout, the machines on the far side of a cut (alive, maybe, but unreachable)."""
        if self._store is None:
            return []
        key = f"{self._prefix}nodes/alive/{self._seq}/"
        self._store.set(f"{key}{self.node}", b"1")
        deadline, silent = time.monotonic() + _ROLL_CALL_S, []
        for n, machine in enumerate(self.machines):
            try:
                self._store.get(f"{key}{n}", timeout=max(0.05, deadline - time.monotonic()))
            except GpucollError:
                silent.extend(r for r, h in enumerate(self.hosts) if h == machine)
        return silent

    def _publish_failure(self, failure: dict) -> None:
        if self._store is not None:
            with contextlib.suppress(GpucollError):
                self._store.set(f"{self._prefix}nodes/failed/{self._seq}", json.dumps(failure).encode())
        self.local.impl.abandon()  # this machine's ranks waiting on this one fail now, and read the failure

    def _failure_of_this_call(self, wait: float):
        """The failure a rank of this machine published for this call (abandoning the host communicator), waiting
        up to `wait` seconds for it; None when there is none."""
        if self._store is None:
            return None
        key = f"{self._prefix}nodes/failed/{self._seq}"
        try:
            if wait > 0:
                return json.loads(self._store.get(key, timeout=wait))
            return json.loads(self._store.get(key, timeout=1.0)) if self._store.check(key) else None
        except (GpucollError, ValueError):
            return None

    def _agree(self, coll: int, count: int, dtype: str, redop, root: int) -> None:
        """Every rank is making the same call, checked before any data moves: the ranks of each machine compare
        their signatures through shared memory, the leaders compare theirs (with whether their machine agreed)
        through gloo, and each leader tells its ranks the verdict. Three small steps, so that a rank that called
        something else is named at once on every rank instead of after a timeout."""
        self._seq += 1
        op = -1 if redop is None else (int(redop) if type(redop) is _C.RedOp else 1000)
        code = _buffers.SUPPORTED.index(dtype) if dtype in _buffers.SUPPORTED else -1
        sig = np.array([coll, count, code, op, root, self._seq], np.int64)
        here = np.empty(sig.size * self.local.world_size, np.int64)
        self._local(base.ALL_GATHER, _buffers.resolve(sig, "signature"), _buffers.resolve(here, "signatures"), None, 0)
        here = here.reshape(self.local.world_size, sig.size)
        odd = next((i for i in range(len(here)) if not np.array_equal(here[i], here[0])), -1)
        verdict = np.full(2, -1, np.int64)  # (first rank that differs, a rank it differs from)
        if odd >= 0:
            verdict[:] = (self._local_ranks[odd], self._local_ranks[0])
        if self.leaders is not None:
            mine = np.array([*sig.tolist(), int(verdict[0]), int(verdict[1])], np.int64)
            every = self._net(_NAMES.get(coll, "call"), self.leaders.allgather_bytes, mine.view(np.uint8))
            every = every.view(np.int64)
            for n, theirs in enumerate(every):
                if theirs[-2] >= 0:
                    verdict[:] = (int(theirs[-2]), int(theirs[-1]))
                    break
                if not np.array_equal(theirs[:-2], every[0][:-2]):
                    verdict[:] = (self.first[n], self.first[0])
                    break
        self._local(BROADCAST, _buffers.resolve(verdict, "verdict"), None, None, 0)
        if verdict[0] >= 0:
            a, b = int(verdict[0]), int(verdict[1])
            raise InvalidArgument(f"{_NAMES.get(coll, 'a call')} #{self._seq} differs between ranks: rank {a} "
                                  f"({self.hosts[a]}) and rank {b} ({self.hosts[b]}) made different calls "
                                  f"(collective, count, dtype, op or root)", ranks=(b, a))

    def _local(self, coll: int, src, dst, redop, root: int, premul=None) -> None:
        dst = src if dst is None else dst
        if premul is not None:
            redop = _PreMul(premul)
        try:
            self.local.collective(coll, "auto", src, dst, src.count, redop, root, None, False)
        except GpucollError as e:
            # A rank of this machine may have lost a peer between machines: its failure is the one to report.
            # After a timeout here, that rank may still be in its roll call (a second): wait for it a little.
            failure = self._failure_of_this_call(2.0 if isinstance(e, (CollectiveTimeout, RemoteError)) else 0.0)
            if failure is None:
                raise
            raise _failure_error(failure) from None

    # -- operations -----------------------------------------------------------------------------------------------
    def collective(self, coll: int, algo, src, dst, count: int, redop, root: int, stream, async_op: bool):
        if stream is not None:
            raise InvalidArgument("stream= applies to the nccl backend; the host backend runs each operation on the "
                                  "calling thread")
        if algo not in (None, "auto", self.algo, self.world.name):
            raise InvalidArgument(f"algo={algo!r}: across machines the host backend runs one schedule per collective "
                                  f"(shared memory inside each machine, {self.world.name} between them); use "
                                  f"algo='auto'")
        self._flush_p2p()
        if coll in (ALL_REDUCE, REDUCE, REDUCE_SCATTER):
            self._seq += 1
            sig = self._signature(coll, count, src.dtype_name, redop, root)
            target = dst if coll == ALL_REDUCE else _scratch(src, src.count)
            self._all_reduce(src, target, redop, sig, _NAMES[coll])
            if coll == REDUCE and self.rank == root:
                ctypes.memmove(dst.ptr, target.ptr, target.nbytes)
            elif coll == REDUCE_SCATTER:
                ctypes.memmove(dst.ptr, target.ptr + self.rank * count * src.itemsize, count * src.itemsize)
            return
        self._agree(coll, count, src.dtype_name, redop, root)
        if coll == BROADCAST:
            self._broadcast(src, root)
        else:
            self._through_world(coll, src, dst, count, root)

    def _signature(self, coll: int, count: int, dtype: str, redop, root: int) -> list:
        op = -1 if redop is None else (int(redop) if type(redop) is _C.RedOp else 1000)
        code = _buffers.SUPPORTED.index(dtype) if dtype in _buffers.SUPPORTED else -1
        return [coll, count, code, op, root, self._seq]

    def _all_reduce(self, src, dst, redop, sig: list, what: str) -> None:
        """The hierarchical all-reduce, its call check folded in. The machine's ranks reduce into its leader
        through shared memory (the host backend compares their calls there). The leaders then exchange a fixed-size
        record (_RECORD_BYTES) whatever the call: its signature, whether the machine's ranks agreed, and the
        machine's partial result when that fits. Fixed, so that calls that differ between machines still make
        the same exchange and learn that they differ. Where the partials fit, each leader folds them in machine
        order (the same bits on every leader) and the call costs one exchange between machines; larger ones
        follow with gloo's all-reduce. Each leader then hands its machine the verdict with the result."""
        floating = src.dtype_name in _FLOATS
        premul, op = None, redop
        if type(redop) is not _C.RedOp:  # premul_sum
            premul, op = float(redop.scalar), _C.RedOp.sum
        elif redop == _C.RedOp.avg:
            op = _C.RedOp.sum
            if floating:  # NCCL's 1/n for the whole world: in double, rounded to float32 except for float64 (the
                # host backend rounds it on to the dtype)
                premul = 1.0 / self.world_size
                premul = premul if src.dtype_name == "float64" else float(np.float32(premul))
        divide = type(redop) is _C.RedOp and redop == _C.RedOp.avg and not floating
        odd = None
        try:
            self._local(REDUCE, src, dst, op, 0, premul)
        except InvalidArgument as e:  # this machine's ranks made different calls: every one of them raised it
            pair = list(e.ranks)[:2] if len(e.ranks) >= 2 else [len(self._local_ranks) - 1, 0]
            odd = self._mismatch(what, self._local_ranks[pair[1]], self._local_ranks[pair[0]], str(e))
            if self.leaders is None:
                raise odd from None
        nbytes = dst.nbytes
        inline = nbytes <= _RECORD_BYTES - _HEADER_BYTES
        verdict = np.full(2, -1, np.int64)
        if self.leaders is not None:
            bad = [-1, -1] if odd is None else [odd.ranks[1], odd.ranks[0]]
            record = np.zeros(_RECORD_BYTES, np.uint8)
            record[:_HEADER_BYTES].view(np.int64)[:8] = [*sig, *bad]
            mine = engines.storage(dst)
            if inline and odd is None:
                record[_HEADER_BYTES:_HEADER_BYTES + nbytes] = mine.view(np.uint8)
            records = self._net(what, self.leaders.allgather_bytes, record)
            heads = [r[:_HEADER_BYTES].view(np.int64) for r in records]
            for n, h in enumerate(heads):
                if h[6] >= 0:
                    verdict[:] = (int(h[6]), int(h[7]))
                    break
                if not np.array_equal(h[:6], heads[0][:6]):
                    verdict[:] = (self.first[n], self.first[0])
                    break
            if verdict[0] < 0:
                if inline:
                    parts = [r[_HEADER_BYTES:_HEADER_BYTES + nbytes].view(mine.dtype) for r in records]
                    mine[...] = engines.fold(parts, op, src.dtype_name == "bfloat16")
                else:
                    self._net(what, self.leaders.allreduce, dst, op)
                if divide:  # integer avg: the finished sum divided by n, truncating toward zero (C's division)
                    total = mine.astype(np.int64)
                    mine[...] = (np.abs(total) // self.world_size * np.sign(total)).astype(mine.dtype)
            if odd is not None:
                raise odd from None
        if inline:  # the verdict and the result in one step through shared memory
            staged = np.empty(16 + nbytes, np.uint8)
            if self.leaders is not None:
                staged[:16] = verdict.view(np.uint8)
                ctypes.memmove(staged.ctypes.data + 16, dst.ptr, nbytes)
            self._local(BROADCAST, _buffers.resolve(staged, "staged"), None, None, 0)
            verdict = staged[:16].view(np.int64).copy()
            if verdict[0] < 0 and self.leaders is None:
                ctypes.memmove(dst.ptr, staged.ctypes.data + 16, nbytes)
        else:
            self._local(BROADCAST, _buffers.resolve(verdict, "verdict"), None, None, 0)
            if verdict[0] < 0:
                self._local(BROADCAST, dst, dst, None, 0)
        if verdict[0] >= 0:
            raise self._mismatch(what, int(verdict[0]), int(verdict[1]))

    def _mismatch(self, what: str, a: int, b: int, detail: str = "") -> InvalidArgument:
        return InvalidArgument(f"{what} #{self._seq} differs between ranks: rank {a} ({self.hosts[a]}) and rank {b} "
                               f"({self.hosts[b]}) made different calls (collective, count, dtype, op or root)"
                               + (f"; on their machine: {detail}" if detail else ""), ranks=(b, a))

    def _broadcast(self, buf, root: int) -> None:
        root_node = self.machines.index(self.hosts[root])
        if self.node == root_node:
            self._local(BROADCAST, buf, buf, None, self.hosts[:root].count(self.hosts[root]))
        if self.leaders is not None:
            self._net("broadcast", self.leaders.broadcast, buf, root_node)
        if self.node != root_node:
            self._local(BROADCAST, buf, buf, None, 0)

    def _through_world(self, coll: int, src, dst, count: int, root: int) -> None:
        w = self.world
        call = {base.ALL_GATHER: lambda: w.all_gather(src, dst, count), base.ALL_TO_ALL: lambda: w.all_to_all(src, dst, count),
                base.GATHER: lambda: w.gather(src, dst, count, root),
                base.SCATTER: lambda: w.scatter(src, dst, count, root)}.get(coll)
        if call is None:
            raise Unsupported(f"collective {coll} across machines")
        self._net(_NAMES[coll], call)

    # -- sends and receives -------------------------------------------------------------------------------------
    def p2p(self, send: bool, peer: int, buf, stream, async_op: bool):
        if stream is not None:
            raise InvalidArgument("stream= applies to the nccl backend; the host backend runs each operation on the "
                                  "calling thread")
        if self._group is not None:
            self._group.append((send, peer, buf))
        else:
            self._run_p2p([(send, peer, buf)])

    def _run_p2p(self, batch) -> None:
        # Every send and receive is posted before any is waited for: a group's pairs never wait on each other.
        peers = sorted({peer for _, peer, _ in batch})
        self._net(f"send/receive with rank(s) {peers}", self.world.p2p, batch)

    def _flush_p2p(self) -> None:
        if self._group:
            batch, self._group = self._group, []
            self._run_p2p(batch)

    @contextlib.contextmanager
    def group(self):
        if self._group is not None:
            yield
            return
        self._group = []
        ok = False
        try:
            yield
            ok = True
        finally:
            batch, self._group = self._group, None
            if ok and batch:
                self._run_p2p(batch)

    def barrier(self) -> None:
        self._net("barrier", self.world.barrier)

    def compressed_all_reduce(self, src, dst, redop, compress: str, stream, async_op: bool):
        raise Unsupported(f"all_reduce(compress={compress!r}) runs on the host backend of one machine and on "
                          f"gpucoll's kernels; across machines the host backend moves data through gloo, which has "
                          f"no compressed format")

    # The straggler window and the flight recorder are the machine's host communicator's: they number its ranks and
    # its calls, not the job's, and see nothing of the network. Rather than report them as the job's, this backend
    # has neither (the base class's Unsupported, which the failure path skips).

    def abort(self, reason: str) -> None:
        self.local.abort(reason)

    def close(self) -> None:
        self.local.close()
        for engine in (self.leaders, self.world):
            if engine is not None and hasattr(engine, "close"):
                engine.close()
        self.leaders = self.world = None


def _failure_error(failure: dict) -> GpucollError:
    cls = CollectiveTimeout if failure["timeout"] else RemoteError
    return cls(failure["message"], ranks=tuple(failure["ranks"]))


class _LocalLaunch:
    """The part of a LaunchInfo the host backend's set-up reads, for the ranks of one machine."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


class _PreMul:
    """A premul_sum as the host backend takes it (the Communicator's PreMulSum has the same one attribute)."""

    def __init__(self, scalar: float):
        self.scalar = scalar
