"""How gpucoll's torch ProcessGroup runs an operation: a table row describes one torch method (``Collective``) and one
method runs every row (``methods``): torch's default options, CPU tensors to gloo where the group sends them there,
the row's shortcut, its checks (before any communication: a bad call leaves the group as it was), _begin, the row's
run (the communicator calls, and how torch's tensors map onto them), _finish, and gpucoll errors as torch's types.
Also here: the context of one call (``_Call``), the checks rows share, torch's timeout spelling."""

from __future__ import annotations

import datetime
import inspect
from typing import Callable, NamedTuple

import torch

from gpucoll import _timeout
from gpucoll.errors import GpucollError, InvalidArgument, Unsupported
from gpucoll.torch.errors import torch_error, translates_itself

BACKEND_NAME = "gpucoll"  # the name registered with torch.distributed


def _seconds(timeout) -> float:
    if timeout is None:
        return 1800.0
    if isinstance(timeout, datetime.timedelta):
        return _timeout.clamp(max(timeout.total_seconds(), 1e-3))  # torch allows any timedelta
    return _timeout.clamp(float(timeout))


class Collective(NamedTuple):
    """One torch method as gpucoll runs it. `run`, `check` and `shortcut` take (group, call, *torch's arguments,
    opts), where torch's arguments are those before opts (call.comm is made between check and run); `placed` and
    `tensors` take torch's arguments."""

    name: str  # the method torch calls
    what: str  # the operation's name in errors (torch.distributed's function)
    options: Callable  # torch's options type, made where torch passes none
    run: Callable  # -> the outputs the Work holds
    placed: Callable  # -> the tensors whose device says whether the call goes to gloo (all on CPU)
    tensors: Callable | None = None  # -> the tensors _begin puts on one device (default: placed)
    check: Callable | None = None  # raises on bad arguments, before any communication
    shortcut: Callable | None = None  # -> a Work where the call takes a path of its own (before check), else None
    gloo: str | None = None  # the torch backend's method a call going to gloo becomes (default: name)
    root: bool = False  # opts.rootRank names a rank of the group: checked, and kept as call.root
    aliases: tuple = ()  # older torch's names of the method
    coalesced: tuple = ()  # names of the method torch calls with lists of (output, input): this one on each pair


