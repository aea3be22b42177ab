"""The explicit cross-rank call check, for backends whose own synchronisation cannot carry a call's signature.

The host backend compares every call inside the first step of its schedule, at no extra cost (csrc/algo/
call_sig.h). NCCL's kernels are not ours, so under GPUCOLL_DEBUG_CHECKS=1 the NCCL backend compares calls before
it enqueues them: each rank writes its call's signature (the host backend's 24 bytes) to the rendezvous store
under the call's number among the collectives, reads every other rank's, and all ranks raise the same
InvalidArgument, from the same table, when they differ. Nothing was enqueued then, so the communicator stays
usable. Point-to-point calls are not numbered: ranks that exchange messages among some of them keep the
collective sequence in step. A rank that never makes the call is named after the timeout (or at once, when the
store saw its process die).

The cost is a store round trip per collective (one set, world_size - 1 gets, one delete), which is why it is off
by default (the README gives its measured cost).
"""

from __future__ import annotations

from gpucoll._native import _C
from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument

__all__ = ["StoreCallCheck"]


class StoreCallCheck:
    def __init__(self, store, prefix: str, rank: int, world_size: int, timeout: float):
        self._C = _C
        self._store = store
        self._base = f"{prefix}callsig/"
        self._rank = rank
        self._world_size = world_size
        self._timeout = float(timeout)
        self.seq = 0  # collectives checked so far (barriers included, point-to-point not)

    def check(self, coll: int, dtype: int, op: int, premul: bool, root: int, count: int) -> None:
        """Compares this call with every rank's call of the same number. coll < 0 is a barrier."""
        seq = self.seq
        self.seq += 1
        mine = self._C.call_sig(seq & 0xFFFFFFFF, coll, dtype, op, premul, root, count)
        self._store.set(f"{self._base}{seq}/{self._rank}", mine)
        sigs = []
        for q in range(self._world_size):
            if q == self._rank:
                sigs.append(mine)
                continue
            try:
                sigs.append(self._store.get(f"{self._base}{seq}/{q}", self._timeout))
            except CollectiveTimeout as e:
                missing = self._missing(seq, q)
                raise CollectiveTimeout(f"collective #{seq}: ranks {missing} did not make it within "
                                        f"{self._timeout:g} s (GPUCOLL_DEBUG_CHECKS compares every collective "
                                        f"before it runs): {e.message}", ranks=missing) from None
        # Every rank wrote call seq - 1 before it read this one, so all of them are done reading seq - 2.
        if seq >= 2:
            self._store.delete(f"{self._base}{seq - 2}/{self._rank}")
        verdict = self._C.call_mismatch(sigs)
        if verdict is not None:
            message, odd = verdict
            raise InvalidArgument(message, ranks=odd)

    def _missing(self, seq: int, late: int) -> list:
        """The ranks whose call `seq` is not in the store; [late] when the store cannot say (rank 0, which serves
        it, may have given up on the same call and exited already)."""
        try:
            return [r for r in range(self._world_size)
                    if r != self._rank and not self._store.check(f"{self._base}{seq}/{r}")] or [late]
        except GpucollError:
            return [late]
