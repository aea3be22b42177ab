"""The all-to-all methods of ``ProcessGroupGpucoll`` as table rows (gpucoll/torch/_call.py).

Even splits run as gpucoll's all_to_all; uneven splits and lists of tensors of different sizes run as one group of
sends and receives, as NCCL does (the host backend's group does the same).
"""

from __future__ import annotations

import torch._C._distributed_c10d as c10d

from gpucoll.errors import InvalidArgument
from gpucoll.torch._call import Collective, same_dtype
from gpucoll.torch._convert import moved


def _check_single(group, call, output, input, output_split_sizes, input_split_sizes, opts) -> None:
    same_dtype(call.what, output, input)
    _splits(group, call.what, "input", input, input_split_sizes)
    _splits(group, call.what, "output", output, output_split_sizes)


def _all_to_all_single(group, call, output, input, output_split_sizes, input_split_sizes, opts) -> list:
    in_rows = _splits(group, call.what, "input", input, input_split_sizes)
    out_rows = _splits(group, call.what, "output", output, output_split_sizes)
    dst = call.out(output)
    if len(set(in_rows)) == 1 and len(set(out_rows)) == 1 and in_rows[0] == out_rows[0]:
        call.track(call.comm.all_to_all(moved(input.contiguous()), out=moved(dst), async_op=call.cuda))
    else:  # uneven splits: one group of sends and receives (NCCL's own way; the host backend's group does the same)
        _exchange(group, call, _rows(input.contiguous(), in_rows), _rows(dst, out_rows))
    return [output]


def _check_lists(group, call, outputs, inputs, opts) -> None:
    n = group.size()
    if len(outputs) != n or len(inputs) != n:
        raise InvalidArgument(f"{call.what}: needs world_size ({n}) input and output tensors; got {len(inputs)} and "
                              f"{len(outputs)}")
    for o, i in zip(outputs, inputs):
        same_dtype(call.what, o, i)


def _all_to_all(group, call, outputs, inputs, opts) -> list:
    _exchange(group, call, [moved(t.contiguous()) for t in inputs], [moved(call.out(t)) for t in outputs])
    return list(outputs)


def _exchange(group, call, sends, recvs) -> None:
    """recvs[j] <- rank j's sends[me], for every j, as one group."""
    me, n = group.rank(), group.size()
    if recvs[me].numel() != sends[me].numel():
        raise InvalidArgument(f"all_to_all: this rank sends itself {sends[me].numel()} bytes but expects "
                              f"{recvs[me].numel()}")
    recvs[me].copy_(sends[me])
    comm = call.comm
    with comm.group():
        for k in range(1, n):
            to, frm = (me + k) % n, (me - k) % n
            call.track(comm.send(sends[to], to, async_op=True))
            call.track(comm.recv(recvs[frm], frm, async_op=True))


def _splits(group, what, arg, t, sizes) -> list:
    n = group.size()
    rows = t.shape[0] if t.dim() > 0 else 1
    if not sizes:
        if rows % n:
            raise InvalidArgument(f"{what}: {arg} has {rows} rows, which world_size ({n}) does not divide; pass "
                                  f"{arg}_split_sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise InvalidArgument(f"{what}: {arg}_split_sizes must be world_size ({n}) non-negative row counts "
                              f"adding up to {arg}'s {rows} rows; got {sizes}")
    return sizes


def _rows(t, rows) -> list:
    flat = moved(t)
    per_row = flat.numel() // max(sum(rows), 1)
    out, offset = [], 0
    for r in rows:
        out.append(flat[offset:offset + r * per_row])
        offset += r * per_row
    return out


ROWS = (
    Collective("all_to_all_single", "all_to_all_single", c10d.AllToAllOptions, _all_to_all_single,
               placed=lambda out, inp, out_splits, in_splits: [out, inp], check=_check_single, gloo="alltoall_base",
               aliases=("alltoall_base",)),  # torch <= 2.12
    Collective("alltoall", "all_to_all", c10d.AllToAllOptions, _all_to_all, placed=lambda outs, ins: ins,
               tensors=lambda outs, ins: [*outs, *ins], check=_check_lists),
)
