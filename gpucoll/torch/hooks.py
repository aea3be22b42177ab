"""DDP communication hooks that all-reduce gradients with gpucoll, whatever the default process group is.

Register one on a DistributedDataParallel model (the rest of the job keeps its own process group, gloo or nccl)::

    import gpucoll.torch
    model = DistributedDataParallel(model)                          # any process group
    model.register_comm_hook(None, gpucoll.torch.allreduce_hook)    # gradients through gpucoll

The state is the gpucoll ``Communicator`` to use, or a torch ``ProcessGroup`` (gpucoll builds a communicator over
it), or ``None`` for the default group. A communicator built here is made on the first bucket (every rank reaches it
together) and reused: the host backend for CPU gradients, the GPU backends ('auto') on the bucket's GPU for CUDA
gradients. CPU buckets of such a communicator are reduced on a worker thread while backward goes on
(gpucoll/torch/_worker.py); a communicator passed as the state is used on the autograd thread, since the caller may
use it elsewhere too.

Each hook does what torch's built-in hook of the same name does (torch.distributed.algorithms.ddp_comm_hooks.
default_hooks): divide the bucket by the world size, sum it over ranks, and return a completed future of a tensor of
the bucket's shape and dtype; the compress hooks cast to float16/bfloat16 first and copy the result back into the
bucket. The all-reduce runs on the current CUDA stream, so later work on that stream sees the result.
"""

import threading

import torch
import torch.distributed as dist

from gpucoll._make import init
from gpucoll.communicator import Communicator
from gpucoll.errors import InvalidArgument
from gpucoll.torch._worker import Worker

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

_BUILT: dict = {}  # (id(group), device) -> (group, Communicator, Worker), for state None / ProcessGroup (the group
# is held, so its id is not reused while the entry lives)
_LOCK = threading.Lock()


def _communicator(state, tensor: torch.Tensor):
    """(Communicator, Worker or None) for a hook's state and bucket."""
    if isinstance(state, Communicator):
        return state, None
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise InvalidArgument(f"the hook state must be a gpucoll Communicator, a torch ProcessGroup or None; got "
                              f"{type(state).__name__}")
    group = state if state is not None else dist.distributed_c10d._get_default_group()
    device = tensor.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(group), str(device))
    _, comm, worker = _BUILT.get(key, (None, None, None))
    if comm is None or comm.closed:
        with _LOCK:
            _, comm, worker = _BUILT.get(key, (None, None, None))
            if comm is None or comm.closed:
                if device.type == "cuda":
                    comm = init(from_torch=group, backend="auto", device=device.index)
                else:
                    comm = init(from_torch=group, backend="host")
                worker = Worker(f"gpucoll-ddp-hook-r{comm.rank}") if device.type == "cpu" else None
                _BUILT[key] = (group, comm, worker)
    return comm, worker


def _completed(tensor: torch.Tensor, comm_work) -> torch.futures.Future[torch.Tensor]:
    """A future holding `tensor`, ready once the all-reduce is (for CUDA: on the current stream)."""
    if tensor.is_cuda:
        fut = torch.futures.Future(devices=[tensor.device])
        if comm_work is not None:
            comm_work.wait()  # the current stream waits for the all-reduce (it ran on it: a no-op ordering)
    else:
        fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _allreduce(comm, tensor: torch.Tensor):
    """Sums `tensor` over ranks in place: gpucoll's Work for CUDA (enqueued on the current stream), else None (done)."""
    if tensor.is_cuda:
        return comm.all_reduce(tensor, async_op=True)
    comm.all_reduce(tensor)
    return None


def _run(comm, worker, buffer: torch.Tensor, body) -> torch.futures.Future[torch.Tensor]:
    """body() all-reduces (and finishes) the bucket; a future of `buffer` once it did."""
    if worker is not None:
        return worker.submit(body, [buffer]).get_future().then(lambda fut: fut.value()[0])
    return _completed(buffer, body())


def allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket's gradients over ranks with gpucoll's all_reduce (torch's allreduce_hook, on gpucoll)."""
    buffer = bucket.buffer()
    comm, worker = _communicator(state, buffer)

    def body():
        buffer.div_(comm.world_size)
        return _allreduce(comm, buffer)

    return _run(comm, worker, buffer, body)


def _compress_hook(state, bucket, dtype) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    comm, worker = _communicator(state, buffer)

    def body():
        compressed = buffer.to(dtype).div_(comm.world_size)
        work = _allreduce(comm, compressed)
        if work is not None:
            work.wait()
        if compressed.data_ptr() != buffer.data_ptr():
            buffer.copy_(compressed)  # decompress into the bucket

    return _run(comm, worker, buffer, body)


def fp16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Casts the bucket to float16, averages it over ranks with gpucoll, and copies the result back (torch's
    fp16_compress_hook, on gpucoll): half the bytes on the wire."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Casts the bucket to bfloat16, averages it over ranks with gpucoll, and copies the result back (torch's
    bf16_compress_hook, on gpucoll)."""
    return _compress_hook(state, bucket, torch.bfloat16)


# DDP.register_comm_hook refuses any hook *named* bf16_compress_hook unless torch has CUDA and NCCL >= 2.10 (the
# constraint of torch's own hook, which all-reduces bfloat16 through NCCL). gpucoll reduces bfloat16 on the host
# backend too, so its hook goes by another name.
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "gpucoll_bf16_compress_hook"
