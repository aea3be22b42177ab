"""The store server's parked requests (see _server.py): ``get`` and ``wait`` calls whose keys do not exist yet.

Two indexes over the same waiters: by missing key (a ``set`` wakes only the requests it can complete, in O(1)
each, however many keys a request names) and by deadline (a heap; answered requests leave it lazily, when they
reach its head or when it is compacted).
"""

from __future__ import annotations

import heapq


class Waiter:
    __slots__ = ("conn", "cost", "deadline", "done", "keys", "missing", "op")

    def __init__(self, conn, op: int, keys: list, deadline: float, missing: set, cost: int):
        self.conn, self.op, self.keys, self.deadline, self.done = conn, op, keys, deadline, False
        self.missing = missing  # the keys it still waits for
        self.cost = cost  # what it holds while parked, counted in the server's buffered bytes

    def __lt__(self, other):  # heap ties
        return id(self) < id(other)


class Waits:
    def __init__(self, data: dict):
        self._data = data
        self._by_key: dict = {}  # key -> {waiter: None} (ordered, O(1) removal)
        self._heap: list = []  # (deadline, waiter)

    def park(self, waiter: Waiter, compact_above: int) -> None:
        for k in waiter.missing:
            self._by_key.setdefault(k, {})[waiter] = None
        if len(self._heap) > compact_above:
            # Answered waits stay in the heap until their deadline (lazy deletion); long timeouts would pile up.
            self._heap = [e for e in self._heap if not e[1].done]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (waiter.deadline, waiter))

    def completed_by(self, key: str) -> list[Waiter]:
        """The waiters that `key`, just set, completes: a get on it, or a wait whose last missing key it was."""
        out = []
        for waiter in self._by_key.pop(key, ()):
            if waiter.done:
                continue
            waiter.missing.discard(key)
            if waiter.missing:
                continue
            # A key seen earlier may have been deleted since: a wait goes on for whatever is missing now.
            waiter.missing = {k for k in waiter.keys if k not in self._data}
            if not waiter.missing:
                out.append(waiter)
            for k in waiter.missing:
                self._by_key.setdefault(k, {})[waiter] = None
        return out

    def forget(self, waiter: Waiter) -> None:
        for k in waiter.missing:
            ws = self._by_key.get(k)
            if ws is not None:
                ws.pop(waiter, None)
                if not ws:
                    del self._by_key[k]

    def next_deadline(self) -> float | None:
        while self._heap and self._heap[0][1].done:  # answered: no reason to wake for it
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> list[Waiter]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            waiter = heapq.heappop(self._heap)[1]
            if not waiter.done:
                out.append(waiter)
        return out

    def parked(self) -> list[Waiter]:
        return [wt for _, wt in self._heap if not wt.done]
