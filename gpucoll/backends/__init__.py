"""The backends, side by side: the registry that names each one, and ``build``, which sets one up for a Communicator.

A backend is a file of this package with a :class:`~gpucoll.backends.base.Backend` subclass (base.py says what it
implements) and one line in ``REGISTRY`` below:

==========  ============================================================================================
host.py     CPU arrays of ranks on one machine, through shared memory (gpucoll's schedules); on several
            machines it builds host_nodes.py's HostNodes: shared memory inside each, gloo between them
nccl.py     CUDA arrays, NCCL runs every call
custom.py   CUDA arrays, gpucoll's own allreduce kernels over peer memory, NCCL for the rest
==========  ============================================================================================

Beside them: usable.py (can a backend run here, what 'auto' means, which GPU a rank gets), select.py (the
custom backend's per-call choice between its kernels and NCCL, from the topology model) and work.py (what
``async_op=True`` returns, premul_sum).
"""

from __future__ import annotations

from gpucoll import _log, config
from gpucoll._native import _C
from gpucoll.backends import host
from gpucoll.backends.custom import Custom
from gpucoll.backends.host import Host
from gpucoll.backends.nccl import Nccl
from gpucoll.backends.usable import auto_placement_problem, custom_takes_auto, resolve
from gpucoll.errors import InvalidArgument

REGISTRY = {cls.name: cls for cls in (Host, Nccl, Custom)}

__all__ = ["REGISTRY", "build", "check_device", "resolve"]


def check_device(kind: str, device) -> None:
    """InvalidArgument when ``device=`` is given to a backend that runs on the CPU."""
    if device is not None and not REGISTRY[kind].on_gpu:
        raise InvalidArgument(f"device= applies to the nccl backend; this communicator uses the {kind} backend")


def build(launch, store, kind: str, timeout: float, local_size: int, device, requested: str = "auto"):
    """(kind, backend): this rank's Backend over the rendezvous `store`, built by every rank together; `kind` as
    resolved (resolve()), where 'auto' that resolved to nccl becomes custom on 2-8 ranks with a GPU each (the
    backend's `chosen` then True). The store is closed again if the backend cannot be built."""
    host.stage("build")
    _C.set_log_rank(launch.rank)
    auto = requested == "auto" and not config.get("GPUCOLL_BACKEND").strip()
    if auto and kind == "nccl":
        why = auto_placement_problem(launch.local_world_size, device)
        if why:
            _log.info(f"backend='auto' uses the host backend: {why}")
            kind = "host"
    chosen = auto and kind == "nccl" and custom_takes_auto(launch.world_size)
    if chosen:
        kind = "custom"
    try:
        made = REGISTRY[kind].create(launch, store, timeout=timeout, local_size=local_size, device=device,
                                     chosen=chosen)
    except BaseException:
        # Ranks still waiting for this one's keys learn at once, and rank 0's server stays up a little for the
        # ones that have not connected yet (gpucoll's store; others only close).
        abandon = getattr(store, "abandon", None)
        if abandon is not None:
            abandon(launch.world_size)
        else:
            store.close()
        raise
    return kind, made
