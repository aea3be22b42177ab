"""A training loop that survives the loss of ranks: on a failure the survivors shrink their communicator, take the
state of one survivor, and carry on from the step it had completed, without restarting any process.

    def step(comm, state, i):          # one training step on this rank's shard (comm.rank of comm.world_size)
        grad = ...                     # from the shard of the data that comm.rank, comm.world_size select
        comm.all_reduce(grad, op="avg")
        state["w"] -= lr * grad

    comm, state = gpucoll.elastic.run(comm, step, {"w": w}, steps=1000)

What the seed notes ask ("when a worker fails, the others must learn of it and update the communication topology,
otherwise the whole job fails"), the way Horovod Elastic does it in-process, with gpucoll's shrink:
* a step that raises CollectiveTimeout or RemoteError (a peer died: gpucoll names it within milliseconds on the
  host backend) is abandoned on every survivor;
* ``comm.shrink()`` gives the survivors a communicator of their own, renumbered densely, agreed through the
  rendezvous store (rank 0, which serves it, must survive);
* the new rank 0 broadcasts its state (every array of `state`, in place) and the number of steps it completed, so
  every survivor resumes from the same parameters at the same step, whatever each had applied of the failed one;
* `step` is called with the new communicator, so a step that shards its data by comm.rank and comm.world_size
  re-shards by itself.
Growing: with ``run(..., admit_every=k)``, every k steps rank 0 asks the store whether new processes wait to join
(``join_run(address, port, step, state, ...)`` in the new process, with the address from ``comm.join_address()``);
if any do, every rank calls ``comm.grow()``, the newcomers become the last ranks, receive the state and the step,
and everyone carries on at the new size.
Arrays in `state` are anything the communicator takes (NumPy arrays, CPU torch tensors on the host backend; CUDA
tensors on the GPU backends).
"""

from __future__ import annotations

import time

import numpy as np

from gpucoll._make import join as gpucoll_join
from gpucoll.errors import CollectiveTimeout, RemoteError

FAILURES = (CollectiveTimeout, RemoteError)


def run(comm, step, state: dict, *, steps: int, start: int = 0, on_event=None, max_failures: int = 8,
        admit_every: int = 0):
    """Call ``step(comm, state, i)`` for i in [start, steps), shrinking and resynchronising on failures (see the
    module docstring). With admit_every=k > 0, before every k-th step rank 0 looks for processes waiting in
    join_run() and, if there are any, every rank grows the communicator to admit them and sends them the state.
    `on_event(kind, info)` is told of each failure ("failure": the error, the rank's step), recovery
    ("recovered": old and new size, seconds from the failure, the step resumed at) and admission ("grown").
    Returns the communicator in use at the end and `state`. Raises the failure itself after `max_failures`
    recoveries, or when this rank cannot take part in the shrink."""
    i, failures = start, 0
    while i < steps:
        if admit_every > 0 and i % admit_every == 0 and i != start:
            comm, i = _admit(comm, state, i, on_event)
        try:
            step(comm, state, i)
            i += 1
            continue
        except FAILURES as e:
            failed_at, error = time.monotonic(), e
        failures += 1
        if failures > max_failures:
            raise error
        if on_event is not None:
            on_event("failure", {"error": error, "step": i, "rank": comm.rank, "world_size": comm.world_size})
        old_size = comm.world_size
        new = comm.shrink()
        comm.abort()
        comm = new
        i = _resync(comm, state, i)
        if on_event is not None:
            on_event("recovered", {"old_size": old_size, "world_size": comm.world_size, "rank": comm.rank,
                                   "seconds": time.monotonic() - failed_at, "step": i})
    return comm, state


def join_run(address: str, port: int, step, state: dict, *, steps: int, backend: str = "auto",
             timeout: float = 300.0, on_event=None, max_failures: int = 8, admit_every: int = 0, **join_kwargs):
    """A new process's side: join the job whose communicator's join_address() is (address, port) (it admits
    joiners when run() has admit_every), receive the state and the step from its rank 0 into `state` (arrays of
    the same shapes and dtypes), then train with it to the end like run(). Returns what run() returns."""
    started = time.monotonic()
    comm = gpucoll_join(address, port, backend=backend, timeout=timeout, **join_kwargs)
    i = _resync(comm, state, 0)
    if on_event is not None:
        on_event("joined", {"world_size": comm.world_size, "rank": comm.rank, "step": i,
                            "seconds": time.monotonic() - started})
    return run(comm, step, state, steps=steps, start=i, on_event=on_event, max_failures=max_failures,
               admit_every=admit_every)


def _admit(comm, state: dict, i: int, on_event):
    """At a step boundary: rank 0 says whether processes wait to join; if so, grow and send them the state."""
    waiting = np.array([comm.waiting_to_join() if comm.rank == 0 else 0], np.int64)
    comm.broadcast(waiting, root=0)
    if waiting[0] == 0:
        return comm, i
    started, old_size = time.monotonic(), comm.world_size
    new = comm.grow()
    comm.close()
    i = _resync(new, state, i)
    if on_event is not None:
        on_event("grown", {"old_size": old_size, "world_size": new.world_size, "rank": new.rank, "step": i,
                           "seconds": time.monotonic() - started})
    return new, i


def _resync(comm, state: dict, i: int) -> int:
    """Every rank takes rank 0's step count and state (in place, arrays in name order); returns the step."""
    done = np.array([i], np.int64)
    comm.broadcast(done, root=0)
    for name in sorted(state):
        comm.broadcast(state[name], root=0)
    return int(done[0])
