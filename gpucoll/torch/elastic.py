"""torch.distributed's default group over the ranks of a gpucoll Communicator: the way a DDP job carries on after
``comm.shrink()`` (or ``comm.grow()``) without restarting its processes.

    comm = gpucoll.init()                                   # or spawn's communicator
    gpucoll.torch.elastic.init_process_group(comm)         # torch's default group: comm's ranks, backend gpucoll
    ddp = DDP(model)
    try:
        train(ddp)
    except Exception:                                       # a peer died: the step's collective raised
        new = comm.shrink()                                 # the survivors' communicator (gpucoll/group.py)
        comm.abort()
        comm = new
        gpucoll.torch.elastic.init_process_group(comm)     # destroys the old default group, makes the new one
        ddp = DDP(model)                                    # DDP broadcasts rank 0's parameters to every rank
        train(ddp)

The new default group meets through a fresh torch TCPStore served by the communicator's rank 0, whose port the
communicator itself broadcasts: nothing of the old group (or of the launcher's store, whose server may have died
with its rank) is needed. Rank and world size are the communicator's.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch.distributed as dist

from gpucoll import _log
from gpucoll.errors import Unsupported
from gpucoll.torch.process_group import BACKEND_NAME


def init_process_group(comm, backend: str = BACKEND_NAME, timeout: float | None = None):
    """Collective over `comm`'s ranks: destroy torch's default group if there is one, then initialise it with
    `backend` ("gpucoll", or e.g. "cpu:gloo,cuda:gpucoll") for comm.rank of comm.world_size. Returns torch's
    default group."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the old group may hold a dead peer; its teardown is best effort
            _log.debug(f"destroying the old default group failed: {e}")
    seconds = float(timeout if timeout is not None else comm.timeout)
    try:
        address = comm.join_address()[0]  # where rank 0 is reachable: its gpucoll store's address
    except Unsupported:
        address = "127.0.0.1"
    port = np.zeros(1, np.int64)
    store = None
    if comm.rank == 0:
        store = dist.TCPStore("0.0.0.0" if address != "127.0.0.1" else address, 0, comm.world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False)
        port[0] = store.port
    comm.broadcast(port, root=0)
    if store is None:
        store = dist.TCPStore(address, int(port[0]), comm.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=seconds))
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.world_size,
                            timeout=datetime.timedelta(seconds=seconds))
    return dist.group.WORLD
