"""Stragglers on the NCCL backend (the Nccl backend holds one ``Arrivals``): a collective's arrival is when each rank
enqueued it, as its flight recorder says. Each rank's watchdog publishes its last SAMPLE collectives' enqueue times
through the store with the progress it publishes anyway (at most every 0.5 s, never on a call's path);
``stats()`` reads the peers' samples and adds each collective to a window (csrc/core/stragglers.h, the host
backend's) once every rank's sample holds it. Between two reads a busy job issues more than a sample holds, so
this measures a sample of the collectives, not all of them. Collectives are matched by their number among
collectives alone (coll_seq): NCCL's operation numbers count sends and receives too, which ranks make in different
numbers."""

from __future__ import annotations

import contextlib
import json
import threading

from gpucoll import _log, config
from gpucoll._native import _C

SAMPLE = 64  # collectives of each rank's enqueue times in the sample its watchdog publishes
WINDOW = 1000  # collectives stats() keeps (as the host backend's window)


class Arrivals:
    def __init__(self, comm, store, prefix: str, rank: int, world_size: int):
        """`comm`: the native NCCL communicator (its trace()); `store`, `prefix`: where the samples go."""
        self._comm, self._store, self._key = comm, store, f"{prefix}arrivals/"
        self._rank, self._world_size = rank, world_size
        self._lock = threading.Lock()
        self._window = None  # _C.StragglerWindow, made by the first stats()
        self._measured = 0  # the coll_seq of the last collective added to it
        # GPUCOLL_STRAGGLER_REPORT: rank 0 logs the summary every this many collectives it issues (tick()).
        self._report = config.get_int("GPUCOLL_STRAGGLER_REPORT") if rank == 0 else 0
        self._issued = 0

    def tick(self) -> None:
        """A collective was issued (the caller's thread). Every GPUCOLL_STRAGGLER_REPORT of them, rank 0 logs the
        summary of the collectives measured so far: those whose samples every peer's watchdog has published (at
        most 0.5 s behind)."""
        if self._report > 0:
            self._issued += 1
            if self._issued % self._report == 0:
                with contextlib.suppress(Exception):  # a report never fails a collective
                    _log.always(self.stats(False)["summary"])

    def sample(self) -> list:
        """[coll_seq, wall-clock ns] of this rank's last SAMPLE collectives, as enqueued."""
        t = self._comm.trace(SAMPLE)
        off = t["realtime_ns"] - t["monotonic_ns"]
        return [[e["coll_seq"], e["enqueue_ns"] + off] for e in t["entries"] if e["op"] != "p2p"]

    def publish(self) -> None:
        """The watchdog's part; never raises (the recorder may be off or the store gone: progress goes first), and
        never waits behind the main thread on the store client (try_set)."""
        with contextlib.suppress(Exception):
            try_set = getattr(self._store, "try_set", None)
            if try_set is not None:
                try_set(f"{self._key}{self._rank}", json.dumps(self.sample()).encode())

    def stats(self, reset: bool) -> dict:
        """Communicator.stragglers() on NCCL: each rank's lateness at the collectives measured so far."""
        with self._lock:
            if self._window is None:
                self._window = _C.StragglerWindow(self._world_size, WINDOW)
        arrivals = {seq: {self._rank: t} for seq, t in self.sample()}
        for r in range(self._world_size):
            key = f"{self._key}{r}"
            if r == self._rank or not self._store.check(key):
                continue
            for seq, t in json.loads(self._store.get(key, timeout=5.0)):
                if seq in arrivals:
                    arrivals[seq][r] = t
        with self._lock:
            for seq in sorted(arrivals):
                if seq > self._measured and len(arrivals[seq]) == self._world_size:
                    self._window.add([arrivals[seq][r] for r in range(self._world_size)])
                    self._measured = seq
            out = self._window.stats()
            if reset:
                self._window.clear()
        return out
