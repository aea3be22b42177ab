"""The reducing methods of ``ProcessGroupGpucoll`` as table rows (gpucoll/torch/_call.py): all_reduce in its forms,
reduce and reduce_scatter. The ops and dtypes are converted in gpucoll/torch/_convert.py; dist.all_reduce's one-call
path for CPU tensors is ProcessGroupGpucoll.allreduce, which falls back on the all_reduce row here.
"""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as c10d

from gpucoll.errors import InvalidArgument, Unsupported
from gpucoll.torch._call import Collective, one, one_and_list, world_times
from gpucoll.torch._convert import gpucoll_op, moved, op_name, reals, reduction
from gpucoll.torch.work import Work


def _one(call, tensor, op) -> list:
    buf = call.out(tensor, keep=True)
    flat, gop, factor = reduction(call.what, op, buf)
    call.track(call.comm.all_reduce(flat, op=gpucoll_op(gop, factor), async_op=call.cuda))
    return [tensor]


# -- all_reduce -----------------------------------------------------------------------------------------------------
def _all_reduce_alone(group, call, tensors, opts):
    """The two all-reduces of one tensor that need no context: a sparse one, and a contiguous CPU one that torch
    does not wait for at once (asyncOp, torch >= 2.7), run on the host communicator's progress thread (argument
    errors are still raised here), so that the caller goes on meanwhile."""
    if len(tensors) != 1:
        return None
    t = tensors[0]
    if t.layout == torch.sparse_coo:
        return _all_reduce_sparse(group, t, opts.reduceOp)
    if (getattr(opts, "asyncOp", True) and group._background and t.device.type == "cpu" and t.is_contiguous()
            and group._cpu_backend is None):
        flat, gop, factor = reduction(call.what, opts.reduceOp, t)
        if group._p2p:
            group._flush_p2p()
        comm = group.communicator("cpu", what=call.what)
        return Work([t], works=[comm.all_reduce(flat, op=gpucoll_op(gop, factor), async_op=True)])
    return None


def _all_reduce_sparse(group, t, op) -> Work:
    """A sparse COO all_reduce (SUM, CPU), as gloo does it: every rank's indices and values are gathered and the
    sum is their coalesced concatenation in rank order; the result replaces `t`."""
    what = "all_reduce (sparse)"
    if op_name(op) != "SUM" or t.device.type != "cpu":
        raise Unsupported(f"{what}: gpucoll reduces sparse COO tensors with SUM on CPU; got ReduceOp."
                          f"{op_name(op)} on {t.device}")
    if group._p2p:
        group._flush_p2p()
    comm, n = group.communicator("cpu", what=what), group.size()
    s = t.coalesce()
    idx, val = s.indices(), s.values()
    counts = comm.all_gather(torch.tensor([idx.shape[1]], dtype=torch.int64)).tolist()
    most = max(counts)
    pad_idx = torch.zeros(idx.shape[0], most, dtype=torch.int64)
    pad_idx[:, :idx.shape[1]] = idx
    pad_val = torch.zeros((most, *val.shape[1:]), dtype=val.dtype)
    pad_val[:val.shape[0]] = val
    all_idx = comm.all_gather(pad_idx.reshape(-1)).view(n, idx.shape[0], most)
    all_val = comm.all_gather(moved(pad_val.contiguous()).view(torch.uint8))
    all_val = all_val.view(n, -1).view(val.dtype).view(n, most, *val.shape[1:])
    total = torch.sparse_coo_tensor(torch.cat([all_idx[r, :, :c] for r, c in enumerate(counts)], dim=1),
                                    torch.cat([all_val[r, :c] for r, c in enumerate(counts)]), t.shape).coalesce()
    t.copy_(total)
    return Work([t])


def _check_all_reduce(group, call, tensors, opts) -> None:
    if len(tensors) == 1:
        return
    # torch's (gloo's) meaning of several tensors: every tensor of every rank is reduced into all of them.
    call.what = "all_reduce (list of tensors)"
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.numel() != first.numel():
            raise InvalidArgument(f"{call.what}: every tensor needs one dtype and size; got {first.dtype}"
                                  f"[{first.numel()}] and {t.dtype}[{t.numel()}]")


_LOCAL = {"sum": lambda s: s.sum(0), "avg": lambda s: s.sum(0), "premul_sum": lambda s: s.sum(0),
          "prod": lambda s: s.prod(0), "min": lambda s: s.amin(0), "max": lambda s: s.amax(0)}


def _all_reduce(group, call, tensors, opts) -> list:
    if len(tensors) == 1:
        return _one(call, tensors[0], opts.reduceOp)
    what, op = call.what, opts.reduceOp
    flat, gop, factor = reduction(what, op, tensors[0])
    local = _LOCAL[gop](torch.stack([reduction(what, op, t)[0] for t in tensors]))
    if gop == "premul_sum":
        local.mul_(factor)
    local = local.to(flat.dtype)
    call.track(call.comm.all_reduce(local, op="sum" if gop in ("avg", "premul_sum") else gop, async_op=call.cuda))
    if gop == "avg":
        n = group.size() * len(tensors)
        local = local.div(n) if local.is_floating_point() else torch.div(local, n, rounding_mode="trunc")
    for t in tensors:
        reals(call.out(t)).copy_(local)
    return list(tensors)


