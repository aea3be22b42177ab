"""The copying methods of ``ProcessGroupGpucoll`` as table rows (gpucoll/torch/_call.py): broadcast, all_gather in
its forms, gather and scatter. Any dtype moves, as bytes where gpucoll has no such dtype (_convert.moved).
"""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as c10d

from gpucoll.errors import InvalidArgument
from gpucoll.torch._call import Collective, check_list, one, one_and_list, world_times
from gpucoll.torch._convert import moved


def _broadcast(group, call, tensors, opts) -> list:
    buf = call.out(tensors[0], keep=group.rank() == call.root)
    call.track(call.comm.broadcast(moved(buf), root=call.root, async_op=call.cuda))
    return list(tensors)


# -- all_gather -----------------------------------------------------------------------------------------------------
def _all_gather(group, call, outputs, inputs, opts) -> list:
    outs = outputs[0]
    _spread(group, call, call.result(call.comm.all_gather(moved(inputs[0].contiguous()), async_op=call.cuda)), outs)
    return [list(outs)]


def _spread(group, call, gathered, outs) -> None:
    """outs[r] <- the r-th of world_size equal blocks of `gathered`."""
    gathered = gathered.view(group.size(), -1)
    for r, o in enumerate(outs):
        moved(call.out(o)).copy_(gathered[r])


def _all_gather_tensor(group, call, output, input, opts) -> list:
    dst = call.out(output)
    call.track(call.comm.all_gather(moved(input.contiguous()), out=moved(dst), async_op=call.cuda))
    return [output]


def _check_all_gather_coalesced(group, call, output_lists, input_list, opts) -> None:
    what, n = call.what, group.size()
    if len(output_lists) != n:
        raise InvalidArgument(f"{what}: output_tensor_lists needs one list per rank (world_size {n}); got "
                              f"{len(output_lists)}")
    for r, outs in enumerate(output_lists):
        if len(outs) != len(input_list):
            raise InvalidArgument(f"{what}: output_tensor_lists[{r}] needs one tensor per input "
                                  f"({len(input_list)}); got {len(outs)}")
        for i, (o, x) in enumerate(zip(outs, input_list)):
            if o.dtype != x.dtype or o.numel() != x.numel():
                raise InvalidArgument(f"{what}: output_tensor_lists[{r}][{i}] ({o.dtype}, {o.numel()} elements) "
                                      f"must match input_tensor_list[{i}] ({x.dtype}, {x.numel()} elements)")


def _all_gather_coalesced(group, call, output_lists, input_list, opts) -> list:
    """torch's layout: ``output_lists[r][i]`` receives rank r's ``input_list[i]`` (one output list per rank). The
    inputs travel packed, as one all_gather of their bytes."""
    flats = [moved(x.contiguous()).view(torch.uint8) for x in input_list]
    packed = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8, device=call.device)
    gathered = call.result(call.comm.all_gather(packed, async_op=call.cuda)).view(group.size(), -1)
    for r, outs in enumerate(output_lists):
        offset = 0
        for o, f in zip(outs, flats):
            moved(call.out(o)).view(torch.uint8).copy_(gathered[r, offset:offset + f.numel()])
            offset += f.numel()
    return [list(outs) for outs in output_lists]


# -- gather / scatter -----------------------------------------------------------------------------------------------
def _rooted_list(group, call, mine, lists, arg) -> None:
    """gather's and scatter's checks: one tensor of this rank's own, and on root one per rank in `arg` (elsewhere
    none)."""
    one(call.what, mine, "input tensor" if arg == "gather_list" else "output tensor")
    listed = lists[0] if lists else []
    if group.rank() == call.root:
        check_list(group, call.what, arg, listed, mine[0])
    elif listed:
        raise InvalidArgument(f"{call.what}: {arg} must be empty on non-root ranks")


def _gather(group, call, outputs, inputs, opts) -> list:
    got = call.result(call.comm.gather(moved(inputs[0].contiguous()), root=call.root, async_op=call.cuda))
    if group.rank() != call.root:
        return []
    _spread(group, call, got, outputs[0])
    return [list(outputs[0])]


def _scatter(group, call, outputs, inputs, opts) -> list:
    y = outputs[0]
    dst = moved(call.out(y))
    if group.rank() == call.root:
        src = torch.cat([moved(t.contiguous()) for t in inputs[0]])
    else:
        src = torch.empty(dst.numel() * group.size(), dtype=dst.dtype, device=dst.device)  # shape only
    call.track(call.comm.scatter(src, out=dst, root=call.root, async_op=call.cuda))
    return [y]


ROWS = (
    Collective("broadcast", "broadcast", c10d.BroadcastOptions, _broadcast, placed=lambda ts: ts, root=True,
               check=lambda group, call, ts, opts: one(call.what, ts)),
    Collective("allgather", "all_gather", c10d.AllgatherOptions, _all_gather, placed=lambda outs, ins: ins,
               tensors=lambda outs, ins: [ins[0], *outs[0]],
               check=lambda group, call, outs, ins, opts: one_and_list(
                   group, call, ins, outs, "one input tensor and one output list", "tensor_list")),
    Collective("all_gather_single", "all_gather_into_tensor", c10d.AllgatherOptions, _all_gather_tensor,
               placed=lambda out, inp: [out, inp], gloo="_allgather_base",
               check=lambda group, call, out, inp, opts: world_times(group, call, out, inp, "output_tensor",
                                                                     "input_tensor"),
               aliases=("_allgather_base",),  # torch <= 2.12
               coalesced=("all_gather_single_coalesced", "allgather_into_tensor_coalesced")),
    Collective("allgather_coalesced", "all_gather_coalesced", c10d.AllgatherOptions, _all_gather_coalesced,
               placed=lambda outs, ins: ins, tensors=lambda outs, ins: [*ins, *(o for os in outs for o in os)],
               check=_check_all_gather_coalesced),
    Collective("gather", "gather", c10d.GatherOptions, _gather, placed=lambda outs, ins: ins, root=True,
               tensors=lambda outs, ins: [ins[0], *(outs[0] if outs else [])],
               check=lambda group, call, outs, ins, opts: _rooted_list(group, call, ins, outs, "gather_list")),
    Collective("scatter", "scatter", c10d.ScatterOptions, _scatter, placed=lambda outs, ins: outs, root=True,
               tensors=lambda outs, ins: [outs[0], *(ins[0] if ins else [])],
               check=lambda group, call, outs, ins, opts: _rooted_list(group, call, outs, ins, "scatter_list")),
)
