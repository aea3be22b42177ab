"""Bootstrapping from a group that already exists: a torch.distributed process group or an mpi4py communicator.

Both give ``gpucoll.init`` what ``detect_launch`` and a fresh ``TCPStore`` give it otherwise: a ``LaunchInfo`` and a
store with ``set``/``get(key, timeout)``/``add``/``check``/``close``. Every later step (the host backend's
shared-memory name, the NCCL unique id, the watchdog's progress records) then works the same way.

* ``from_torch``: the group's rank and size, and torch's own store (the default store, under a prefix naming the
  group's ranks so that subgroups never see each other's keys). No extra port is opened.
* ``from_mpi``: the communicator's rank and size; rank 0 starts a ``TCPStore`` on a free port and broadcasts its
  address with ``comm.bcast``. Ranks on one host use the loopback address.

``launcher_store`` is where ``gpucoll.init`` (and gpucoll-bench under a launcher) gets the store of a
``detect_launch`` result: torchrun's agent store when torchrun says its workers use it, else a ``TCPStore`` that
rank 0 serves.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys

from gpucoll import config
from gpucoll.bootstrap import secret_file
from gpucoll.bootstrap.env import LaunchInfo
from gpucoll.bootstrap.store import SecretRefused, TCPStore, new_secret, solo_secret
from gpucoll.errors import CollectiveTimeout, InvalidArgument

__all__ = ["TorchStore", "from_mpi", "from_torch", "launcher_store"]


class TorchStore:
    """A torch.distributed Store behind the subset of TCPStore's interface that gpucoll uses."""

    def __init__(self, store, timeout: float):
        self._store = store
        self.timeout = float(timeout)

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        t = self.timeout if timeout is None else float(timeout)
        try:
            self._store.wait([key], datetime.timedelta(seconds=t))
        except RuntimeError as e:  # torch's DistStoreError subclasses RuntimeError
            raise CollectiveTimeout(f"timed out after {t:g} s waiting for key {key!r} in torch.distributed's "
                                    f"store: {e}") from None
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._store.add(key, amount))

    def check(self, keys) -> bool:
        return bool(self._store.check([keys] if isinstance(keys, str) else list(keys)))

    def delete(self, key: str) -> bool:
        return bool(self._store.delete_key(key))

    # The rest of TCPStore's interface that backends use (the custom backend's handle exchange and barriers),
    # built on set/get/add since torch's store has no wait-for-one-key-among-many request.
    def set_json(self, key: str, obj) -> None:
        self.set(key, json.dumps(obj, separators=(",", ":")).encode("utf-8"))

    def get_json(self, key: str, timeout: float | None = None):
        return json.loads(self.get(key, timeout).decode("utf-8"))

    def barrier(self, name: str, world_size: int, timeout: float | None = None, rank: int | None = None) -> None:
        """As TCPStore.barrier: reusable (the n-th call of each rank joins generation n); a timeout names the
        ranks that never arrived."""
        if rank is None or not 0 <= rank < world_size:
            raise InvalidArgument(f"rank must satisfy 0 <= rank < world_size={world_size}; got {rank!r}")
        base = f"gpucoll/barrier/{name}/"
        count = self.add(base + "count", 1)
        gen = (count - 1) // world_size
        self.set(f"{base}{gen}/arrived/{rank}", b"1")
        if count == (gen + 1) * world_size:
            self.set(f"{base}{gen}/done", b"1")
        try:
            self.get(f"{base}{gen}/done", timeout)
        except CollectiveTimeout:
            missing = [r for r in range(world_size) if not self.check(f"{base}{gen}/arrived/{r}")]
            raise CollectiveTimeout(f"barrier {name!r} timed out: {world_size - len(missing)} of {world_size} ranks "
                                    f"arrived; missing ranks: {missing}", ranks=missing) from None

    def close(self) -> None:
        """The store belongs to torch.distributed: nothing to close."""

    def __repr__(self) -> str:
        return f"TorchStore({self._store!r})"


