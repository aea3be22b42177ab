"""Making communicators: ``gpucoll.init`` (from a launcher's environment, torch's default group or an MPI
communicator), ``gpucoll.join`` (into a running job that grows) and ``init_from_store`` (over a store that exists).
Each checks its arguments, meets the other ranks through the rendezvous store and builds the backend
(communicator._build)."""

from __future__ import annotations

from gpucoll import _timeout, backends, config
from gpucoll import group as groups
from gpucoll.bootstrap import LaunchInfo, detect_launch, external
from gpucoll.bootstrap.store import TCPStore
from gpucoll.communicator import Communicator, _build, _store_launch
from gpucoll.errors import InvalidArgument


def init(rank: int | None = None, world_size: int | None = None, *, backend: str = "auto",
         address: str | None = None, port: int | None = None, timeout: float = 300.0,
         local_size: int | None = None, device=None, local_rank: int | None = None, from_torch=None,
         mpi_comm=None, secret: str | bytes | None = None) -> Communicator:
    """Create this rank's communicator. Missing values come from the launcher's environment (torchrun,
    Open MPI, MPICH/PMI, Slurm); rank 0 hosts the rendezvous store at address:port.

    `local_size` (or GPUCOLL_LOCAL_SIZE) declares ranks per node for hierarchical algorithms; on one machine
    it lays out virtual nodes of that many consecutive ranks.

    backend: 'host' (CPU arrays), 'nccl' (CUDA arrays), 'custom' (gpucoll's kernels over peer memory, NCCL for
    the rest), or 'auto' (GPUCOLL_BACKEND, else on a usable GPU 'custom' for 2-8 ranks, each call going where the
    topology model predicts it is fastest, or 'nccl'; else host). GPU backends run on `device` (an index,
    'cuda:N' or torch.device), by default the GPU numbered like this rank's local rank (`local_rank`, else
    LOCAL_RANK or the launcher's equivalent); `timeout` also bounds NCCL's init and every collective.

    from_torch=process_group (or True for the default group) takes rank, size and store from an initialised
    torch.distributed group; mpi_comm=comm takes them from an mpi4py communicator (rank 0 serves the store).
    Under torchrun the ranks meet through the store its agent already serves (MASTER_ADDR:MASTER_PORT).

    `secret` is the job's secret for gpucoll's rendezvous store, the same on every rank (else
    GPUCOLL_STORE_SECRET, else the per-user file ~/.gpucoll/store_secret, which nodes share through a shared home
    directory): only connections that prove they know it are served. mpi_comm= makes one on rank 0 and
    sends it over MPI; torch's stores (from_torch=, torchrun's agent store) have no authentication of their own."""
    kind, local_size = _check_common(backend, timeout, local_size, device)
    if from_torch is not None or mpi_comm is not None:
        given = [n for n, v in (("rank", rank), ("world_size", world_size), ("address", address), ("port", port),
                                ("mpi_comm" if from_torch is not None else "from_torch",
                                 mpi_comm if from_torch is not None else from_torch)) if v is not None]
        if given:
            raise InvalidArgument(f"{', '.join(given)} cannot be combined with "
                                  f"{'from_torch' if from_torch is not None else 'mpi_comm'}: the group supplies them")
        if from_torch is not None:
            launch, store = external.from_torch(from_torch, timeout, local_rank)
        else:
            launch, store = external.from_mpi(mpi_comm, timeout, local_rank)
    else:
        launch = detect_launch(rank=rank, world_size=world_size, address=address, port=port, local_rank=local_rank)
        store = external.launcher_store(launch, timeout, secret)
    return _build(launch, store, kind, timeout, local_size, device, backend)


def join(address: str, port: int, *, backend: str = "auto", timeout: float = 300.0, device=None,
         secret: str | bytes | None = None) -> Communicator:
    """Join a running job: wait (up to `timeout`) until its ranks call grow() on the communicator whose store is
    at address:port (its join_address()), then return this process's communicator in the grown job. `secret` is
    the job's (else GPUCOLL_STORE_SECRET, else the per-user file, as for init); `backend` must be the job's."""
    kind, _ = _check_common(backend, timeout, 0, device)
    store = TCPStore(address, port, is_server=False, timeout=timeout, secret=secret)
    try:
        def build(rank, size, new_store, members):
            return _build(_store_launch(rank, size), new_store, kind, timeout, 0, device, kind,
                          with_host=backend == "auto")

        return groups.join(store, timeout, build)
    finally:
        store.close()


def _check_common(backend, timeout, local_size, device):
    """Checks shared by init and init_from_store; returns the resolved backend and local size."""
    _timeout.check(timeout)
    kind = backends.resolve(backend)
    if local_size is None:
        local_size = config.get_int("GPUCOLL_LOCAL_SIZE")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 0:
        raise InvalidArgument(f"local_size must be a non-negative int (0: one node); got {local_size!r}")
    backends.check_device(kind, device)
    return kind, local_size


def init_from_store(store, rank: int, world_size: int, *, backend: str = "auto", timeout: float = 300.0,
                    local_size: int | None = None, device=None, local_rank: int | None = None) -> Communicator:
    """A communicator over a rendezvous store that already exists, for a caller that knows rank and size (the
    torch.distributed backend gets both from torch, with torch's store).

    `store` is a torch.distributed Store (wrapped, never closed: it belongs to torch) or an object with gpucoll's
    store interface (set, get(key, timeout), add, check, close). Several communicators may share one store: each
    init takes its own keys. Every rank of the group must call this together, as with init."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name} must be an int; got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgument(f"need 0 <= rank < world_size; got rank {rank}, world_size {world_size}")
    kind, local_size = _check_common(backend, timeout, local_size, device)
    if type(store).__module__.startswith("torch"):
        store = external.TorchStore(store, timeout)
    lr, lsize = external._local_from_env(rank, world_size)
    if local_rank is not None:
        lr, lsize = local_rank, max(lsize, local_rank + 1)
    launch = LaunchInfo(rank=rank, world_size=world_size, local_rank=lr, local_world_size=lsize, address="", port=0,
                        launcher="store")
    return _build(launch, store, kind, timeout, local_size, device, backend)
