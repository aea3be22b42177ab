"""Reducing methods of ``ProcessGroupGpucoll`` (a mixin, split out for size): all_reduce in its forms, reduce and
reduce_scatter, and the mapping of torch's ReduceOp and dtypes onto gpucoll's.

torch's semantics throughout: AVG on integers truncates toward zero (as NCCL does), complex tensors reduce as pairs
of reals (SUM, AVG, PREMUL_SUM only), PREMUL_SUM scales each input first (natively on CUDA; on CPU the input is
scaled, then summed). What gpucoll cannot reduce raises ``gpucoll.Unsupported`` naming the dtype or op. The methods
rely on the process group's helpers (``_begin``, ``_finish``, ``_delegate``, ...), documented in process_group.py.
"""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from gpucoll.backends.premul import premul_sum
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument, RemoteError, Unsupported
from gpucoll.torch._call import _op_name, _premul_factor
from gpucoll.torch.errors import torch_error, translates_itself
from gpucoll.torch.work import Work

# dtypes gpucoll reduces; every other dtype is moved as bytes by the copying collectives.
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.int64)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg", "PREMUL_SUM": "premul_sum"}
_BITWISE = ("BAND", "BOR", "BXOR")


def _now_ops() -> dict:
    """The one-call path of a CPU all_reduce (ReduceMixin.allreduce): gpucoll's op name for each torch ReduceOp that
    means the same on every dtype, keyed by hash(ReduceOp), which torch makes its RedOpType's value: the native call
    reads the op with one hash where Python compared it with each kind (0.13 us each; naming it through _op_name is
    5 us, more than the whole reduction). Empty, and the path off, where the hashes do not tell every kind apart
    (PREMUL_SUM included: taken for a SUM, it would be silently wrong)."""
    ops = {}
    for name, kind in c10d.ReduceOp.RedOpType.__members__.items():
        try:
            ops[name] = c10d.ReduceOp(kind) if name != "PREMUL_SUM" else dist._make_nccl_premul_sum(2.0)
        except (AttributeError, RuntimeError):  # UNUSED, or a torch without the premul maker: nothing is known
            if name != "UNUSED":
                return {}
    try:
        hashes = {hash(op): name for name, op in ops.items()}
    except TypeError:  # a torch whose ReduceOp is not hashable
        return {}
    if len(hashes) != len(ops):
        return {}
    return {h: _OPS[name] for h, name in hashes.items() if name in _OPS and name != "PREMUL_SUM"}


_NOW_OPS = _now_ops()


