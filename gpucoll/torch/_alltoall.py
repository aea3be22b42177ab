"""All-to-all methods of ``ProcessGroupGpucoll`` (a mixin, split out for size).

Even splits run as gpucoll's all_to_all; uneven splits and lists of tensors of different sizes run as one group of
sends and receives, as NCCL does (the host backend's group does the same). The methods rely on the process group's
helpers (``_begin``, ``_finish``, ``_bytes``, ``_delegate``, ...), documented in process_group.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch._C._distributed_c10d as c10d

from gpucoll.errors import InvalidArgument

if TYPE_CHECKING:
    from gpucoll.torch._call import _Call


class AllToAllMixin:
    # -- all_to_all -----------------------------------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if opts is None:
            opts = c10d.AllToAllOptions()
        what = "all_to_all_single"
        if self._delegate(what, [output, input]):
            return self._cpu_backend.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        self._check_same_dtype(what, output, input)
        in_rows, out_rows = self._splits(what, "input", input, input_split_sizes), \
            self._splits(what, "output", output, output_split_sizes)
        call = self._begin(what, [output, input])
        dst = call.out(output)
        if len(set(in_rows)) == 1 and len(set(out_rows)) == 1 and in_rows[0] == out_rows[0]:
            call.track(call.comm.all_to_all(self._bytes(input.contiguous()), out=self._bytes(dst), async_op=call.cuda))
            return self._finish(call, [output])
        # Uneven splits: one group of sends and receives (NCCL's own way; the host backend's group does the same).
        src = input.contiguous()
        sends = self._rows(src, in_rows)
        recvs = self._rows(dst, out_rows)
        self._exchange(call, sends, recvs)
        return self._finish(call, [output])

    alltoall_base = all_to_all_single  # torch <= 2.12

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.AllToAllOptions()
        what = "all_to_all"
        if self._delegate(what, input_tensors):
            return self._cpu_backend.alltoall(output_tensors, input_tensors, opts)
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgument(f"{what}: needs world_size ({n}) input and output tensors; got "
                                  f"{len(input_tensors)} and {len(output_tensors)}")
        for o, i in zip(output_tensors, input_tensors):
            self._check_same_dtype(what, o, i)
        call = self._begin(what, [*output_tensors, *input_tensors])
        sends = [self._bytes(t.contiguous()) for t in input_tensors]
        recvs = [self._bytes(call.out(t)) for t in output_tensors]
        self._exchange(call, sends, recvs)
        return self._finish(call, list(output_tensors))

    def _exchange(self, call: _Call, sends, recvs) -> None:
        """recvs[j] <- rank j's sends[me], for every j, as one group."""
        me = self.rank()
        if recvs[me].numel() != sends[me].numel():
            raise InvalidArgument(f"all_to_all: this rank sends itself {sends[me].numel()} bytes but expects "
                                  f"{recvs[me].numel()}")
        recvs[me].copy_(sends[me])
        comm = call.comm
        with comm.group():
            for k in range(1, self.size()):
                to, frm = (me + k) % self.size(), (me - k) % self.size()
                call.track(comm.send(sends[to], to, async_op=True))
                call.track(comm.recv(recvs[frm], frm, async_op=True))

    def _splits(self, what, arg, t, sizes) -> list:
        n = self.size()
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

    def _rows(self, t, rows) -> list:
        flat = self._bytes(t)
        per_row = flat.numel() // max(sum(rows), 1)
        out, offset = [], 0
        for r in rows:
            out.append(flat[offset:offset + r * per_row])
            offset += r * per_row
        return out