def _all_reduce_coalesced(group, call, tensors, opts) -> list:
    """One all_reduce over the tensors packed together: dist.all_reduce_coalesced, and the all-reduces issued
    inside dist._coalescing_manager (FSDP, DDP), which torch hands over here as one list. CPU tensors go to the
    host communicator's all_reduce_coalesced (one native call: packed in C++, or reduced in place where they are
    consecutive views of one buffer); CUDA tensors are packed with torch.cat into one all_reduce."""
    what, op = call.what, opts.reduceOp
    if len(tensors) == 1:
        return _one(call, tensors[0], op)
    if not call.cuda:
        # The op and dtype are checked once, on the first tensor: every tensor has its dtype (checked here) and the
        # op is the same for all. Complex tensors reduce as their real pairs; strided or lazily negated ones
        # through a contiguous copy written back by _finish.
        _, gop, factor = reduction(what, op, tensors[0])
        first = tensors[0].dtype
        outs = []
        for i, t in enumerate(tensors):
            if t.dtype != first:
                raise InvalidArgument(f"{what}: every tensor needs one dtype; tensors[{i}] is {t.dtype}, tensors[0] "
                                      f"{first}")
            o = call.out(t, keep=True)
            outs.append(torch.view_as_real(o) if o.is_complex() else o)
        call.comm.all_reduce_coalesced(outs, op=gpucoll_op(gop, factor))
        return list(tensors)
    views = [reduction(what, op, t.contiguous()) for t in tensors]
    dtypes = {v[0].dtype for v in views}
    if len(dtypes) != 1:
        raise InvalidArgument(f"{what}: every tensor needs one dtype; got {sorted(map(str, dtypes))}")
    _, gop, factor = views[0]
    packed = torch.cat([v[0] for v in views])
    call.track(call.comm.all_reduce(packed, op=gpucoll_op(gop, factor), async_op=call.cuda))
    offset = 0
    for t in tensors:
        view = reals(call.out(t))
        view.copy_(packed[offset:offset + view.numel()])
        offset += view.numel()
    return list(tensors)


# -- reduce, reduce_scatter -----------------------------------------------------------------------------------------
def _reduce(group, call, tensors, opts) -> list:
    t = tensors[0]
    flat, gop, factor = reduction(call.what, opts.reduceOp, t.contiguous())
    # gpucoll leaves non-root inputs as they were; on root the result lands in `flat`, copied back to `t` where
    # `flat` is not `t` itself (a strided `t`).
    call.track(call.comm.reduce(flat, op=gpucoll_op(gop, factor), root=call.root, async_op=call.cuda))
    if group.rank() == call.root and flat.data_ptr() != t.data_ptr():
        reals(call.out(t)).copy_(flat)
    return list(tensors)


def _reduce_scatter(group, call, outputs, inputs, opts) -> list:
    y = outputs[0]
    parts = [reduction(call.what, opts.reduceOp, t.contiguous()) for t in inputs[0]]
    _, gop, factor = parts[0]
    packed = torch.cat([p[0] for p in parts])
    dst, _, _ = reduction(call.what, opts.reduceOp, call.out(y))
    call.track(call.comm.reduce_scatter(packed, out=dst, op=gpucoll_op(gop, factor), async_op=call.cuda))
    return [y]


def _reduce_scatter_tensor(group, call, output, input, opts) -> list:
    src, gop, factor = reduction(call.what, opts.reduceOp, input.contiguous())
    dst, _, _ = reduction(call.what, opts.reduceOp, call.out(output))
    call.track(call.comm.reduce_scatter(src, out=dst, op=gpucoll_op(gop, factor), async_op=call.cuda))
    return [output]


ROWS = (
    # ProcessGroupGpucoll.allreduce runs dist.all_reduce's one-call path, then this row.
    Collective("_allreduce", "all_reduce", c10d.AllreduceOptions, _all_reduce, placed=lambda ts: ts,
               check=_check_all_reduce, shortcut=_all_reduce_alone, gloo="allreduce"),
    Collective("allreduce_coalesced", "all_reduce_coalesced", c10d.AllreduceCoalescedOptions, _all_reduce_coalesced,
               placed=lambda ts: ts),
    Collective("reduce", "reduce", c10d.ReduceOptions, _reduce, placed=lambda ts: ts, root=True,
               check=lambda group, call, ts, opts: one(call.what, ts)),
    Collective("reduce_scatter", "reduce_scatter", c10d.ReduceScatterOptions, _reduce_scatter,
               placed=lambda outs, ins: outs, tensors=lambda outs, ins: [outs[0], *ins[0]],
               check=lambda group, call, outs, ins, opts: one_and_list(
                   group, call, outs, ins, "one output tensor and one input list", "input_list")),
    Collective("reduce_scatter_single", "reduce_scatter_tensor", c10d.ReduceScatterOptions, _reduce_scatter_tensor,
               placed=lambda out, inp: [out, inp], gloo="_reduce_scatter_base",
               check=lambda group, call, out, inp, opts: world_times(group, call, out, inp, "input_tensor",
                                                                     "output_tensor"),
               aliases=("_reduce_scatter_base",),  # torch <= 2.12
               coalesced=("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")),
)
