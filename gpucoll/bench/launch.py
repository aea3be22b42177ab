"""gpucoll-bench under a launcher (torchrun, mpirun/mpiexec, srun): one process per rank, meeting through the
launcher's rendezvous, ranks beyond the node's GPUs sharing them."""

from __future__ import annotations

import os

from gpucoll._make import init_from_store
from gpucoll._native import _C
from gpucoll.backends import nccl
from gpucoll.bench.usage import UsageError
from gpucoll.bootstrap.external import launcher_store
from gpucoll.errors import Unsupported


def share_gpus(p, local_ranks: int) -> None:
    """Under a launcher with more ranks on this node than GPUs: NCCL's multi-rank mode, set in this rank's own
    environment before its NCCL communicator exists (NCCL reads it at init; gpucoll's device choice reads it too),
    as gpucoll.spawn sets it for spawned ranks. UsageError saying why when the loaded NCCL cannot share GPUs."""
    if local_ranks <= int(_C.cuda_probe().get("device_count") or 0):
        return
    try:
        _, env = nccl.spawn_plan(local_ranks, "nccl")
    except Unsupported as e:
        raise UsageError(str(e)) from None
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
            p.notes.append(f"{local_ranks} ranks on this node share GPUs: {key}={value} set in every rank")


class _SharedStore:
    """The launcher's rendezvous store, kept open across the communicators of a --backend sweep: each init over
    it takes its own keys, and closing one communicator must not close the store the next one meets through (a
    fresh store on the launcher's port would race the old one's socket). main() closes the real one at the end."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def close(self) -> None:
        pass


_LAUNCH_STORES: list = []  # the real store of this process's launcher run (at most one)


def launcher_comm(p, info):
    # The store gpucoll.init would use (torchrun's agent store under torchrun), kept for the whole sweep.
    if not _LAUNCH_STORES:
        _LAUNCH_STORES.append(launcher_store(info, p.timeout))
    return init_from_store(_SharedStore(_LAUNCH_STORES[0]), info.rank, info.world_size, backend=p.backend,
                           timeout=p.timeout)


def close_stores() -> None:
    while _LAUNCH_STORES:
        _LAUNCH_STORES.pop().close()
