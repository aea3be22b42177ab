"""A view of a rendezvous store under a key prefix: the store of a communicator made from another one (split,
subgroup, shrink), so that its set-up keys never meet the parent's or a sibling's.

Every key (and barrier name) is the prefix plus the caller's key, on the parent's store. close() leaves the parent's
store alone: it belongs to the parent communicator, which must therefore outlive the ones made from it.
"""

from __future__ import annotations


class PrefixStore:
    """`base` (gpucoll's TCPStore, a TorchStore, or another PrefixStore) seen under `prefix`."""

    def __init__(self, base, prefix: str):
        self._base, self._prefix = base, prefix

    @property
    def timeout(self) -> float:
        return self._base.timeout

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes) -> None:
        self._base.set(self._k(key), value)

    def try_set(self, key: str, value: bytes) -> bool:
        """The base store's try_set where it has one (gpucoll's store); else set(), which always happens."""
        try_set = getattr(self._base, "try_set", None)
        if try_set is None:
            self._base.set(self._k(key), value)
            return True
        return try_set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._base.get(self._k(key), timeout=timeout)

    def add(self, key: str, amount: int = 1) -> int:
        return self._base.add(self._k(key), amount)

    def check(self, keys) -> bool:
        return self._base.check([self._k(k) for k in ([keys] if isinstance(keys, str) else keys)])

    def delete(self, key: str) -> bool:
        return self._base.delete(self._k(key))

    def set_json(self, key: str, obj) -> None:
        self._base.set_json(self._k(key), obj)

    def get_json(self, key: str, timeout: float | None = None):
        return self._base.get_json(self._k(key), timeout=timeout)

    def barrier(self, name: str, world_size: int, timeout: float | None = None, rank: int | None = None) -> None:
        self._base.barrier(self._k(name), world_size, timeout=timeout, rank=rank)

    def close(self) -> None:
        """Nothing to release: the parent communicator's store stays open."""

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r} on {self._base!r})"
