"""Who arrives late at collectives: ``Communicator.stragglers()``.

In synchronous data-parallel training the slowest rank sets everyone's pace (the barrel effect). The host backend
reads every rank's arrival time at each collective where it already compares the calls (csrc/core/stragglers.h:
no extra synchronisation), and keeps the last 1000 collectives. A rank's lateness at one collective is how long
after the first rank it arrived; "last" counts the collectives at which it arrived after every other rank.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLateness", "Stragglers"]


@dataclass(frozen=True)
class RankLateness:
    rank: int
    median_s: float  # median lateness over the window, in seconds
    p90_s: float
    max_s: float
    last: int  # collectives of the window at which this rank arrived last
    last_share: float  # last / samples


@dataclass(frozen=True)
class Stragglers:
    samples: int  # collectives in the window
    window: int  # the window's capacity
    total: int  # collectives measured since the communicator was made (or the last reset)
    ranks: tuple  # RankLateness per rank, by rank
    summary: str  # one line: the ranks that arrived last most often, and how late

    @classmethod
    def from_native(cls, d: dict) -> Stragglers:
        return cls(samples=d["samples"], window=d["window"], total=d["total"], summary=d["summary"],
                   ranks=tuple(RankLateness(**r) for r in d["ranks"]))

    def slowest(self) -> RankLateness | None:
        """The rank that arrived last most often (ties: the larger median lateness); None before any sample."""
        if not self.samples:
            return None
        return max(self.ranks, key=lambda r: (r.last, r.median_s))

    def __str__(self) -> str:
        head = f"{'rank':>4}  {'last':>6}  {'median ms':>10}  {'p90 ms':>10}  {'max ms':>10}"
        rows = [f"{r.rank:>4}  {r.last_share:>6.0%}  {r.median_s * 1e3:>10.3f}  {r.p90_s * 1e3:>10.3f}  "
                f"{r.max_s * 1e3:>10.3f}" for r in self.ranks]
        return "\n".join([self.summary, head, *rows])
