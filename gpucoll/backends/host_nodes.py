"""The host backend when its ranks run on several machines: shared memory inside each machine, gloo between them.

gpucoll's host schedules (csrc/backends/host/) work through one shared-memory region, so they reach the ranks of one
machine only. Between machines this backend uses an engine that already moves CPU tensors over the network, torch's
gloo, rather than a transport of gpucoll's own: every torch installation carries it, and it meets its peers through
gpucoll's own store (authenticated: `_GlooStore`), so the job opens no second rendezvous port. Without torch, a job
across machines has no engine, and the backend says so when it is built.

The reductions run in three steps (the hierarchical all-reduce of the seed notes): the ranks of each machine reduce
into its first rank (the leader) through shared memory, the leaders all-reduce through gloo, and each leader
broadcasts the result to its machine through shared memory. So the network carries one copy per machine, not one per
rank, and every rank ends with the leader's bits: the same result everywhere. Reductions are exact on exact inputs,
in a different order from the one-machine schedules (machine by machine). avg is NCCL's: floating types scale every
input by NCCL's 1/n for the whole world before the sum, integer types divide the finished sum, truncating.
Broadcast runs the same way in reverse. The other collectives (all-gather, all-to-all, gather, scatter, send and
receive) go through gloo over every rank, reduce-scatter through the hierarchical all-reduce.

Each call's signature (collective, count, dtype, op, root and the call's number on this communicator) crosses the
leaders before any data does: a call that differs between machines raises InvalidArgument on every rank instead of
letting gloo pair unrelated buffers. Within a machine the host backend's own call check does the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import re
import socket
import time

import numpy as np

from gpucoll import _buffers
from gpucoll._native import _C
from gpucoll.backends import base
from gpucoll.backends.base import ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, Backend
from gpucoll.bootstrap.prefix import PrefixStore
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, RemoteError, Unsupported

_NAMES = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", REDUCE: "reduce", base.ALL_GATHER: "all_gather",
          REDUCE_SCATTER: "reduce_scatter", base.ALL_TO_ALL: "all_to_all", base.GATHER: "gather", base.SCATTER: "scatter"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_ALGO = "hierarchical:shm+gloo"
# The leaders' exchange of every reduction: 64 bytes of header (the call's signature, and the ranks of this machine
# that made different calls, if any) and, where it fits, the machine's partial result. 4 KiB: results up to 4032
# bytes (a thousand float32) cost one exchange between machines, and the fixed size costs a few microseconds.
_RECORD_BYTES, _HEADER_BYTES = 4096, 64
# How long survivors wait for each other's roll call after a timeout between machines, to name the silent ones.
_ROLL_CALL_S = 0.5


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, None
    return torch, dist


def engine_missing(hosts: list) -> str | None:
    """Why this process cannot run the host backend across `hosts` (None when it can)."""
    torch, dist = _torch()
    if torch is None or not dist.is_available() or not dist.is_gloo_available():
        names = sorted(set(hosts))
        return (f"the host backend's ranks run on {len(names)} machines ({', '.join(names[:4])}"
                f"{' ...' if len(names) > 4 else ''}); between machines it moves data through torch's gloo, and torch "
                f"with gloo is not installed here (pip install torch)")
    return None


class _GlooStore:
    """gpucoll's rendezvous store seen as a torch.distributed Store, under a prefix, for gloo's own rendezvous."""

    def __new__(cls, base, timeout: float):
        _, dist = _torch()

        class Store(dist.Store):
            def set(self, key, value):
                base.set(key, value if isinstance(value, bytes) else str(value).encode())

            def get(self, key):
                return base.get(key, timeout=timeout)

            def add(self, key, amount):
                return base.add(key, amount)

            def wait(self, keys, wait_timeout=None):
                for key in keys:
                    base.get(key, timeout=timeout)

            def check(self, keys):
                return all(base.check(k) for k in keys)

        return Store()


def _torch_view(buf, count: int | None = None, offset: int = 0):
    """A torch tensor over `count` elements of `buf` from element `offset`, sharing its memory."""
    torch, _ = _torch()
    dtype = getattr(torch, buf.dtype_name)
    n = buf.count if count is None else count
    if n == 0:
        return torch.empty(0, dtype=dtype)
    raw = (ctypes.c_uint8 * (n * buf.itemsize)).from_address(buf.ptr + offset * buf.itemsize)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def _scratch(buf, count: int):
    """A CPU buffer of `count` elements of `buf`'s dtype (float32 storage for bfloat16, which NumPy lacks)."""
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

    @classmethod
    def create(cls, launch, store, *, timeout: float, hosts: list, prefix: str, make_local):
        """Every rank together; `hosts`: every rank's host name; `make_local(launch, store, timeout)`: the host
        backend over this machine's ranks."""
        why = engine_missing(hosts)
        if why is not None:
            raise Unsupported(why)
        _, dist = _torch()
        machines = list(dict.fromkeys(hosts))
        mine = [r for r, h in enumerate(hosts) if h == hosts[launch.rank]]
        node = machines.index(hosts[launch.rank])
        local_launch = _LocalLaunch(mine.index(launch.rank), len(mine))
        # The machine's own communicator waits longer than gloo does: a rank waiting on its leader, which waits on
        # the network, then hears the leader's verdict (which names the lost machine) instead of timing out first
        # and naming the leader. A leader that died is seen at once all the same (its process is gone).
        local = make_local(local_launch, PrefixStore(store, f"{prefix}machine{node}/"), timeout + _ROLL_CALL_S + 1.0)
        span = datetime.timedelta(seconds=float(timeout))
        world = dist.ProcessGroupGloo(_GlooStore(PrefixStore(store, f"{prefix}gloo/world/"), timeout),
                                      launch.rank, launch.world_size, span)
        leaders = None
        if mine[0] == launch.rank:
            leaders = dist.ProcessGroupGloo(_GlooStore(PrefixStore(store, f"{prefix}gloo/leaders/"), timeout),
                                            node, len(machines), span)
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
        return _ALGO if coll in (ALL_REDUCE, REDUCE, REDUCE_SCATTER, BROADCAST) else "gloo"

    # -- errors --------------------------------------------------------------------------------------------------
    def _gloo(self, what: str, work) -> None:
        """Waits for a gloo operation. Its failure becomes the typed error of a lost or late peer, naming the ranks
        of the machine at the address gloo names, or else of the machines that did not answer a roll call; the
        error is left in the store and this rank abandons its machine's host communicator, so that the ranks
        waiting on this one (a leader's machine, in the middle of a reduction) raise the same error at once."""
        try:
            work.wait()
        except RuntimeError as e:
            text = str(e)
            timed_out = "imed out" in text
            named = {r for a, rs in self._addresses.items() if re.search(rf"(?<![\d.]){re.escape(a)}(?!\d)", text)
                     for r in rs}
            ranks = sorted(named) or self._roll_call()
            where = f"; lost: rank(s) {ranks} (machine(s) {sorted({self.hosts[r] for r in ranks})})" if ranks else ""
            failure = {"timeout": timed_out, "ranks": ranks,
                       "message": f"{what} between machines (gloo) {'timed out' if timed_out else 'failed'}{where}: "
                                  f"{text}"}
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
        torch, _ = _torch()
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
            mine = torch.tensor([*sig.tolist(), int(verdict[0]), int(verdict[1])], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in self.machines]
            self._gloo(_NAMES.get(coll, "call"), self.leaders.allgather([every], [mine]))
            for n, theirs in enumerate(every):
                if theirs[-2] >= 0:
                    verdict[:] = (int(theirs[-2]), int(theirs[-1]))
                    break
                if not torch.equal(theirs[:-2], every[0][:-2]):
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
        if algo not in (None, "auto", _ALGO, "gloo"):
            raise InvalidArgument(f"algo={algo!r}: across machines the host backend runs one schedule per collective "
                                  f"(shared memory inside each machine, gloo between them); use algo='auto'")
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
        torch, dist = _torch()
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
            record = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
            header = record[:_HEADER_BYTES].view(torch.int64)
            header[:8] = torch.tensor([*sig, *bad], dtype=torch.int64)
            if inline and odd is None:
                record[_HEADER_BYTES:_HEADER_BYTES + nbytes] = _torch_view(dst).view(torch.uint8)
            records = [torch.empty_like(record) for _ in self.machines]
            self._gloo(what, self.leaders.allgather([records], [record]))
            heads = [r[:_HEADER_BYTES].view(torch.int64) for r in records]
            for n, h in enumerate(heads):
                if h[6] >= 0:
                    verdict[:] = (int(h[6]), int(h[7]))
                    break
                if not torch.equal(h[:6], heads[0][:6]):
                    verdict[:] = (self.first[n], self.first[0])
                    break
            if verdict[0] < 0:
                view = _torch_view(dst)
                if inline:
                    dtype = view.dtype
                    parts = [r[_HEADER_BYTES:_HEADER_BYTES + nbytes].view(dtype) for r in records]
                    folded = parts[0].clone()
                    for part in parts[1:]:
                        folded = _FOLD[op](folded, part)
                    view.copy_(folded)
                else:
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = _GLOO_OPS[op]
                    self._gloo(what, self.leaders.allreduce([view], opts))
                if divide:
                    view.copy_(torch.div(view, self.world_size, rounding_mode="trunc"))
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
        _, dist = _torch()
        root_node = self.machines.index(self.hosts[root])
        if self.node == root_node:
            self._local(BROADCAST, buf, buf, None, self.hosts[:root].count(self.hosts[root]))
        if self.leaders is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = root_node
            self._gloo("broadcast", self.leaders.broadcast([_torch_view(buf)], opts))
        if self.node != root_node:
            self._local(BROADCAST, buf, buf, None, 0)

    def _through_world(self, coll: int, src, dst, count: int, root: int) -> None:
        n, me = self.world_size, self.rank
        blocks = [_torch_view(dst, count, r * count) for r in range(n)] if dst is not None else None
        if coll == base.ALL_GATHER:
            work = self.world.allgather([blocks], [_torch_view(src)])
        elif coll == base.ALL_TO_ALL:
            work = self.world.alltoall_base(_torch_view(dst, count * n), _torch_view(src, count * n), [], [])
        elif coll == base.GATHER:
            mine = _torch_view(src, count)
            work = self.world.gather([blocks] if me == root else [], [mine], _gather_opts(root))
        elif coll == base.SCATTER:
            outs = [_torch_view(dst, count)]
            ins = [[_torch_view(src, count, r * count) for r in range(n)]] if me == root else []
            work = self.world.scatter(outs, ins, _scatter_opts(root))
        else:
            raise Unsupported(f"collective {coll} across machines")
        self._gloo(_NAMES[coll], work)

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
        works = [(self.world.send if send else self.world.recv)([_torch_view(buf)], peer, 0)
                 for send, peer, buf in batch]
        for (send, peer, _), work in zip(batch, works):
            self._gloo(f"{'send to' if send else 'receive from'} rank {peer}", work)

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
        self._gloo("barrier", self.world.barrier())

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
        self.leaders = self.world = None


