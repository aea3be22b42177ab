"""``ProcessGroupGpucoll``: gpucoll behind torch.distributed's ProcessGroup interface.

torch builds it through the creator registered by gpucoll's entry point or ``import gpucoll.torch`` (``create``),
with the store, rank and size of the group it is making. Communicators are made lazily, one per kind of device the
group's tensors live on (every rank reaches its first CPU or first CUDA operation together, so the rendezvous is
collective; a rank that never does is named in the others' timeout, as for any later operation):

* CPU tensors run on gpucoll's host backend (shared memory) when the group's ranks are on one machine, else on
  gloo (decided at the group's first CPU operation, see _route_cpu);
* CUDA tensors on gpucoll's GPU backends (backend 'auto': our allreduce kernels where the topology model predicts
  they win, NCCL otherwise), one communicator per CUDA device, on the caller's current stream.

Each communicator takes its keys under ``gpucoll/<device>/`` in the store torch hands in, which torch has already
prefixed with the group's unique name: the default group, every ``new_group`` and every subset never share a key.

torch finds a group by its name: functional collectives (``torch.ops._c10d_functional.*``, what torch.compile
emits), DeviceMesh, FSDP2 and DTensor resolve the name in C++ and call the group's virtual methods, which torch's
trampoline forwards here. torch keeps a group's name on its C++ backends, and this group has none (torch lets a
Python ProcessGroup stand for the whole group), so it keeps its own: ``getGroupName``/``setGroupName`` (and the
description) override the C++ virtuals, which torch 2.11 and 2.13 both forward to Python.

With ``init_process_group("cpu:gloo,cuda:gpucoll")`` torch (up to 2.13 at least) lets a Python ProcessGroup stand
for the whole group, so the gloo backend torch made for CPU tensors would be dropped; the creator finds it (or makes
one) and hands CPU tensors to it, as the user asked (gpucoll/torch/_cpu_fallback.py).

The methods are the ones torch.distributed's Python functions call on a group (torch 2.13 names first, the older
names torch 2.4-2.12 call as aliases) and the C++ virtuals DDP and the functional collectives reach through torch's
trampoline. The collectives are table rows by kind (_reduce.py, _gather.py, _alltoall.py), which one generic method
runs (_call.py); send and recv are queued (_p2p.py). What gpucoll cannot do raises ``gpucoll.Unsupported`` naming the
operation; bad arguments raise ``gpucoll.InvalidArgument``. Every error that leaves the group is also a
``torch.distributed.DistBackendError`` (gpucoll/torch/errors.py).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from gpucoll import _log
from gpucoll._make import init_from_store
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, InvalidUsage, RemoteError, Unsupported
from gpucoll.torch import _alltoall, _gather, _reduce
from gpucoll.torch._call import BACKEND_NAME, _Call, _seconds, methods
from gpucoll.torch._convert import NOW_OPS
from gpucoll.torch._cpu_fallback import cpu_backend_from_caller, gloo_group, log_gloo_across_machines, machines
from gpucoll.torch._p2p import PointToPointMixin
from gpucoll.torch.errors import raise_torch_errors_from, raises_torch_errors, torch_error, translates_itself
from gpucoll.torch.work import DoneWorks, Work

__all__ = ["BACKEND_NAME", "ProcessGroupGpucoll", "create"]


class ProcessGroupGpucoll(PointToPointMixin, dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on gpucoll (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout=None, *, cpu_backend=None):
        super().__init__(rank, size)
        self._store = store
        self._timeout = _seconds(timeout)
        self._comms = {}
        self._host = None  # (Communicator, its one native call) of CPU tensors once made, unless they go to gloo
        self._done = DoneWorks()  # the Works of that one-call path
        self._lock = threading.Lock()
        self._p2p = []  # queued (send, peer, tensor, Work, tag)
        self._cpu_backend = cpu_backend  # the torch backend CPU tensors go to ("cpu:gloo,cuda:gpucoll"), or None
        self._cpu_routed = cpu_backend is not None  # whether _route_cpu decided where CPU tensors go
        self._closed = False
        self._background = True  # async CPU all-reduces on the host communicator's thread (False: the caller's)
        self._group_name = None  # set by torch (_set_group_name) when it registers the group
        self._group_desc = "undefined"
        self._init_p2p()

    # -- identity -------------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # torch's name
        return BACKEND_NAME

    _get_backend_name = name = getBackendName

    # The C++ virtuals behind ``pg.group_name``, ``pg._set_group_name`` and torch's C++ lookups (see the module
    # docstring). An unnamed group answers as torch's own does.
    def getGroupName(self) -> str:
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = str(name)

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = str(desc)

    # torch asks a group for its per-device backend: init_process_group(device_id=...) reads
    # pg._get_backend(device_id).supports_splitting, new_group and split_group look for a group to split from. This
    # group serves cpu and cuda itself (it is not a set of C++ Backends), so it answers for both. Splitting is what
    # torch's split_group needs (CUDA groups bound to a device only, as with NCCL): the split is a new gpucoll group
    # over the chosen ranks. The other capabilities torch reads off that answer are declined (a missing one is an
    # AttributeError where a backend-less group's RuntimeError was caught: inductor's comm estimate, FSDP2's
    # allocator, _time_estimator).
    supports_splitting = True
    supports_time_estimate = False
    options = None  # what split_group copies from the parent for the child: gpucoll takes none

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def _get_backend(self, device):
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        """torch calls this on a new group's backend; gpucoll's communicators keep their own sequence numbers."""

    def eager_connect_single_device(self, device) -> None:
        """init_process_group(device_id=cuda:i): make that device's communicator now (every rank calls it)."""
        if device is not None and torch.device(device).type == "cuda":
            self.communicator(device)

    def perform_nocolor_split(self, device) -> None:
        """new_group on a rank outside the new group, when the default group is bound to a device: nothing to do
        (a gpucoll group is built by its members alone)."""

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """torch's ``dist.split_group`` (which every rank of this group calls): a new gpucoll group over `ranks`
        (ranks of this group, sorted), or None on a rank outside them. Its keys live under the new group's name in
        this group's store."""
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size() for r in ranks):
            raise InvalidArgument(f"split_group: ranks must be distinct ranks of this group of {self.size()}; got "
                                  f"{ranks}")
        if self.rank() not in ranks:
            return None
        if group_name is None:
            raise InvalidArgument("split_group: torch names the new group (group_name); got None")
        store = dist.PrefixStore(f"gpucoll-split/{group_name}/", self._store)
        child = ProcessGroupGpucoll(store, ranks.index(self.rank()), len(ranks),
                                    timeout if timeout is not None else self._timeout)
        child.setGroupName(group_name)
        if group_desc is not None:
            child.setGroupDesc(group_desc)
        return child

    def __repr__(self) -> str:
        name = f" name={self._group_name}" if self._group_name is not None else ""
        return f"<gpucoll.torch.ProcessGroupGpucoll rank={self.rank()} size={self.size()}{name}>"

    # -- communicators --------------------------------------------------------------------------------------------
    def communicator(self, device="cpu", what: str | None = None):
        """The gpucoll Communicator this group uses for tensors on `device` (made on first use: collective). `what`
        names the operation that needs it, for the error of a rank that never makes it."""
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            key = f"cuda:{index}"
        elif device.type == "cpu":
            index, key = None, "cpu"
        else:
            raise Unsupported(f"gpucoll's torch backend runs on CPU and CUDA tensors; got a tensor on {device}")
        comm = self._comms.get(key)
        if comm is not None:
            return comm
        with self._lock:
            comm = self._comms.get(key)
            if comm is None:
                if self._closed:
                    raise InvalidUsage("this gpucoll process group was shut down (destroy_process_group)")
                store = dist.PrefixStore(f"gpucoll/{key}/", self._store)
                with self._first_operation(store, key, what):
                    comm = init_from_store(store, self.rank(), self.size(), timeout=self._timeout, device=index,
                                           backend="auto" if index is not None else "host")
                self._comms[key] = comm
                if key == "cpu" and self._cpu_backend is None:
                    now = comm._torch_all_reduce(NOW_OPS) if NOW_OPS else None
                    self._host = (comm, now) if now is not None else None
                _log.debug(f"torch backend: {key} communicator for group of {self.size()} ready")
        return comm

    def _comm_for(self, device):
        device = torch.device(device)
        key = "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else 0}"
        comm = self._comms.get(key)
        if comm is None:
            raise InvalidUsage(f"no collective has run on {key} tensors in this group yet: nothing was measured")
        return comm

    def stragglers(self, device="cpu", reset: bool = False):
        """Communicator.stragglers() of the communicator this group runs `device`'s tensors on. Local (not
        collective): the communicator must exist already, i.e. the group ran a collective on such tensors."""
        return self._comm_for(device).stragglers(reset)

    def dump_trace(self, device="cpu", path=None) -> str:
        """Communicator.dump_trace() of the communicator this group runs `device`'s tensors on: its flight recorder
        written to a file (the path is returned). Local, like stragglers()."""
        return self._comm_for(device).dump_trace(path)

    @contextlib.contextmanager
    def _first_operation(self, store, key: str, what: str | None):
        """Around the set-up that this group's first operation on `key` ("cpu", "cuda:0") does, which every rank
        makes. A rank that never makes it leaves the others waiting inside the set-up, whose timeout names a store
        key: it becomes the operation's own timeout, naming the ranks that never entered it, as the operation's
        timeout does once the communicator exists ("all_reduce #2 on rank 0 timed out after 10 s waiting for rank
        1")."""
        store.set(f"entered/{self.rank()}", b"1")
        try:
            yield
        except CollectiveTimeout as e:
            try:
                missing = [r for r in range(self.size())
                           if r != self.rank() and not store.check([f"entered/{r}"])]
            except RuntimeError:  # the store went away (its server, rank 0, exited): the error says enough
                missing = []
            label = f"{what} #1" if what else f"setting up gpucoll's {key} communicator"
            if not missing:  # this rank came late, or another gave up or failed inside the set-up
                raise CollectiveTimeout(
                    f"{label} on rank {self.rank()} timed out after {self._timeout:g} s: every rank entered it, but "
                    f"the set-up of gpucoll's {key} communicator did not complete (a rank that gave up or failed "
                    f"meanwhile says why): {e.message}", call=what or "", ranks=e.ranks) from None
            who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
            raise CollectiveTimeout(
                f"{label} on rank {self.rank()} timed out after {self._timeout:g} s waiting for {who}, which had not "
                f"entered it (this group's first operation on {key} tensors, where gpucoll sets up its {key} "
                f"communicator)", call=what or "", ranks=missing) from None

    def _route_cpu(self, what: str) -> None:
        """Decides, at this group's first operation on CPU tensors (which every rank makes), where they go: on one
        machine to gpucoll's host backend; across machines, which shared memory cannot span, to gloo (which torch
        always has), as init_process_group("cpu:gloo,cuda:gpucoll") would."""
        store = dist.PrefixStore("gpucoll/cpu/", self._store)
        with self._first_operation(store, "cpu", what):
            names = machines(store, self.rank(), self.size(), self._timeout)
        if len(names) > 1:
            self._cpu_backend = gloo_group(self._store, self.rank(), self.size(), self._timeout)
            if self.rank() == 0:
                log_gloo_across_machines(names)
        self._cpu_routed = True

    def _begin(self, call: _Call, tensors) -> None:
        """Checks that `tensors` share one CPU or CUDA device, runs queued p2p first, and gives `call` its
        communicator."""
        what, device = call.what, None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"{what}: expected tensors; got {type(t).__name__}")
            if t.layout != torch.strided:
                raise Unsupported(f"{what}: gpucoll takes dense tensors; got layout {t.layout}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise InvalidArgument(f"{what}: every tensor must be on one device; got {device} and {t.device}")
        if device is None:
            device = torch.device("cpu")
        if self._p2p:
            self._flush_p2p()
        call.comm, call.device, call.cuda = self.communicator(device), device, device.type == "cuda"

    def _finish(self, call: _Call, outputs) -> Work:
        for t, tmp in call.writebacks:
            t.copy_(tmp)
        if not call.cuda:
            return Work(outputs)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(call.device))
        return Work(outputs, works=call.works, event=event, device=call.device)

    def _delegate(self, what: str, tensors) -> bool:
        """Whether CPU `tensors` go to a torch backend (gloo) rather than gpucoll's host backend."""
        if not all(t.device.type == "cpu" for t in tensors):
            return False
        if not self._cpu_routed:
            self._route_cpu(what)
        return self._cpu_backend is not None


    # -- all_reduce -----------------------------------------------------------------------------------------------
    @translates_itself
    def allreduce(self, tensors, opts=None):
        try:
            if opts is not None:
                # dist.all_reduce(t) waited for at once, once the group's host communicator exists and no send or
                # recv is queued before it (queued all-reduces run first, in C++): one native call reads torch's
                # arguments and runs a plain CPU tensor of a dtype the host backend reduces, with an op that means
                # the same on all of them. It declines anything else, having run nothing, and the all_reduce row
                # (_reduce.py) runs the call with the same result.
                host = self._host
                if host is not None and not self._p2p and not host[0]._closed:
                    try:
                        if host[1](tensors, opts):
                            return self._done.get(tensors)
                    except (CollectiveTimeout, RemoteError) as e:
                        host[0]._failure(e)  # as Communicator.all_reduce records it: the flight recorder's dump
                        raise
        except GpucollError as e:
            torch_error(e)
            raise
        return self._allreduce(tensors, opts)

    def barrier(self, opts=None):
        """On GPU `device_ids[0]` where torch names one (``dist.barrier(device_ids=[i])``, as NCCL does), else on a
        CUDA communicator the group has (its GPU work is done first, as with NCCL's barrier), else on CPU."""
        ids = list(getattr(opts, "device_ids", None) or ()) if opts is not None else []
        on_cpu = not ids and not any(k.startswith("cuda") for k in self._comms)
        if on_cpu and not self._cpu_routed:
            self._route_cpu("barrier")
        if on_cpu and self._cpu_backend is not None:
            return self._cpu_backend.barrier(opts if opts is not None else c10d.BarrierOptions())
        if self._p2p:
            self._flush_p2p()
        cuda = [k for k in self._comms if k.startswith("cuda")]
        if ids:
            self.communicator(torch.device("cuda", int(ids[0]))).barrier()
        elif cuda:
            self._comms[cuda[0]].barrier()
        else:
            self.communicator("cpu", what="barrier").barrier()
        return Work([])

    def _start_coalescing(self, device=None) -> None:
        """Sends and receives issued until _end_coalescing are queued anyway; nothing else to do."""

    def _end_coalescing(self, device=None):
        works = [item[3] for item in self._p2p]
        self._flush_p2p()
        return self._combine(works, [])

    def shutdown(self) -> None:
        """Closes this group's communicators (called by destroy_process_group)."""
        self._end("close", "closing")
        if self._cpu_backend is not None and hasattr(self._cpu_backend, "shutdown"):
            try:
                self._cpu_backend.shutdown()
            except Exception as e:  # noqa: BLE001
                _log.debug(f"shutting down the CPU backend failed: {e}")

    def abort(self) -> None:
        self._end("abort", "aborting")

    def _end(self, how: str, doing: str) -> None:
        self._closed = True
        comms, self._comms, self._host = dict(self._comms), {}, None
        for comm in comms.values():
            try:
                getattr(comm, how)()
            except Exception as e:  # noqa: BLE001 - teardown never raises
                _log.debug(f"{doing} a gpucoll communicator failed: {e}")

    @staticmethod
    def _combine(works, outputs) -> Work:
        gathered, deps, event, device = [], [], None, None
        for w in works:
            if isinstance(w, Work):
                gathered += w._works
                event, device = w._event or event, w._device or device
            else:
                deps.append(w)
        return Work(outputs, works=gathered, event=event, device=device, deps=deps)


# The collectives, one method per row (each translates its own errors).
for _name, _fn in methods((*_reduce.ROWS, *_gather.ROWS, *_alltoall.ROWS)).items():
    setattr(ProcessGroupGpucoll, _name, _fn)
del _name, _fn

# What else torch calls raises torch's error types as well as gpucoll's (gpucoll/torch/errors.py).
raise_torch_errors_from(ProcessGroupGpucoll, private=("_start_coalescing", "_end_coalescing",
                                                      "_set_sequence_number_for_group"))


@raises_torch_errors
def create(store, rank: int, size: int, timeout=None) -> ProcessGroupGpucoll:
    """The creator registered with torch.distributed.Backend.register_backend("gpucoll", ...)."""
    return ProcessGroupGpucoll(store, rank, size, timeout,
                               cpu_backend=cpu_backend_from_caller(store, rank, size, timeout))
