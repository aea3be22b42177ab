"""gpucoll for PyTorch: a torch.distributed backend and DDP communication hooks.

The torch.distributed backend ``"gpucoll"`` serves CPU and CUDA tensors; a training script changes one string::

    dist.init_process_group("gpucoll")                  # or "cpu:gloo,cuda:gpucoll"
    group = dist.new_group([0, 1], backend="gpucoll")   # subsets too

torch (>= 2.5) knows the name through gpucoll's entry point (gpucoll/_torch_plugin.py), which imports this package
when the first such group is made; ``import gpucoll.torch`` registers it too, where the entry point does not run
(torch 2.4, TORCH_DEVICE_BACKEND_AUTOLOAD=0, gpucoll used from a checkout that is not installed).

CPU tensors run on gpucoll's shared-memory host backend (on gloo when the group's ranks span machines), CUDA tensors
on its NCCL backend (on the current stream). Errors raised through torch.distributed are torch's DistBackendError
and gpucoll's error classes at once (gpucoll/torch/errors.py).
Or keep the job's process group and send only DDP's gradients through gpucoll::

    model.register_comm_hook(None, gpucoll.torch.allreduce_hook)   # or fp16_compress_hook / bf16_compress_hook

torch 2.4 or newer is required (checked at import); 2.13 is tested here, 2.11 is the GPU machines' version.
``import gpucoll`` alone never imports torch.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 4)


def _torch_version(text: str) -> tuple:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


if _torch_version(torch.__version__) < MIN_TORCH:
    raise ImportError(f"gpucoll.torch needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (its torch.distributed "
                      f"ProcessGroup and Work subclassing); this is torch {torch.__version__}. Upgrade torch, or use "
                      f"gpucoll's own API (gpucoll.init) with torch tensors")

import torch.distributed as dist

if not dist.is_available():
    raise ImportError(f"gpucoll.torch needs torch.distributed, which this torch build ({torch.__version__}) lacks")

from gpucoll.errors import InvalidArgument
from gpucoll.torch.hooks import (
    CompressionState,
    allreduce_hook,
    bf16_compress_hook,
    compressed_hook,
    fp16_compress_hook,
)
from gpucoll.torch.process_group import BACKEND_NAME, ProcessGroupGpucoll, create
from gpucoll.torch.work import Work

__all__ = ["BACKEND_NAME", "CompressionState", "ProcessGroupGpucoll", "Work", "allreduce_hook", "bf16_compress_hook",
           "compressed_hook", "create", "dump_trace", "fp16_compress_hook", "register", "stragglers"]


def stragglers(group=None, device="cpu", reset: bool = False):
    """Who arrives late at this group's collectives on `device`'s tensors (gpucoll.Communicator.stragglers(): each
    rank's lateness at the last 1000 collectives, and how often it arrived last). `group`: a process group whose
    backend for `device` is gpucoll (default: the default group). Local: no communication."""
    return _backend_of(group, device).stragglers(device, reset)


def dump_trace(group=None, device="cpu", path=None) -> str:
    """Writes this rank's flight recorder of the group's communicator for `device`'s tensors to `path` (default:
    GPUCOLL_TRACE_DIR or the temporary directory) and returns the path (Communicator.dump_trace()). Local: every
    rank dumps its own; python -m gpucoll trace merges the files."""
    return _backend_of(group, device).dump_trace(device, path)


def _backend_of(group, device) -> ProcessGroupGpucoll:
    pg = (group if group is not None else dist.group.WORLD)._get_backend(torch.device(device))
    if not isinstance(pg, ProcessGroupGpucoll):
        raise InvalidArgument(f"this group runs {device} tensors on {type(pg).__name__}, not on gpucoll")
    return pg


def register() -> None:
    """Registers the "gpucoll" backend with torch.distributed (done by ``import gpucoll.torch``, replacing the
    entry point's creator; idempotent)."""
    dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])


register()
