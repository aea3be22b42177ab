"""What the benchmark's files share, below all of them: its exit statuses, UsageError (a run refused before it
starts, with what to do instead), which launcher started this process, and which backend --backend names here."""

from __future__ import annotations

import os

from gpucoll._native import _C
from gpucoll.backends import usable
from gpucoll.bench import devmem, virtual

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3

# The variables whose presence means "a launcher started this process as one rank of a job".
LAUNCHER_VARS = (("torchrun", ("RANK", "WORLD_SIZE")), ("openmpi", ("OMPI_COMM_WORLD_RANK",)),
                 ("mpich", ("PMI_RANK",)), ("slurm", ("SLURM_PROCID",)))


class UsageError(Exception):
    pass


def launcher() -> str | None:
    for name, variables in LAUNCHER_VARS:
        if any(os.environ.get(v, "").strip() for v in variables):
            return name
    return None


def resolve_backend(requested: str, coll: str | None = None) -> str:
    """The backend to run. Raises UsageError with what to do instead when it cannot run here."""
    if requested == "auto":
        return "nccl" if usable.auto_selects_nccl() and devmem.cuda_lib() is not None else "host"
    if requested == "custom":
        why = virtual.problem(coll)
        if why:
            raise UsageError(why)
        return requested
    if requested == "nccl":
        probe = _C.cuda_probe()
        if probe.get("device_count", 0) == 0:
            raise UsageError(f"--backend nccl needs a usable CUDA GPU and this machine has none "
                             f"({probe.get('reason') or 'no device'}); use --backend host to benchmark the CPU "
                             f"shared-memory backend")
        found = usable.nccl_problems()
        if found:
            raise UsageError("--backend nccl cannot run here: " + "; ".join(found))
        if devmem.cuda_lib() is None:
            raise UsageError("--backend nccl allocates CUDA buffers with torch or CuPy, and neither can use the GPU "
                             "here: install torch with CUDA or cupy-cuda13x")
    return requested
