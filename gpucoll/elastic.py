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
Arrays in `state` are anything the communicator takes (NumPy arrays, CPU torch tensors on the host backend; CUDA
tensors on the GPU backends). Joining ranks (growing the job) is not supported yet.
"""

from __future__ import annotations

import time

import numpy as np

from gpucoll.errors import CollectiveTimeout, RemoteError

FAILURES = (CollectiveTimeout, RemoteError)


def run(comm, step, state: dict, *, steps: int, start: int = 0, on_event=None, max_failures: int = 8):
    """Call ``step(comm, state, i)`` for i in [start, steps), shrinking and resynchronising on failures (see the
    module docstring). `on_event(kind, info)` is told of each failure ("failure": the error, the rank's step) and
    recovery ("recovered": old and new size, seconds from the failure, the step resumed at). Returns the
    communicator in use at the end and `state`. Raises the failure itself after `max_failures` recoveries, or when
    this rank cannot take part in the shrink."""
    i, failures = start, 0
    while i < steps:
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
        # Every survivor resumes where the new rank 0 is: its step count and its state.
        done = np.array([i], np.int64)
        comm.broadcast(done, root=0)
        i = int(done[0])
        for name in sorted(state):
            comm.broadcast(state[name], root=0)
        if on_event is not None:
            on_event("recovered", {"old_size": old_size, "world_size": comm.world_size, "rank": comm.rank,
                                   "seconds": time.monotonic() - failed_at, "step": i})
    return comm, state
