"""Coalesced collectives (tensor fusion): Communicator.all_reduce_coalesced and all_gather_coalesced, split out of
communicator.py for size.

Many small arrays cost one collective's fixed part each (the host backend's call check and step hand-offs, a kernel
launch and NCCL's set-up on a GPU); fused, they cost it about once. What each backend does:

* host: one native call (csrc/python/host_coalesced.cc), one collective per chunk of GPUCOLL_HOST_FUSION_BYTES; the
  all-reduce's copy-in gathers from the arrays and its result is written straight into them (no staging copy),
  the all-gather stages through a buffer of at most that size per communicator.
* nccl: one all_reduce (all_gather) per array inside one ncclGroupStart/End, which NCCL fuses into one launch.
* custom: one call per array (its kernels run one array each; what they hand to NCCL is not grouped).
"""

from __future__ import annotations

import bisect

from gpucoll import _buffers
from gpucoll._native import _C
from gpucoll.errors import CollectiveTimeout, InvalidArgument, RemoteError


def _as_list(arrays, arg: str) -> list:
    if isinstance(arrays, (list, tuple)):
        return arrays
    raise InvalidArgument(f"{arg} must be a list or tuple of arrays; got {type(arrays).__name__}")


def _resolve_all(comm, arrays, arg: str, writable: bool) -> list:
    """Every array resolved and checked like a single call's `x`, naming `arg[i]`; one dtype and one device."""
    bufs = [comm._resolve(a, f"{arg}[{i}]", writable=writable) for i, a in enumerate(arrays)]
    for i, b in enumerate(bufs[1:], 1):
        if b.dtype_name != bufs[0].dtype_name:
            raise InvalidArgument(f"{arg}[{i}] has dtype {b.dtype_name} but {arg}[0] has {bufs[0].dtype_name}: a "
                                  f"coalesced call takes arrays of one dtype (make one call per dtype)")
        if b.device != bufs[0].device:
            raise InvalidArgument(f"{arg}[{i}] is on {b.device} but {arg}[0] on {bufs[0].device}: a coalesced call "
                                  f"takes arrays of one device")
    # Sorted by address, an overlap is between neighbours (n log n: lists run to thousands of arrays).
    order = sorted((i for i, b in enumerate(bufs) if b.nbytes), key=lambda i: bufs[i].ptr)
    for i, j in zip(order, order[1:]):
        if bufs[i].overlaps(bufs[j]):
            i, j = min(i, j), max(i, j)
            raise InvalidArgument(f"{arg}[{j}] overlaps {arg}[{i}]: each array is written in place, so they must "
                                  f"not share memory")
    return bufs


def _overlap_with(outs: list, ins: list):
    """(i, j) where outs[i] overlaps ins[j], or None, in n log n (lists run to thousands of arrays): among the inputs
    that start before an output ends, the one reaching furthest decides."""
    spans = sorted((b.ptr, b.ptr + b.nbytes, j) for j, b in enumerate(ins) if b.nbytes)
    starts = [s for s, _, _ in spans]
    reach, end, who = [], -1, -1
    for _, e, j in spans:
        if e > end:
            end, who = e, j
        reach.append((end, who))
    for i, d in enumerate(outs):
        k = bisect.bisect_left(starts, d.ptr + d.nbytes) - 1
        if d.nbytes and k >= 0 and reach[k][0] > d.ptr:
            return i, reach[k][1]
    return None


def all_reduce(comm, arrays, redop, async_op: bool):
    """Communicator.all_reduce_coalesced with `redop` parsed: the backend's Work, or None where it finished."""
    arrays = _as_list(arrays, "arrays")
    ops = comm._ops
    try:
        fast = getattr(ops, "fast_all_reduce_coalesced", None)
        declined = fast(arrays, redop, async_op) if fast is not None and type(redop) is _C.RedOp else 0
        if not isinstance(declined, int):  # it ran: None, or its Work
            return declined
        # The native reader declined arrays[declined] (or there is none): the general path names what is wrong with
        # it, or takes what the reader does not (empty arrays, other buffer types).
        bufs = _resolve_all(comm, arrays, "arrays", writable=True)
        return ops.all_reduce_coalesced(bufs, redop, async_op, arrays)
    except (CollectiveTimeout, RemoteError) as e:
        comm._failure(e)
        raise


def all_gather(comm, inputs, outputs, async_op: bool):
    """Communicator.all_gather_coalesced: (the backend's Work or None, the outputs)."""
    inputs = _as_list(inputs, "inputs")
    srcs = _resolve_all(comm, inputs, "inputs", writable=False)
    world = comm.world_size
    if outputs is None:
        dsts = [comm._resolve(_buffers.empty_like(s, s.count * world, comm._scaled_shape(s, world)), f"outputs[{i}]",
                              writable=True) for i, s in enumerate(srcs)]
    else:
        outputs = _as_list(outputs, "outputs")
        if len(outputs) != len(inputs):
            raise InvalidArgument(f"outputs must have one array per input ({len(inputs)}); got {len(outputs)}")
        dsts = _resolve_all(comm, outputs, "outputs", writable=True)
        for i, (s, d) in enumerate(zip(srcs, dsts)):
            if d.dtype_name != s.dtype_name or d.count != s.count * world:
                raise InvalidArgument(f"outputs[{i}] must be {world} x inputs[{i}]'s {s.count} {s.dtype_name} "
                                      f"elements; got {d.count} {d.dtype_name}")
        hit = _overlap_with(dsts, srcs)
        if hit is not None:
            raise InvalidArgument(f"outputs[{hit[0]}] overlaps inputs[{hit[1]}]; pass separate arrays")
    try:
        work = comm._ops.all_gather_coalesced(srcs, dsts, async_op)
    except (CollectiveTimeout, RemoteError) as e:
        comm._failure(e)
        raise
    return work, [d.obj for d in dsts]
