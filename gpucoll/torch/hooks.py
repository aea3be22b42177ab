"""DDP communication hooks that all-reduce gradients with gpucoll, whatever the default process group is.

Register one on a DistributedDataParallel model (the rest of the job keeps its own process group, gloo or nccl)::

    import gpucoll.torch
    model = DistributedDataParallel(model)                          # any process group
    model.register_comm_hook(None, gpucoll.torch.allreduce_hook)    # gradients through gpucoll

The state is the gpucoll ``Communicator`` to use, or a torch ``ProcessGroup`` (gpucoll builds a communicator over
it), or ``None`` for the default group. A communicator built here is made on the first bucket (every rank reaches it
together) and reused: the host backend for CPU gradients, the GPU backends ('auto') on the bucket's GPU for CUDA
gradients. CPU buckets of such a communicator are reduced on its progress thread while backward goes on (async_op:
csrc/backends/host/progress.h); a communicator passed as the state is used synchronously on the autograd thread, since
the caller may use it from other threads too.

Each hook does what torch's built-in hook of the same name does (torch.distributed.algorithms.ddp_comm_hooks.
default_hooks): divide the bucket by the world size, sum it over ranks, and return a completed future of a tensor of
the bucket's shape and dtype; the compress hooks cast to float16/bfloat16 first and copy the result back into the
bucket. The all-reduce runs on the current CUDA stream, so later work on that stream sees the result.
"""

import threading

import torch
import torch.distributed as dist

from gpucoll import compression
from gpucoll._make import init
from gpucoll._native import _C
from gpucoll.communicator import Communicator
from gpucoll.errors import InvalidArgument, Unsupported
from gpucoll.torch._convert import dtype_name
from gpucoll.torch.work import Work

__all__ = ["CompressionState", "allreduce_hook", "bf16_compress_hook", "compressed_hook", "fp16_compress_hook"]

_BUILT: dict = {}  # (id(group), device) -> (group, Communicator), for state None / ProcessGroup (the group is held,
# so its id is not reused while the entry lives)
_LOCK = threading.Lock()


def _communicator(state, tensor: torch.Tensor):
    """(Communicator, whether a CPU bucket may run on its progress thread) for a hook's state and bucket."""
    if isinstance(state, Communicator):
        return state, False
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise InvalidArgument(f"the hook state must be a gpucoll Communicator, a torch ProcessGroup or None; got "
                              f"{type(state).__name__}")
    group = state if state is not None else dist.distributed_c10d._get_default_group()
    device = tensor.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(group), str(device))
    _, comm = _BUILT.get(key, (None, None))
    if comm is None or comm.closed:
        with _LOCK:
            _, comm = _BUILT.get(key, (None, None))
            if comm is None or comm.closed:
                if device.type == "cuda":
                    comm = init(from_torch=group, backend="auto", device=device.index)
                else:
                    comm = init(from_torch=group, backend="host")
                _BUILT[key] = (group, comm)
    return comm, True


def _reduced(comm, background: bool, buffer: torch.Tensor, tensor: torch.Tensor, then=None, **kw):
    """Sums `tensor` over ranks in place, then runs then(); a future of `buffer` once both are done. CUDA: enqueued
    on the current stream, which later work waits for; CPU: on the communicator's progress thread when `background`,
    the future set there (as gloo's threads set it), else here."""
    if tensor.is_cuda or not background:
        work = comm.all_reduce(tensor, async_op=True, **kw) if tensor.is_cuda else comm.all_reduce(tensor, **kw)
        if tensor.is_cuda:
            work.wait()  # the current stream waits for the all-reduce (it ran on it: a no-op ordering)
        if then is not None:
            then()
        fut = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def finished(fut):
        fut.value()  # raises the all-reduce's error
        if then is not None:
            then()
        return buffer

    return Work([buffer], works=[comm.all_reduce(tensor, async_op=True, **kw)]).get_future().then(finished)


def allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket's gradients over ranks with gpucoll's all_reduce (torch's allreduce_hook, on gpucoll)."""
    buffer = bucket.buffer()
    comm, background = _communicator(state, buffer)
    buffer.div_(comm.world_size)
    return _reduced(comm, background, buffer, buffer)


def _compress_hook(state, bucket, dtype) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    comm, background = _communicator(state, buffer)
    compressed = buffer.to(dtype).div_(comm.world_size)

    def decompress():
        if compressed.data_ptr() != buffer.data_ptr():
            buffer.copy_(compressed)

    return _reduced(comm, background, buffer, compressed, decompress)


def fp16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Casts the bucket to float16, averages it over ranks with gpucoll, and copies the result back (torch's
    fp16_compress_hook, on gpucoll): half the bytes on the wire."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Casts the bucket to bfloat16, averages it over ranks with gpucoll, and copies the result back (torch's
    bf16_compress_hook, on gpucoll)."""
    return _compress_hook(state, bucket, torch.bfloat16)


class CompressionState:
    """The state of compressed_hook: the wire format, the communicator (as the other hooks' state: a gpucoll
    Communicator, a torch ProcessGroup or None for the default group), and with error feedback the residual of each
    bucket: what compression dropped of this rank's gradients at the last step, added back at the next one (as 1-bit
    Adam and PowerSGD do), so that no part of a gradient is lost for good, only delayed."""

    def __init__(self, compress: str = "int8", group=None, error_feedback: bool = True):
        if compress not in compression.WIRES:
            raise InvalidArgument(f"compress must be one of {', '.join(compression.WIRES)}; got {compress!r}")
        self.compress = compress
        self.group = group
        self.error_feedback = bool(error_feedback)
        self.residuals: dict = {}  # bucket index -> float tensor of the bucket's size

    def __repr__(self) -> str:
        return (f"CompressionState(compress={self.compress!r}, error_feedback={self.error_feedback}, "
                f"{len(self.residuals)} residual(s))")


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over ranks with all_reduce(compress=state.compress) (int8/fp8 block-scaled, or bf16, on
    the wire; summed in float32; docs/compression.md). With state.error_feedback, this rank first adds the residual
    it kept of the bucket, and keeps as the new one what the wire format drops of that corrected gradient (computed
    on the host: CPU gradients). CUDA gradients without error feedback go to gpucoll's kernels, which compress too
    (backend 'custom'; the nccl backend raises Unsupported)::

        model.register_comm_hook(gpucoll.torch.CompressionState("int8"), gpucoll.torch.compressed_hook)
    """
    if not isinstance(state, CompressionState):
        raise InvalidArgument(f"compressed_hook's state must be a gpucoll.torch.CompressionState; got "
                              f"{type(state).__name__}")
    buffer = bucket.buffer()
    comm, background = _communicator(state.group, buffer)
    grad = buffer if buffer.is_contiguous() else buffer.contiguous()
    if state.error_feedback:
        residual = state.residuals.get(bucket.index())
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            residual = torch.zeros_like(grad)
            state.residuals[bucket.index()] = residual
        grad = grad.add(residual)  # the corrected gradient: this step's and what the last step's wire dropped
        _wire_roundtrip(grad, residual, state.compress)
        torch.sub(grad, residual, out=residual)  # what the wire drops of it, sent at the next step

    def copy_back():
        if grad.data_ptr() != buffer.data_ptr():
            buffer.copy_(grad)

    return _reduced(comm, background, buffer, grad, copy_back, op="avg", compress=state.compress)


def _wire_roundtrip(src: torch.Tensor, dst: torch.Tensor, compress: str) -> None:
    """dst = src after one trip through the wire format, as this rank's all_reduce(compress=...) encodes it."""
    name = dtype_name(src.dtype)
    if name not in ("float32", "float16", "bfloat16") or src.is_cuda:
        raise Unsupported(f"compressed_hook compresses float32, float16 and bfloat16 CPU gradients; got a "
                          f"{src.dtype} bucket on {src.device}")
    _C.wire_roundtrip(src.data_ptr(), dst.data_ptr(), src.numel(), getattr(_C.DType, name), compress)


# DDP.register_comm_hook refuses any hook *named* bf16_compress_hook unless torch has CUDA and NCCL >= 2.10 (the
# constraint of torch's own hook, which all-reduces bfloat16 through NCCL). gpucoll reduces bfloat16 on the host
# backend too, so its hook goes by another name.
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "gpucoll_bf16_compress_hook"