class ReduceMixin:
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
        return premul_sum(float(factor))

    # -- all_reduce -----------------------------------------------------------------------------------------------
    @translates_itself
    def allreduce(self, tensors, opts=None):
        try:
            if opts is None:
                opts = c10d.AllreduceOptions()
            else:
                # dist.all_reduce(t) waited for at once, once the group's host communicator exists and no send or
                # recv is queued before it (queued all-reduces run first, in C++): one native call reads torch's
                # arguments and runs a plain CPU tensor of a dtype the host backend reduces, with an op that means
                # the same on all of them. It declines anything else, having run nothing, and the general path
                # below runs the call with the same result.
                host = self._host
                if host is not None and not self._p2p and not host[0]._closed:
                    try:
                        if host[1](tensors, opts):
                            return self._done.get(tensors)
                    except (CollectiveTimeout, RemoteError) as e:
                        host[0]._failure(e)  # as Communicator.all_reduce records it: the flight recorder's dump
                        raise
            return self._allreduce(tensors, opts)
        except GpucollError as e:
            torch_error(e)
            raise

    def _allreduce(self, tensors, opts):
        if self._delegate("all_reduce", tensors):
            return self._cpu_backend.allreduce(tensors, opts)
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:
            return self._allreduce_sparse(tensors[0], opts.reduceOp)
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
        call.track(call.comm.all_reduce(flat, op=self._gop(gop, factor), async_op=call.cuda))
        return self._finish(call, [tensor])

    def _allreduce_background(self, what, tensor, op) -> Work:
        """A contiguous CPU all_reduce, run on the host communicator's progress thread (argument errors are still
        raised here)."""
        flat, gop, factor = self._reduce_args(what, op, tensor)
        if self._p2p:
            self._flush_p2p()
        comm = self.communicator("cpu", what=what)
        return Work([tensor], works=[comm.all_reduce(flat, op=self._gop(gop, factor), async_op=True)])

    def _allreduce_sparse(self, t, op) -> Work:
        """A sparse COO all_reduce (SUM, CPU), as gloo does it: every rank's indices and values are gathered and the
        sum is their coalesced concatenation in rank order; the result replaces `t`."""
        what = "all_reduce (sparse)"
        if _op_name(op) != "SUM" or t.device.type != "cpu":
            raise Unsupported(f"{what}: gpucoll reduces sparse COO tensors with SUM on CPU; got ReduceOp."
                              f"{_op_name(op)} on {t.device}")
        if self._p2p:
            self._flush_p2p()
        comm = self.communicator("cpu", what=what)
        s = t.coalesce()
        idx, val = s.indices(), s.values()
        counts = comm.all_gather(torch.tensor([idx.shape[1]], dtype=torch.int64)).tolist()
        most = max(counts)
        pad_idx = torch.zeros(idx.shape[0], most, dtype=torch.int64)
        pad_idx[:, :idx.shape[1]] = idx
        pad_val = torch.zeros((most, *val.shape[1:]), dtype=val.dtype)
        pad_val[:val.shape[0]] = val
        all_idx = comm.all_gather(pad_idx.reshape(-1)).view(self.size(), idx.shape[0], most)
        all_val = comm.all_gather(self._bytes(pad_val.contiguous()).view(torch.uint8))
        all_val = all_val.view(self.size(), -1).view(val.dtype).view(self.size(), most, *val.shape[1:])
        total = torch.sparse_coo_tensor(torch.cat([all_idx[r, :, :c] for r, c in enumerate(counts)], dim=1),
                                        torch.cat([all_val[r, :c] for r, c in enumerate(counts)]),
                                        t.shape).coalesce()
        t.copy_(total)
        return Work([t])

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
        call.track(call.comm.all_reduce(local, op="sum" if gop in ("avg", "premul_sum") else gop, async_op=call.cuda))
        if gop == "avg":
            n = self.size() * len(tensors)
            local = local.div(n) if local.is_floating_point() else torch.div(local, n, rounding_mode="trunc")
        for t in tensors:
            dst = call.out(t)
            (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1).copy_(local)
        return self._finish(call, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce over the tensors packed together: dist.all_reduce_coalesced, and the all-reduces issued
        inside dist._coalescing_manager (FSDP, DDP), which torch hands over here as one list. CPU tensors go to the
        host communicator's all_reduce_coalesced (one native call: packed in C++, or reduced in place where they are
        consecutive views of one buffer); CUDA tensors are packed with torch.cat into one all_reduce."""
        if opts is None:
            opts = c10d.AllreduceCoalescedOptions()
        what = "all_reduce_coalesced"
        if self._delegate(what, tensors):
            return self._cpu_backend.allreduce_coalesced(tensors, opts)
        if len(tensors) == 1:
            return self._allreduce_one(what, tensors[0], opts.reduceOp)
        call = self._begin(what, tensors)
        if not call.cuda:
            return self._allreduce_coalesced_cpu(what, call, tensors, opts.reduceOp)
        views = [self._reduce_args(what, opts.reduceOp, t.contiguous()) for t in tensors]
        dtypes = {v[0].dtype for v in views}
        if len(dtypes) != 1:
            raise InvalidArgument(f"{what}: every tensor needs one dtype; got {sorted(map(str, dtypes))}")
        _, gop, factor = views[0]
        packed = torch.cat([v[0] for v in views])
        call.track(call.comm.all_reduce(packed, op=self._gop(gop, factor), async_op=call.cuda))
        offset = 0
        for t in tensors:
            dst = call.out(t)
            view = (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1)
            view.copy_(packed[offset:offset + view.numel()])
            offset += view.numel()
        return self._finish(call, list(tensors))

    def _allreduce_coalesced_cpu(self, what, call, tensors, op) -> Work:
        # The op and dtype are checked once, on the first tensor: every tensor has its dtype (checked here) and the
        # op is the same for all. Complex tensors reduce as their real pairs; strided or lazily negated ones through
        # a contiguous copy written back by _finish.
        _, gop, factor = self._reduce_args(what, op, tensors[0])
        first = tensors[0].dtype
        outs = []
        for i, t in enumerate(tensors):
            if t.dtype != first:
                raise InvalidArgument(f"{what}: every tensor needs one dtype; tensors[{i}] is {t.dtype}, tensors[0] "
                                      f"{first}")
            o = call.out(t, keep=True)
            outs.append(torch.view_as_real(o) if o.is_complex() else o)
        call.comm.all_reduce_coalesced(outs, op=self._gop(gop, factor))
        return self._finish(call, list(tensors))

    def reduce(self, tensors, opts=None):
        if opts is None:
            opts = c10d.ReduceOptions()
        what = "reduce"
        if self._delegate(what, tensors):
            return self._cpu_backend.reduce(tensors, opts)
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
        call.track(call.comm.reduce(src, op=self._gop(gop, factor), root=root, async_op=call.cuda))
        if is_root and src.data_ptr() != t.data_ptr():
            dst = call.out(t)
            (torch.view_as_real(dst) if dst.is_complex() else dst).reshape(-1).copy_(src)
        return self._finish(call, list(tensors))

    # -- reduce_scatter -------------------------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        what = "reduce_scatter"
        if self._delegate(what, output_tensors):
            return self._cpu_backend.reduce_scatter(output_tensors, input_tensors, opts)
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one output tensor and one input list per call")
        y, ins = output_tensors[0], input_tensors[0]
        self._check_list(what, "input_list", ins, y)
        call = self._begin(what, [y, *ins])
        parts = [self._reduce_args(what, opts.reduceOp, t.contiguous()) for t in ins]
        _, gop, factor = parts[0]
        packed = torch.cat([p[0] for p in parts])
        dst, _, _ = self._reduce_args(what, opts.reduceOp, call.out(y))
        call.track(call.comm.reduce_scatter(packed, out=dst, op=self._gop(gop, factor), async_op=call.cuda))
        return self._finish(call, [y])

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        what = "reduce_scatter_tensor"
        if self._delegate(what, [output_tensor, input_tensor]):
            return self._cpu_backend._reduce_scatter_base(output_tensor, input_tensor, opts)
        self._check_same_dtype(what, output_tensor, input_tensor)
        if input_tensor.numel() != output_tensor.numel() * self.size():
            raise InvalidArgument(f"{what}: input_tensor has {input_tensor.numel()} elements; it needs world_size "
                                  f"({self.size()}) x output_tensor's {output_tensor.numel()}")
        call = self._begin(what, [output_tensor, input_tensor])
        src, gop, factor = self._reduce_args(what, opts.reduceOp, input_tensor.contiguous())
        dst, _, _ = self._reduce_args(what, opts.reduceOp, call.out(output_tensor))
        call.track(call.comm.reduce_scatter(src, out=dst, op=self._gop(gop, factor), async_op=call.cuda))
        return self._finish(call, [output_tensor])

    _reduce_scatter_base = reduce_scatter_single  # torch <= 2.12

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = c10d.ReduceScatterOptions()
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._combine(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch <= 2.12

