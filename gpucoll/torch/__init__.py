"""gpucoll for PyTorch: a torch.distributed backend and DDP communication hooks.

``import gpucoll.torch`` registers the torch.distributed backend ``"gpucoll"`` for CPU and CUDA tensors; a training
script then changes one string::

    import gpucoll.torch
    dist.init_process_group("gpucoll")                  # or "cpu:gloo,cuda:gpucoll"
    group = dist.new_group([0, 1], backend="gpucoll")   # subsets too

CPU tensors run on gpucoll's shared-memory host backend, CUDA tensors on its NCCL backend (on the current stream).
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

from gpucoll.torch.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from gpucoll.torch.process_group import BACKEND_NAME, ProcessGroupGpucoll, create
from gpucoll.torch.work import Work

__all__ = ["BACKEND_NAME", "ProcessGroupGpucoll", "Work", "allreduce_hook", "bf16_compress_hook", "create",
           "fp16_compress_hook", "register"]


def register() -> None:
    """Registers the "gpucoll" backend with torch.distributed (done by ``import gpucoll.torch``; idempotent)."""
    dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])


register()
