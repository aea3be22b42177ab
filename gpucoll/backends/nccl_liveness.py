"""Who is gone, when NCCL only says "remote": a heartbeat per rank through the rendezvous store.

NCCL reports a dead peer process or a machine cut off from the network as ncclRemoteError ("remote process exited
or there was a network error") without saying which rank. So every rank of an NCCL communicator beats: every
_BEAT_S it writes a growing count under ``<prefix>beat/<rank>``, from a thread and over a store connection of its
own (never behind a wait of the main thread, which may sit in a collective or a shrink), until the communicator is
closed, failed or not. On an ncclRemoteError a rank reads every count, waits _BEAT_WAIT_S (four beats) and names the
ranks whose count did not move: a killed process, or a machine the store cannot hear. Survivors that fail at the same
moment keep beating, so they do not name each other; a rank on the far side of a cut cannot read the store, and keeps
NCCL's own error.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from gpucoll import _log
from gpucoll.bootstrap.prefix import PrefixStore
from gpucoll.bootstrap.store import TCPStore
from gpucoll.errors import GpucollError, NcclError, RemoteError

_BEAT_S, _BEAT_WAIT_S = 0.5, 2.0


class Heartbeat:
    """This rank's heartbeat in the communicator's part of the store (`prefix`)."""

    def __init__(self, store, prefix: str, rank: int, world_size: int, timeout: float):
        self._store, self._prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self._timeout = timeout
        self._client = None  # the heartbeat's own connection; False: none can be made (not gpucoll's store)
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_beat_main, args=(weakref.ref(self), self._stop),
                                        name=f"gpucoll-nccl-heartbeat-r{rank}", daemon=True)
        if world_size > 1:
            self._thread.start()

    def client(self):
        if self._client is None:
            chain, root = [], self._store
            while isinstance(root, PrefixStore):
                chain.append(root._prefix)
                root = root._base
            try:
                client = TCPStore(root.host, root.port, is_server=False, timeout=self._timeout, like=root)
            except Exception:  # noqa: BLE001 - not gpucoll's store, or unreachable: no heartbeat, no naming
                self._client = False
                return None
            for prefix in reversed(chain):
                client = PrefixStore(client, prefix)
            self._client = client
        return self._client or None

    def beat(self) -> None:
        client = self.client()
        if client is not None:
            self._count += 1
            client.set(f"{self._prefix}beat/{self.rank}", str(self._count).encode())

    def name_lost(self, err: NcclError, should_stop) -> GpucollError:
        """`err` (an ncclRemoteError) as RemoteError naming the ranks whose heartbeat stood still for
        _BEAT_WAIT_S; `err` itself where none did or the store cannot be read. `should_stop(seconds)` waits, True
        when the communicator is closing."""
        client = self.client()
        if client is None:
            return err

        def counts():
            out = []
            for r in range(self.world_size):
                key = f"{self._prefix}beat/{r}"
                out.append(client.get(key, timeout=1.0) if client.check(key) else None)
            return out

        try:
            before = counts()
            if should_stop(_BEAT_WAIT_S):
                return err
            after = counts()
        except GpucollError:
            return err
        silent = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
        if not silent:
            return err
        return RemoteError(f"{err.message}; lost: rank(s) {silent} (no heartbeat through the rendezvous store for "
                           f"{_BEAT_WAIT_S:g} s)", call=err.call, location=err.location, ranks=tuple(silent))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        if self._client:
            with contextlib.suppress(Exception):
                self._client.close()


def _beat_main(ref, stop: threading.Event) -> None:
    # Holds the heartbeat only while it beats, so that an unreferenced communicator can still be collected.
    while not stop.wait(_BEAT_S):
        hb = ref()
        if hb is None:
            return
        try:
            hb.beat()
        except Exception as e:  # noqa: BLE001 - the store may be gone (rank 0 exited): beat again next time
            _log.debug(f"NCCL heartbeat failed: {type(e).__name__}: {e}")
        del hb
