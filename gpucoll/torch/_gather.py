"""Copying methods of ``ProcessGroupGpucoll`` (a mixin, split out for size): broadcast, all_gather in its forms,
gather and scatter. Any dtype moves, as bytes where gpucoll has no such dtype. The methods rely on the process
group's helpers (``_begin``, ``_finish``, ``_bytes``, ``_delegate``, ...), documented in process_group.py.
"""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as c10d

from gpucoll.errors import InvalidArgument, Unsupported


class GatherMixin:
    # -- broadcast / reduce ---------------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if opts is None:
            opts = c10d.BroadcastOptions()
        what = "broadcast"
        if self._delegate(what, tensors):
            return self._cpu_backend.broadcast(tensors, opts)
        root = self._root(what, opts.rootRank)
        if len(tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one tensor per call; got {len(tensors)}")
        call = self._begin(what, tensors)
        buf = call.out(tensors[0], keep=self.rank() == root)
        call.track(call.comm.broadcast(self._bytes(buf), root=root, async_op=call.cuda))
        return self._finish(call, list(tensors))

    # -- all_gather -----------------------------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        what = "all_gather"
        if self._delegate(what, input_tensors):
            return self._cpu_backend.allgather(output_tensors, input_tensors, opts)
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one input tensor and one output list per call")
        x, outs = input_tensors[0], output_tensors[0]
        self._check_list(what, "tensor_list", outs, x)
        call = self._begin(what, [x, *outs])
        flat = self._bytes(x.contiguous())
        gathered = call.result(call.comm.all_gather(flat, async_op=call.cuda)).view(self.size(), -1)
        for r, o in enumerate(outs):
            dst = call.out(o)
            self._bytes(dst).copy_(gathered[r])
        return self._finish(call, [list(outs)])

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        if opts is None:
            opts = c10d.AllgatherOptions()
        what = "all_gather_into_tensor"
        if self._delegate(what, [output_tensor, input_tensor]):
            return self._cpu_backend._allgather_base(output_tensor, input_tensor, opts)
        self._check_same_dtype(what, output_tensor, input_tensor)
        if output_tensor.numel() != input_tensor.numel() * self.size():
            raise InvalidArgument(f"{what}: output_tensor has {output_tensor.numel()} elements; it needs world_size "
                                  f"({self.size()}) x input_tensor's {input_tensor.numel()}")
        call = self._begin(what, [output_tensor, input_tensor])
        dst = call.out(output_tensor)
        src = input_tensor.contiguous()
        call.track(call.comm.all_gather(self._bytes(src), out=self._bytes(dst), async_op=call.cuda))
        return self._finish(call, [output_tensor])

    _allgather_base = all_gather_single  # torch <= 2.12

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's layout: ``output_lists[r][i]`` receives rank r's ``input_list[i]`` (one output list per rank).
        The inputs travel packed, as one all_gather of their bytes."""
        if opts is None:
            opts = c10d.AllgatherOptions()
        what = "all_gather_coalesced"
        if self._delegate(what, input_list):
            return self._cpu_backend.allgather_coalesced(output_lists, input_list, opts)
        n = self.size()
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
        call = self._begin(what, [*input_list, *(o for outs in output_lists for o in outs)])
        flats = [self._bytes(x.contiguous()).view(torch.uint8) for x in input_list]
        packed = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8, device=call.device)
        gathered = call.result(call.comm.all_gather(packed, async_op=call.cuda)).view(n, -1)
        for r, outs in enumerate(output_lists):
            offset = 0
            for o, f in zip(outs, flats):
                self._bytes(call.out(o)).view(torch.uint8).copy_(gathered[r, offset:offset + f.numel()])
                offset += f.numel()
        return self._finish(call, [list(outs) for outs in output_lists])

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
        what = "gather"
        if self._delegate(what, input_tensors):
            return self._cpu_backend.gather(output_tensors, input_tensors, opts)
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
        got = call.result(call.comm.gather(self._bytes(x.contiguous()), root=root, async_op=call.cuda))
        if is_root:
            got = got.view(self.size(), -1)
            for r, o in enumerate(outs):
                self._bytes(call.out(o)).copy_(got[r])
        return self._finish(call, [list(outs)] if is_root else [])

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = c10d.ScatterOptions()
        what = "scatter"
        if self._delegate(what, output_tensors):
            return self._cpu_backend.scatter(output_tensors, input_tensors, opts)
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
        call.track(call.comm.scatter(src, out=dst, root=root, async_op=call.cuda))
        return self._finish(call, [y])