class _Call:
    """One operation in flight inside a method: its name and root, then (_begin) its device and communicator, what it
    enqueued, what to copy back."""

    __slots__ = ("comm", "cuda", "device", "root", "what", "works", "writebacks")

    def __init__(self, what: str, root=None):
        self.what = what
        self.root = root
        self.comm = self.device = None
        self.cuda = False
        self.works = []
        self.writebacks = []

    def track(self, result):
        """Keeps the gpucoll Work of an async_op=True call (CUDA; host calls are made synchronous: async_op=call.cuda)."""
        if self.cuda and result is not None and hasattr(result, "wait"):
            self.works.append(result)

    def result(self, returned):
        """What a collective called with async_op=self.cuda returned, as its synchronous call returns it (a CUDA
        call's Work is kept: track)."""
        if not self.cuda:
            return returned
        self.track(returned)
        return returned.result()

    def out(self, t: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """`t` as a contiguous tensor to write into: `t` itself, or for a strided `t` a contiguous one copied back
        into it at the end (holding `t`'s values first when `keep`: an in-place operation reads them). A lazily
        negated view (torch._neg_view: its memory holds -t) is such a `t` too."""
        if t.is_contiguous() and not t.is_neg():
            return t
        tmp = t.resolve_neg().contiguous() if keep else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self.writebacks.append((t, tmp))
        return tmp


def methods(rows) -> dict:
    """{method name: function} for the rows, aliases included: what the group's class carries."""
    made = {}
    for row in rows:
        made.update(dict.fromkeys((row.name, *row.aliases), _method(row)))
        if row.coalesced:
            made.update(dict.fromkeys(row.coalesced, _each(row)))
    return made


def _each(row: Collective):
    def method(self, outputs, inputs, opts=None):
        if opts is None:
            opts = row.options()
        single = getattr(self, row.name)
        return self._combine([single(o, i, opts) for o, i in zip(outputs, inputs)], list(outputs))

    method.__name__ = method.__qualname__ = row.coalesced[0]
    return translates_itself(method)  # only the single calls raise, translated


def _method(row: Collective):
    nargs = len(inspect.signature(row.run).parameters) - 3  # run's (group, call, ..., opts)
    tensors = row.tensors if row.tensors is not None else row.placed

    def method(self, *args, opts=None):
        if len(args) == nargs + 1 and opts is None:
            *args, opts = args
        elif len(args) != nargs:
            raise TypeError(f"{row.name}() takes {nargs} arguments and opts; got {len(args)}")
        try:
            if opts is None:
                opts = row.options()
            if self._delegate(row.what, row.placed(*args)):
                return getattr(self._cpu_backend, row.gloo or row.name)(*args, opts)
            call = _Call(row.what, rank_in(self, row.what, opts.rootRank) if row.root else None)
            if row.shortcut is not None:
                work = row.shortcut(self, call, *args, opts)
                if work is not None:
                    return work
            if row.check is not None:
                row.check(self, call, *args, opts)
            self._begin(call, tensors(*args))
            return self._finish(call, row.run(self, call, *args, opts))
        except GpucollError as e:
            torch_error(e)
            raise

    method.__name__ = method.__qualname__ = row.name
    method.__doc__ = row.run.__doc__
    return translates_itself(method)


# -- the checks the rows share ------------------------------------------------------------------------------------
def rank_in(group, what: str, value, name: str = "root") -> int:
    value = int(value)
    if not 0 <= value < group.size():
        raise InvalidArgument(f"{what}: {name} rank {value} is not in this group of {group.size()}")
    return value


def same_dtype(what: str, a, b) -> None:
    if a.dtype != b.dtype:
        raise InvalidArgument(f"{what}: input and output need one dtype; got {b.dtype} and {a.dtype}")


def world_times(group, call, output, input, big: str, small: str) -> None:
    """all_gather_into_tensor's and reduce_scatter_tensor's check: one dtype, and the tensor named `big`
    ("output_tensor" or "input_tensor") world_size times the other."""
    same_dtype(call.what, output, input)
    sizes = {"output_tensor": output.numel(), "input_tensor": input.numel()}
    if sizes[big] != sizes[small] * group.size():
        raise InvalidArgument(f"{call.what}: {big} has {sizes[big]} elements; it needs world_size ({group.size()}) x "
                              f"{small}'s {sizes[small]}")


def check_list(group, what: str, arg: str, tensors, like) -> None:
    """`tensors` (torch's argument `arg`) holds one tensor per rank, each of `like`'s dtype and size."""
    if len(tensors) != group.size():
        raise InvalidArgument(f"{what}: {arg} needs world_size ({group.size()}) tensors; got {len(tensors)}")
    for t in tensors:
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise InvalidArgument(f"{what}: every tensor of {arg} needs the dtype and size of the tensor "
                                  f"({like.dtype}, {like.numel()} elements); got {t.dtype} with {t.numel()}")


def one(what: str, tensors, kind: str = "tensor") -> None:
    """gpucoll takes one tensor (of `kind`) per call, where torch's signature takes a list."""
    if len(tensors) != 1:
        raise Unsupported(f"{what}: gpucoll takes one {kind} per call; got {len(tensors)}")


def one_and_list(group, call, single, lists, text: str, arg: str) -> None:
    """all_gather's and reduce_scatter's check: one tensor and one list of world_size like it (torch's `arg`)."""
    if len(single) != 1 or len(lists) != 1:
        raise Unsupported(f"{call.what}: gpucoll takes {text} per call")
    check_list(group, call.what, arg, lists[0], single[0])