def launcher_store(launch: LaunchInfo, timeout: float, secret=None):
    """The rendezvous store of `launch` (a detect_launch result).

    Under torchrun (``--standalone``, ``--rdzv-backend c10d`` or static) the agent already serves a store on
    MASTER_ADDR:MASTER_PORT and tells its workers so (TORCHELASTIC_USE_AGENT_STORE=True): a second server there
    cannot bind ("Address already in use"), so every rank connects to it as a client through torch's TCPStore, as
    torch's own init_process_group does, under a prefix of its own per restart attempt. Elsewhere (mpirun, srun,
    explicit arguments) rank 0 serves a gpucoll TCPStore at launch.address:launch.port, admitting only connections
    that know the job's `secret` (else GPUCOLL_STORE_SECRET, else the per-user secret file of secret_file.py, so
    that mpirun and srun jobs work as they are; a one-rank job makes its own). torch's agent store has no
    authentication of its own: under torchrun the job is as closed as torchrun's store is."""
    if not launch.agent_store:
        secret = solo_secret(launch.world_size, secret)
        from_file = secret is None and not config.is_set("GPUCOLL_STORE_SECRET")
        if from_file:
            secret = secret_file.read_or_create(new_secret())
        try:
            return TCPStore(launch.address, launch.port, is_server=launch.rank == 0, timeout=timeout,
                            secret=secret, rank=launch.rank)
        except SecretRefused as e:
            if from_file:
                raise SecretRefused(e.message + secret_file.refused_note()) from None
            raise
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        import torch.distributed as dist  # torchrun is part of torch: it is installed wherever this runs
    try:
        agent = dist.TCPStore(launch.address, launch.port, launch.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # torch's DistNetworkError / DistStoreError subclass RuntimeError
        raise CollectiveTimeout(f"cannot reach torchrun's agent store at {launch.address}:{launch.port} "
                                f"(MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) within {timeout:g} s: "
                                f"{e}") from None
    return TorchStore(dist.PrefixStore(f"gpucoll/attempt_{launch.attempt}/", agent), timeout)


def _local_from_env(rank: int, world_size: int):
    def env_int(name):
        value = os.environ.get(name, "").strip()
        return int(value) if value.isdigit() else None

    local_rank = env_int("LOCAL_RANK")
    local_size = env_int("LOCAL_WORLD_SIZE")
    if local_rank is None:
        local_rank, local_size = rank, world_size  # no launcher locality: assume one node, as detect_launch does
    if local_size is None or not 0 <= local_rank < local_size:
        local_size = max(local_rank + 1, 1)
    return local_rank, local_size


def from_torch(group, timeout: float, local_rank: int | None = None):
    """(LaunchInfo, TorchStore) for this process in `group` (a ProcessGroup, or True/None for the default group)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument("from_torch: torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group first")
    pg = None if group is True else group
    if pg is None:
        pg = dist.group.WORLD
    try:
        rank = dist.get_rank(pg)
        world_size = dist.get_world_size(pg)
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgument(f"from_torch must be a torch.distributed ProcessGroup (or True); got "
                              f"{type(group).__name__}: {e}") from None
    if rank < 0:
        raise InvalidArgument("from_torch: this process is not a member of the given process group")
    base = dist.distributed_c10d._get_default_store()
    # Subgroups share the default store: prefix by the member ranks so their keys never collide.
    prefix = "gpucoll/torch/" + ",".join(map(str, ranks)) + "/"
    store = TorchStore(dist.PrefixStore(prefix, base), timeout)
    lr, lsize = _local_from_env(rank, world_size)
    if local_rank is not None:
        lr, lsize = local_rank, max(lsize, local_rank + 1)
    return LaunchInfo(rank=rank, world_size=world_size, local_rank=lr, local_world_size=lsize, address="",
                      port=0, launcher="torch.distributed"), store


def from_mpi(comm, timeout: float, local_rank: int | None = None):
    """(LaunchInfo, TCPStore) for this process in the mpi4py communicator `comm`."""
    for name in ("Get_rank", "Get_size", "bcast", "allgather"):
        if not hasattr(comm, name):
            raise InvalidArgument(f"mpi_comm must be an mpi4py communicator (it has no {name}); got "
                                  f"{type(comm).__module__}.{type(comm).__qualname__}")
    rank, world_size = int(comm.Get_rank()), int(comm.Get_size())
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    if rank == 0:
        # Bind where the other ranks can reach: loopback on one host, every interface otherwise. The job's secret
        # is made here and travels over MPI, which the ranks already trust.
        try:
            secret = new_secret()
            store = TCPStore("127.0.0.1" if one_host else "0.0.0.0", 0, is_server=True, timeout=timeout,
                             secret=secret, rank=0)
            where = ("127.0.0.1" if one_host else hosts[0], store.port, "", secret)
        except Exception as e:  # the other ranks must hear about it, or they wait forever
            comm.bcast((None, 0, f"{type(e).__name__}: {e}", None), root=0)
            raise
        comm.bcast(where, root=0)
    else:
        address, port, error, secret = comm.bcast(None, root=0)
        if error:
            raise InvalidArgument(f"rank 0 could not start the rendezvous store: {error}")
        store = TCPStore(address, port, is_server=False, timeout=timeout, secret=secret, rank=rank)
    # Ranks on this host, in rank order, give the local rank (what an MPI launcher's variables would say).
    mine = hosts[rank]
    local_ranks = [r for r, h in enumerate(hosts) if h == mine]
    lr = local_ranks.index(rank) if local_rank is None else local_rank
    return LaunchInfo(rank=rank, world_size=world_size, local_rank=lr,
                      local_world_size=max(len(local_ranks), lr + 1), address=store.host, port=store.port,
                      launcher="mpi4py"), store
