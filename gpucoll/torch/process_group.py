"""``ProcessGroupGpucoll``: gpucoll behind torch.distributed's ProcessGroup interface.

torch builds it through the creator registered by ``import gpucoll.torch`` (``create``), with the store, rank and
size of the group it is making. Communicators are made lazily, one per kind of device the group's tensors live on
(every rank reaches its first CPU or first CUDA operation together, so the rendezvous is collective):

* CPU tensors run on gpucoll's host backend (shared memory; every rank on one machine);
* CUDA tensors on gpucoll's GPU backends (backend 'auto': our allreduce kernels where the topology model predicts
  they win, NCCL otherwise), one communicator per CUDA device, on the caller's current stream.

Each communicator takes its keys under ``gpucoll/<device>/`` in the store torch hands in, which torch has already
prefixed with the group's unique name: the default group, every ``new_group`` and every subset never share a key.

With ``init_process_group("cpu:gloo,cuda:gpucoll")`` torch (up to 2.13 at least) lets a Python ProcessGroup stand
for the whole group, so the gloo backend torch made for CPU tensors would be dropped; the creator finds it (or makes
one) and hands CPU tensors to it, as the user asked.

The methods are the ones torch.distributed's Python functions call on a group (torch 2.13 names first, the older
names torch 2.4-2.12 call as aliases) and the C++ virtuals DDP reaches through torch's trampoline. torch's
semantics throughout: ReduceOp mapping (AVG on integers truncates toward zero, as NCCL does), complex tensors as
pairs of reals, lists of outputs, uneven all_to_all splits (run as one group of sends and receives). What gpucoll
cannot do raises ``gpucoll.Unsupported`` naming the operation; bad arguments raise ``gpucoll.InvalidArgument``.
"""

from __future__ import annotations

import threading

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from gpucoll import _log
from gpucoll.errors import InvalidArgument, InvalidUsage, Unsupported
from gpucoll.torch._call import _Call, _op_name, _premul_factor, _seconds
from gpucoll.torch._cpu_fallback import _cpu_backend_from_caller
from gpucoll.torch._p2p import PointToPointMixin
from gpucoll.torch._worker import Worker
from gpucoll.torch.work import Work

__all__ = ["ProcessGroupGpucoll", "create"]

BACKEND_NAME = "gpucoll"

# dtypes gpucoll reduces; every other dtype is moved as bytes by the copying collectives.
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.int64)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg", "PREMUL_SUM": "premul_sum"}
_BITWISE = ("BAND", "BOR", "BXOR")