def _failure_error(failure: dict) -> GpucollError:
    cls = CollectiveTimeout if failure["timeout"] else RemoteError
    return cls(failure["message"], ranks=tuple(failure["ranks"]))


def _fold(name: str):
    def fold(a, b):
        return getattr(_torch()[0], name)(a, b)
    return fold


# A leader folds the machines' partials with these, in machine order (torch keeps the dtype: int8 wraps, float16
# rounds at every step, as the host backend's own reductions do).
_FOLD = {_C.RedOp.sum: _fold("add"), _C.RedOp.prod: _fold("mul"), _C.RedOp.min: _fold("minimum"),
         _C.RedOp.max: _fold("maximum")}


class _GlooOps(dict):
    """gpucoll's RedOp -> gloo's ReduceOp, resolved on first use (torch is imported only across machines)."""

    def __missing__(self, op):
        dist = _torch()[1]
        self.update({_C.RedOp.sum: dist.ReduceOp.SUM, _C.RedOp.prod: dist.ReduceOp.PRODUCT,
                     _C.RedOp.min: dist.ReduceOp.MIN, _C.RedOp.max: dist.ReduceOp.MAX})
        return self[op]


_GLOO_OPS = _GlooOps()


class _LocalLaunch:
    """The part of a LaunchInfo the host backend's set-up reads, for the ranks of one machine."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


class _PreMul:
    """A premul_sum as the host backend takes it (the Communicator's PreMulSum has the same one attribute)."""

    def __init__(self, scalar: float):
        self.scalar = scalar


def _gather_opts(root: int):
    _, dist = _torch()
    opts = dist.GatherOptions()
    opts.rootRank = root
    return opts


def _scatter_opts(root: int):
    _, dist = _torch()
    opts = dist.ScatterOptions()
    opts.rootRank = root
    return opts