class ProcessGroupGpucoll(PointToPointMixin, dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on gpucoll (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout=None, *, cpu_backend=None):
        super().__init__(rank, size)
        self._store = store
        self._timeout = _seconds(timeout)
        self._comms = {}
        self._lock = threading.Lock()
        self._p2p = []  # queued (send, peer, tensor, Work, device)
        self._cpu_backend = cpu_backend  # the torch backend CPU tensors go to ("cpu:gloo,cuda:gpucoll"), or None
        self._closed = False
        self._background = True  # CPU all-reduces on the worker thread (False: on the caller's)
        self._worker = Worker(f"gpucoll-torch-r{rank}")

    # -- identity -------------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # torch's name
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # torch asks a group for its per-device backend: init_process_group(device_id=...) reads
    # pg._get_backend(device_id).supports_splitting, new_group looks for a group to split from. This group serves
    # cpu and cuda itself (it is not a set of C++ Backends), so it answers for both and declines splitting. The
    # other capabilities torch reads off that answer are declined too (a missing one is an AttributeError where a
    # backend-less group's RuntimeError was caught: inductor's comm estimate, FSDP2's allocator, _time_estimator).
    supports_splitting = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def _get_backend(self, device):
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    def __repr__(self) -> str:
        return f"<gpucoll.torch.ProcessGroupGpucoll rank={self.rank()} size={self.size()}>"

    # -- communicators --------------------------------------------------------------------------------------------
    def communicator(self, device="cpu"):
        """The gpucoll Communicator this group uses for tensors on `device` (made on first use: collective)."""
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
                from gpucoll.communicator import init_from_store

                store = dist.PrefixStore(f"gpucoll/{key}/", self._store)
                comm = init_from_store(store, self.rank(), self.size(), timeout=self._timeout, device=index,
                                       backend="auto" if index is not None else "host")
                self._comms[key] = comm
                _log.debug(f"torch backend: {key} communicator for group of {self.size()} ready")
        return comm

    def _begin(self, what: str, tensors) -> _Call:
        """Checks that `tensors` share one CPU or CUDA device, runs queued p2p first, and gives the call context."""
        device = None
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
        self._drain()
        if self._p2p:
            self._flush_p2p()
        return _Call(self.communicator(device), device)

    def _drain(self) -> None:
        """Waits until the worker thread ran every queued CPU all-reduce (see gpucoll/torch/_worker.py)."""
        self._worker.drain()

    def _finish(self, call: _Call, outputs) -> Work:
        for t, tmp in call.writebacks:
            t.copy_(tmp)
        if not call.cuda:
            return Work(outputs)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(call.device))
        return Work(outputs, gworks=call.gworks, event=event, device=call.device)

    def _delegate(self, tensors) -> bool:
        return self._cpu_backend is not None and all(t.device.type == "cpu" for t in tensors)

    # -- dtype handling -------------------------------------------------------------------------------------------
    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        """A flat view of contiguous `t` in a dtype gpucoll moves: its own where gpucoll knows it, else bytes."""
        if t.is_complex():
            t = torch.view_as_real(t)
        flat = t.reshape(-1)
        if flat.dtype in _REDUCIBLE:
            return flat
        return flat.view(torch.uint8)

    def _reduce_args(self, what: str, op, t: torch.Tensor):
        """(flat contiguous view of `t` to reduce, gpucoll op, premul factor or None) for torch's ReduceOp."""
        name = _op_name(op)
        if name in _BITWISE:
            raise Unsupported(f"{what}: ReduceOp.{name} is not supported by gpucoll (it reduces with SUM, PRODUCT, "
                              f"MIN, MAX, AVG and PREMUL_SUM)")
        gop = _OPS.get(name)
        if gop is None:
            raise Unsupported(f"{what}: ReduceOp.{name} is not supported by gpucoll")
        if t.is_complex():
            if gop not in ("sum", "avg", "premul_sum"):
                raise Unsupported(f"{what}: ReduceOp.{name} on complex tensors ({t.dtype}) is not defined; complex "
                                  f"tensors reduce with SUM, AVG and PREMUL_SUM")
            t = torch.view_as_real(t)
        if t.dtype not in _REDUCIBLE and not (t.is_cuda and t.dtype in _FP8):
            raise Unsupported(f"{what}: gpucoll cannot reduce {t.dtype} tensors (ReduceOp.{name}); it reduces "
                              f"{', '.join(str(d).replace('torch.', '') for d in _REDUCIBLE)}"
                              + (" and fp8 on CUDA" if _FP8 else "") + "; cast the tensor first")
        factor = None
        if gop == "premul_sum":
            factor = _premul_factor(op)
            if factor is None:
                raise Unsupported(f"{what}: this torch version ({torch.__version__}) does not expose "
                                  f"ReduceOp.PREMUL_SUM's factor")
            if not t.is_floating_point():
                raise Unsupported(f"{what}: ReduceOp.PREMUL_SUM needs a floating-point tensor; got {t.dtype}")
        return t.reshape(-1), gop, factor

    @staticmethod
    def _gop(gop: str, factor):
        """The gpucoll op for a call (premul_sum runs natively on every backend gpucoll gives torch)."""
        if gop != "premul_sum":
            return gop
        from gpucoll import premul_sum

        return premul_sum(float(factor))

    # -- all_reduce -----------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = c10d.AllreduceOptions()
        if self._delegate(tensors):
            return self._cpu_backend.allreduce(tensors, opts)
        if len(tensors) == 1:
            # asyncOp (torch >= 2.7) is False when the caller waits at once: then the worker thread gains nothing.
            return self._allreduce_one("all_reduce", tensors[0], opts.reduceOp, getattr(opts, "asyncOp", True))
        return self._allreduce_list(tensors, opts.reduceOp)

    def _allreduce_one(self, what, tensor, op, background=False) -> Work:
        if (background and self._background and tensor.device.type == "cpu" and tensor.is_contiguous()
                and self._cpu_backend is None):
            return self._allreduce_background(what, tensor, op)
        call = self._begin(what, [tensor])
        buf = call.out(tensor, keep=True)
        flat, gop, factor = self._reduce_args(what, op, buf)
        call.track(call.comm.all_reduce(flat, op=self._gop(gop, factor), async_op=True))
        return self._finish(call, [tensor])

    def _allreduce_background(self, what, tensor, op) -> Work:
        """A contiguous CPU all_reduce, run on the worker thread (argument errors are still raised here)."""
        flat, gop, factor = self._reduce_args(what, op, tensor)
        if self._p2p:
            self._drain()
            self._flush_p2p()
        comm = self._comms.get("cpu")
        if comm is None:
            self._drain()
            comm = self.communicator("cpu")

        gpucoll_op = self._gop(gop, factor)

        def job():
            comm.all_reduce(flat, op=gpucoll_op)

        return self._worker.submit(job, [tensor])

    def _allreduce_list(self, tensors, op) -> Work:
        # torch's (gloo's) meaning of several tensors: every tensor of every rank is reduced into all of them.
        what = "all_reduce (list of tensors)"
        first = tensors[0]
        for t in tensors[1:]:
            if t.dtype != first.dtype or t.numel() != first.numel():
                raise InvalidArgument(f"{what}: every tensor needs one dtype and size; got {first.dtype}"
                                      f"[{first.numel()}] and {t.dtype}[{t.numel()}]")
        call = self._begin(what, tensors)
        flat, gop, factor = self._reduce_args(what, op, first)
        stack = torch.stack([self._reduce_args(what, op, t)[0] for t in tensors])
        if gop in ("sum", "avg", "premul_sum"):
            local = stack.sum(0) if gop != "premul_sum" else stack.sum(0).mul_(factor)
        elif gop == "prod":
            local = stack.prod(0)
        else:
            local = stack.amin(0) if gop == "min" else stack.amax(0)
        local = local.to(flat.dtype)
        call.track(call.comm.all_reduce(local, op="sum" if gop in ("avg", "premul_sum") else gop, async_op=True))
        if gop == "avg":
            n = self.size() * len(tensors)
            local = local.div(n) if local.is_floating_point() else torch.div(local, n, rounding_mode="trunc")
        for t in tensors:
            dst = call.out(t)
            (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1).copy_(local)
        return self._finish(call, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce over the tensors packed together (torch checks they share a dtype)."""
        if opts is None:
            opts = c10d.AllreduceCoalescedOptions()
        if self._delegate(tensors):
            return self._cpu_backend.allreduce_coalesced(tensors, opts)
        what = "all_reduce_coalesced"
        if len(tensors) == 1:
            return self._allreduce_one(what, tensors[0], opts.reduceOp)
        call = self._begin(what, tensors)
        views = [self._reduce_args(what, opts.reduceOp, t.contiguous()) for t in tensors]
        dtypes = {v[0].dtype for v in views}
        if len(dtypes) != 1:
            raise InvalidArgument(f"{what}: every tensor needs one dtype; got {sorted(map(str, dtypes))}")
        _, gop, factor = views[0]
        packed = torch.cat([v[0] for v in views])
        call.track(call.comm.all_reduce(packed, op=self._gop(gop, factor), async_op=True))
        offset = 0
        for t in tensors:
            dst = call.out(t)
            view = (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1)
            view.copy_(packed[offset:offset + view.numel()])
            offset += view.numel()
        return self._finish(call, list(tensors))

    # -- broadcast / reduce ---------------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if opts is None:
            opts = c10d.BroadcastOptions()
        if self._delegate(tensors):
            return self._cpu_backend.broadcast(tensors, opts)
        what = "broadcast"
        root = self._root(what, opts.rootRank)
        if len(tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one tensor per call; got {len(tensors)}")
        call = self._begin(what, tensors)
        buf = call.out(tensors[0], keep=self.rank() == root)
        call.track(call.comm.broadcast(self._bytes(buf), root=root, async_op=True))
        return self._finish(call, list(tensors))

    def reduce(self, tensors, opts=None):
        if opts is None:
            opts = c10d.ReduceOptions()
        if self._delegate(tensors):
            return self._cpu_backend.reduce(tensors, opts)
        what = "reduce"
        root = self._root(what, opts.rootRank)
        if len(tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one tensor per call; got {len(tensors)}")
        t = tensors[0]
        call = self._begin(what, tensors)
        flat, gop, factor = self._reduce_args(what, opts.reduceOp, t.contiguous())
        is_root = self.rank() == root
        # gpucoll leaves non-root inputs as they were; on root the result lands in `flat`, copied back to `t` where
        # `flat` is not `t` itself (a strided `t`).
        src = flat
        call.track(call.comm.reduce(src, op=self._gop(gop, factor), root=root, async_op=True))
        if is_root and src.data_ptr() != t.data_ptr():
            dst = call.out(t)
            (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1).copy_(src)
        return self._finish(call, list(tensors))

    # -- all_gather -----------------------------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        if self._delegate(input_tensors):
            return self._cpu_backend.allgather(output_tensors, input_tensors, opts)
        what = "all_gather"
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one input tensor and one output list per call")
        x, outs = input_tensors[0], output_tensors[0]
        self._check_list(what, "tensor_list", outs, x)
        call = self._begin(what, [x, *outs])
        flat = self._bytes(x.contiguous())
        work = call.comm.all_gather(flat, async_op=True)
        call.track(work)
        gathered = work.result().view(self.size(), -1)
        for r, o in enumerate(outs):
            dst = call.out(o)
            self._bytes(dst).copy_(gathered[r])
        return self._finish(call, [list(outs)])

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        if self._delegate([output_tensor, input_tensor]):
            return self._cpu_backend._allgather_base(output_tensor, input_tensor, opts)
        what = "all_gather_into_tensor"
        self._check_same_dtype(what, output_tensor, input_tensor)
        if output_tensor.numel() != input_tensor.numel() * self.size():
            raise InvalidArgument(f"{what}: output_tensor has {output_tensor.numel()} elements; it needs world_size "
                                  f"({self.size()}) x input_tensor's {input_tensor.numel()}")
        call = self._begin(what, [output_tensor, input_tensor])
        dst = call.out(output_tensor)
        src = input_tensor.contiguous()
        call.track(call.comm.all_gather(self._bytes(src), out=self._bytes(dst), async_op=True))
        return self._finish(call, [output_tensor])

    _allgather_base = all_gather_single  # torch <= 2.12

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        if self._delegate(input_list):
            return self._cpu_backend.allgather_coalesced(output_lists, input_list, opts)
        if len(output_lists) != len(input_list):
            raise InvalidArgument(f"all_gather_coalesced: {len(input_list)} inputs but {len(output_lists)} output "
                                  f"lists")
        works = [self.allgather([outs], [x], opts) for outs, x in zip(output_lists, input_list)]
        return self._combine(works, [list(o) for o in output_lists])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # torch <= 2.12

    # -- gather / scatter -----------------------------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.GatherOptions()
        if self._delegate(input_tensors):
            return self._cpu_backend.gather(output_tensors, input_tensors, opts)
        what = "gather"
        root = self._root(what, opts.rootRank)
        if len(input_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one input tensor per call; got {len(input_tensors)}")
        x = input_tensors[0]
        is_root = self.rank() == root
        outs = output_tensors[0] if output_tensors else []
        if is_root:
            self._check_list(what, "gather_list", outs, x)
        elif outs:
            raise InvalidArgument(f"{what}: gather_list must be empty on non-root ranks")
        call = self._begin(what, [x, *outs])
        work = call.comm.gather(self._bytes(x.contiguous()), root=root, async_op=True)
        call.track(work)
        if is_root:
            got = work.result().view(self.size(), -1)
            for r, o in enumerate(outs):
                self._bytes(call.out(o)).copy_(got[r])
        return self._finish(call, [list(outs)] if is_root else [])

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.ScatterOptions()
        if self._delegate(output_tensors):
            return self._cpu_backend.scatter(output_tensors, input_tensors, opts)
        what = "scatter"
        root = self._root(what, opts.rootRank)
        if len(output_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one output tensor per call; got {len(output_tensors)}")
        y = output_tensors[0]
        is_root = self.rank() == root
        ins = input_tensors[0] if input_tensors else []
        if is_root:
            self._check_list(what, "scatter_list", ins, y)
        elif ins:
            raise InvalidArgument(f"{what}: scatter_list must be empty on non-root ranks")
        call = self._begin(what, [y, *ins])
        dst = self._bytes(call.out(y))
        if is_root:
            src = torch.cat([self._bytes(t.contiguous()) for t in ins])
        else:
            src = torch.empty(dst.numel() * self.size(), dtype=dst.dtype, device=dst.device)  # shape only
        call.track(call.comm.scatter(src, out=dst, root=root, async_op=True))
        return self._finish(call, [y])

    # -- reduce_scatter -------------------------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        if self._delegate(output_tensors):
            return self._cpu_backend.reduce_scatter(output_tensors, input_tensors, opts)
        what = "reduce_scatter"
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one output tensor and one input list per call")
        y, ins = output_tensors[0], input_tensors[0]
        self._check_list(what, "input_list", ins, y)
        call = self._begin(what, [y, *ins])
        parts = [self._reduce_args(what, opts.reduceOp, t.contiguous()) for t in ins]
        _, gop, factor = parts[0]
        packed = torch.cat([p[0] for p in parts])
        dst, _, _ = self._reduce_args(what, opts.reduceOp, call.out(y))
        call.track(call.comm.reduce_scatter(packed, out=dst, op=self._gop(gop, factor), async_op=True))
        return self._finish(call, [y])

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        if self._delegate([output_tensor, input_tensor]):
            return self._cpu_backend._reduce_scatter_base(output_tensor, input_tensor, opts)
        what = "reduce_scatter_tensor"
        self._check_same_dtype(what, output_tensor, input_tensor)
        if input_tensor.numel() != output_tensor.numel() * self.size():
            raise InvalidArgument(f"{what}: input_tensor has {input_tensor.numel()} elements; it needs world_size "
                                  f"({self.size()}) x output_tensor's {output_tensor.numel()}")
        call = self._begin(what, [output_tensor, input_tensor])
        src, gop, factor = self._reduce_args(what, opts.reduceOp, input_tensor.contiguous())
        dst, _, _ = self._reduce_args(what, opts.reduceOp, call.out(output_tensor))
        call.track(call.comm.reduce_scatter(src, out=dst, op=self._gop(gop, factor), async_op=True))
        return self._finish(call, [output_tensor])

    _reduce_scatter_base = reduce_scatter_single  # torch <= 2.12

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch <= 2.12

    def barrier(self, opts=None):
        """On GPU `device_ids[0]` where torch names one (``dist.barrier(device_ids=[i])``, as NCCL does), else on a
        CUDA communicator the group has (its GPU work is done first, as with NCCL's barrier), else on CPU."""
        ids = list(getattr(opts, "device_ids", None) or ()) if opts is not None else []
        if self._cpu_backend is not None and not ids and not any(k.startswith("cuda") for k in self._comms):
            return self._cpu_backend.barrier(opts if opts is not None else c10d.BarrierOptions())
        self._drain()
        if self._p2p:
            self._flush_p2p()
        cuda = [k for k in self._comms if k.startswith("cuda")]
        if ids:
            self.communicator(torch.device("cuda", int(ids[0]))).barrier()
        elif cuda:
            self._comms[cuda[0]].barrier()
        else:
            self.communicator("cpu").barrier()
        return Work([])

    def _start_coalescing(self, device=None) -> None:
        """Sends and receives issued until _end_coalescing are queued anyway; nothing else to do."""

    def _end_coalescing(self, device=None):
        works = [item[3] for item in self._p2p]
        self._flush_p2p()
        return self._combine(works, [])

    def shutdown(self) -> None:
        """Closes this group's communicators (called by destroy_process_group)."""
        try:
            self._worker.close()
        except Exception as e:  # noqa: BLE001 - teardown never raises
            _log.debug(f"stopping the gpucoll worker thread failed: {e}")
        self._closed = True
        comms, self._comms = dict(self._comms), {}
        for comm in comms.values():
            try:
                comm.close()
            except Exception as e:  # noqa: BLE001 - teardown never raises
                _log.debug(f"closing a gpucoll communicator failed: {e}")
        if self._cpu_backend is not None and hasattr(self._cpu_backend, "shutdown"):
            try:
                self._cpu_backend.shutdown()
            except Exception as e:  # noqa: BLE001
                _log.debug(f"shutting down the CPU backend failed: {e}")

    def abort(self) -> None:
        comms, self._comms = dict(self._comms), {}
        self._closed = True
        for comm in comms.values():
            try:
                comm.abort()
            except Exception as e:  # noqa: BLE001
                _log.debug(f"aborting a gpucoll communicator failed: {e}")

    # -- helpers --------------------------------------------------------------------------------------------------
    def _root(self, what: str, value, name: str = "root") -> int:
        value = int(value)
        if not 0 <= value < self.size():
            raise InvalidArgument(f"{what}: {name} rank {value} is not in this group of {self.size()}")
        return value

    @staticmethod
    def _check_same_dtype(what, a, b) -> None:
        if a.dtype != b.dtype:
            raise InvalidArgument(f"{what}: input and output need one dtype; got {b.dtype} and {a.dtype}")

    def _check_list(self, what: str, arg: str, tensors, like) -> None:
        if len(tensors) != self.size():
            raise InvalidArgument(f"{what}: {arg} needs world_size ({self.size()}) tensors; got {len(tensors)}")
        for t in tensors:
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise InvalidArgument(f"{what}: every tensor of {arg} needs the dtype and size of the tensor "
                                      f"({like.dtype}, {like.numel()} elements); got {t.dtype} with {t.numel()}")

    @staticmethod
    def _combine(works, outputs) -> Work:
        gworks, deps, event, device = [], [], None, None
        for w in works:
            if isinstance(w, Work):
                gworks += w._gworks
                event, device = w._event or event, w._device or device
            else:
                deps.append(w)
        return Work(outputs, gworks=gworks, event=event, device=device, deps=deps)


def create(store, rank: int, size: int, timeout=None) -> ProcessGroupGpucoll:
    """The creator registered with torch.distributed.Backend.register_backend("gpucoll", ...)."""
    return ProcessGroupGpucoll(store, rank, size, timeout, cpu_backend=_cpu_backend_from_caller(store, rank, size,
                                                                                                  timeout))
