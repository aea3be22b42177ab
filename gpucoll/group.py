"""Groups of ranks, and the protocols that make new communicators from an existing one.

The seed notes' groups: "the nodes that run one operation form a group; groups combine by intersection and union
into new groups". ``Group`` is that set algebra over ranks of a communicator; ``Communicator.subgroup(group)``,
``split(color, key)`` (MPI_Comm_split, ncclCommSplit) and ``shrink()`` (ncclCommShrink: the survivors of a
failure) build the new communicator. All three are collective over the parent's ranks and agree through the
parent's rendezvous store, then build the child with the parent's backend over a prefixed view of that store
(bootstrap/prefix.py): every backend's own set-up (a new shared-memory region, NCCL communicator, or peer memory)
runs unchanged for the child, which shares nothing with the parent at run time, so parents and children (and
siblings) may run collectives concurrently. A backend that can split its own communicator does that instead for
split and subgroup (NCCL: ncclCommSplit, which sets the child up from the parent's bootstrap; Backend.can_split),
once every rank said it can. Shrink likewise uses the backend's own shrink (ncclCommShrink) when every survivor
can: when no survivor saw a failure (a rank left, exclude=); after a failure the survivors' NCCL communicator is a
new init (the watchdog that named the dead rank aborted the old one).

Agreement, and why each step is there:
* split/subgroup: each rank publishes (color, key, what it was asked) under a key numbered by a shared counter, reads
  everyone's, and derives its child from the same table, so every rank sees the same grouping. Ranks that asked
  for different subgroups get the same InvalidArgument each, naming what each asked.
* shrink: survivors cannot count on the dead to publish anything. Each survivor publishes that it is alive and
  the ranks it knows are dead (named by an earlier failure, or excluded by the caller). The first survivor to
  arrive (an atomic add on the store decides who) waits until every rank has either arrived or been named dead by
  someone, or until the timeout, and publishes the survivor list; everyone builds from that one list, so they
  agree even when they saw different failures first. A rank that arrives after the list was published and is not
  on it is told so. The agreement goes through the parent's store, served in rank 0's process: shrink needs
  rank 0 alive. The survivors' communicator then gets a store of its own, served by its new rank 0.
"""

from __future__ import annotations

import json
import socket
import time

from gpucoll.bootstrap.prefix import PrefixStore
from gpucoll.bootstrap.store import TCPStore
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage

_SPLIT = "gpucoll/split/"
_SHRINK = "gpucoll/shrink/"
_GROW = "gpucoll/grow/"
_JOIN = "gpucoll/join/"


def _rank_list(ranks, what: str) -> list:
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise InvalidArgument(f"{what} must hold ranks (ints >= 0); got {r!r}")
        out.append(r)
    return out


class Group:
    """A set of ranks, ordered by rank. ``a | b``, ``a & b``, ``a - b``, ``a ^ b`` (and union, intersection,
    difference, symmetric_difference) make new groups; ``comm.subgroup(g)`` builds the communicator of g's ranks,
    numbered in rank order."""

    __slots__ = ("_ranks",)

    def __init__(self, ranks=()):
        if isinstance(ranks, Group):
            ranks = ranks.ranks
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise InvalidArgument(f"a Group is made from an iterable of ranks; got {ranks!r}")
        self._ranks = tuple(sorted(set(_rank_list(ranks, "a Group"))))

    @property
    def ranks(self) -> tuple:
        """The ranks, ascending."""
        return self._ranks

    def rank_of(self, rank: int):
        """The position of `rank` in this group (its rank in the group's communicator), or None."""
        try:
            return self._ranks.index(rank)
        except ValueError:
            return None

    @staticmethod
    def _other(other) -> Group:
        return other if isinstance(other, Group) else Group(other)

    def union(self, other) -> Group:
        return Group(set(self._ranks) | set(self._other(other).ranks))

    def intersection(self, other) -> Group:
        return Group(set(self._ranks) & set(self._other(other).ranks))

    def difference(self, other) -> Group:
        return Group(set(self._ranks) - set(self._other(other).ranks))

    def symmetric_difference(self, other) -> Group:
        return Group(set(self._ranks) ^ set(self._other(other).ranks))

    __or__, __and__, __sub__, __xor__ = union, intersection, difference, symmetric_difference

    def __contains__(self, rank) -> bool:
        return rank in self._ranks

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self):
        return iter(self._ranks)

    def __eq__(self, other) -> bool:
        return isinstance(other, Group) and other._ranks == self._ranks

    def __hash__(self) -> int:
        return hash(self._ranks)

    def __repr__(self) -> str:
        return f"Group({list(self._ranks)})"


def split(store, rank: int, world_size: int, timeout: float, color, key, build, asked=None, native=None):
    """The child communicator of this rank (None for color None): `build(rank, size, store, members)` makes it.
    `asked`: what every rank must agree on (subgroup's group), compared across ranks. `native(color, rank, size,
    store, members)`, when this rank's backend can split its own communicator (ncclCommSplit), makes it instead,
    called on every rank (color None too, which gets None): used only when every rank has it."""
    if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
        raise InvalidArgument(f"color must be an int >= 0, or None to take no part; got {color!r}")
    if key is None:
        key = rank
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidArgument(f"key must be an int (it orders the ranks of a color), or None for rank order; "
                              f"got {key!r}")
    # Numbered by a shared counter: every rank of this communicator calls split the same number of times.
    gen = (store.add(_SPLIT + "count", 1) - 1) // world_size
    base = f"{_SPLIT}{gen}/"
    store.set_json(f"{base}{rank}", [color, key, asked, native is not None])
    rows = [store.get_json(f"{base}{q}", timeout=timeout) for q in range(world_size)]
    asks = [json.dumps(row[2]) for row in rows]
    if len(set(asks)) > 1:
        shown = "; ".join(f"rank {q}: {row[2]}" for q, row in enumerate(rows))
        raise InvalidArgument(f"every rank must ask for the same subgroup; they asked: {shown}")
    members = [q for _, q in sorted((row[1], q) for q, row in enumerate(rows) if row[0] == color)]
    child_store = PrefixStore(store, f"{base}{color}/")
    if native is not None and all(row[3] for row in rows):
        # The backend's own key is the rank in `members`, so its order is this table's whatever its tie rule.
        return native(color, members.index(rank) if color is not None else 0, len(members), child_store, members)
    if color is None:
        return None
    return build(members.index(rank), len(members), child_store, members)


def shrink(store, rank: int, world_size: int, timeout: float, n: int, exclude, known_dead, build, native=None):
    """The survivors' communicator: see the module docstring. `n` numbers this communicator's shrinks.
    `native(gone, rank, size, store, survivors)`, when this rank's backend can shrink its own communicator
    (ncclCommShrink: it saw no failure), makes it instead from the ranks that are `gone`; used only when every
    survivor has it.

    Only requests the store answers at once (set, add, check, and get of a present key) are used: gpucoll's store
    answers a wait with the news that a rank left the job once one has, which is exactly the situation here. For the
    same reason the survivors' communicator gets a store of its own (below)."""
    exclude = set(_rank_list(exclude, "exclude"))
    bad = [q for q in exclude if q >= world_size]
    if bad:
        raise InvalidArgument(f"exclude holds ranks outside this communicator of {world_size}: {sorted(bad)}")
    if rank in exclude:
        raise InvalidArgument(f"rank {rank} is in exclude: a rank that leaves does not call shrink")
    base = f"{_SHRINK}{n}/"
    claims = sorted(exclude | set(known_dead))
    store.set_json(f"{base}here/{rank}", [claims, sorted(exclude), socket.gethostname(), native is not None])
    if store.add(f"{base}decider", 1) == 1:
        _decide(store, base, world_size, timeout)
    survivors = _poll_json(store, f"{base}decided", 2 * timeout + 5.0, "the survivors' list")
    if rank not in survivors:
        raise InvalidUsage(f"rank {rank} reached shrink after the survivors {survivors} were decided without it "
                           f"(another rank named it dead, or it came later than the timeout)")
    new_rank = survivors.index(rank)
    new_store = _survivors_store(store, base, new_rank, survivors, timeout)
    # Every survivor published its row before the list was decided, so each reads the same rows here.
    if native is not None and all(store.get_json(f"{base}here/{q}", timeout=timeout)[3] for q in survivors):
        gone = [q for q in range(world_size) if q not in survivors]
        return native(gone, new_rank, len(survivors), new_store, survivors)
    return build(new_rank, len(survivors), new_store, survivors)


def _poll_json(store, key: str, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"shrink: {what} was not published within {timeout:g} s")
        time.sleep(0.005)
    return store.get_json(key)


def _root_store(store):
    while isinstance(store, PrefixStore):
        store = store._base
    return store


def _survivors_store(store, base: str, new_rank: int, survivors: list, timeout: float):
    """A fresh store served by the survivors' rank 0 (gpucoll's store, which remembers the dead rank; it admits
    the same members: the same secret), or a prefixed view of the parent's where that is another kind of store."""
    hosts = set()
    if new_rank == 0 and isinstance(_root_store(store), TCPStore):
        hosts = {_poll_json(store, f"{base}here/{q}", timeout, "a survivor's record")[2] for q in survivors}
    return _fresh_store(store, base, new_rank, hosts, timeout)


def _fresh_store(store, base: str, new_rank: int, hosts: set, timeout: float):
    """The store of a communicator made from this one: served by its rank 0 (listening on loopback when every
    host in `hosts` is this one), its address published under `base`; where the parent's store is not gpucoll's,
    a prefixed view of it."""
    root = _root_store(store)
    if not isinstance(root, TCPStore):
        return PrefixStore(store, f"{base}comm/")
    if new_rank == 0:
        if root.is_server and root.host not in ("", "0.0.0.0", "::"):
            # This process serves the parent's store: listen where it does, which every member (and any process
            # that could join the parent) reaches, and nowhere wider.
            bind = address = root.host
        elif hosts <= {socket.gethostname()}:
            bind = address = "127.0.0.1"
        else:
            # The members on other machines reach the parent's store; this process reaches it from this address,
            # on the same network: listen there, not on every interface.
            bind = address = root.local_address()
        new = TCPStore(bind, 0, is_server=True, timeout=timeout, rank=0, like=root)
        store.set_json(f"{base}store", [address, new.port])
        return new
    address, port = _poll_json(store, f"{base}store", timeout, "the new communicator's store address")
    return TCPStore(address, int(port), is_server=False, timeout=timeout, rank=new_rank, like=root)


# -- growing: new processes join a running job ------------------------------------------------------------------------

def waiting_to_join(store) -> int:
    """How many processes asked to join and were not admitted yet (answered at once)."""
    issued = int(store.get(_JOIN + "tickets")) if store.check([_JOIN + "tickets"]) else 0
    admitted = int(store.get(_JOIN + "admitted")) if store.check([_JOIN + "admitted"]) else 0
    return issued - admitted


def grow(store, rank: int, world_size: int, timeout: float, n: int, build):
    """Members' side: admit every process waiting to join (rank 0 decides which: those with a ticket now); they
    become ranks world_size.. in ticket order. Everyone builds the new communicator over a fresh store."""
    base = f"{_GROW}{n}/"
    if rank == 0:
        issued = int(store.get(_JOIN + "tickets")) if store.check([_JOIN + "tickets"]) else 0
        admitted = int(store.get(_JOIN + "admitted")) if store.check([_JOIN + "admitted"]) else 0
        # A joiner that gave up withdrew its ticket by claiming it first (join): the claim decides, atomically.
        tickets = [t for t in range(admitted + 1, issued + 1) if store.add(f"{_JOIN}claim/{t}", 1) == 1]
        size = world_size + len(tickets)
        hosts = {store.get_json(f"{_JOIN}ticket/{t}", timeout=timeout)[0] for t in tickets}
        if isinstance(_root_store(store), TCPStore) and _root_store(store).host not in ("127.0.0.1", "localhost"):
            hosts.add("")  # members may be elsewhere: listen on every interface
        store.set_json(f"{base}plan", [size, tickets])
        store.add(_JOIN + "admitted", issued - admitted)
        new = _fresh_store(store, base, 0, hosts, timeout)
        for i, t in enumerate(tickets):
            store.set_json(f"{_JOIN}admit/{t}", [base, world_size + i, size])
        return build(0, size, new, list(range(size)))
    size, _ = _poll_json(store, f"{base}plan", timeout, "the plan of the grown communicator")
    return build(rank, size, _fresh_store(store, base, rank, set(), timeout), list(range(size)))


def join(store, timeout: float, build):
    """Joiner's side: take a ticket, wait (up to `timeout`) until the members admit it, build with them."""
    ticket = store.add(_JOIN + "tickets", 1)
    store.set_json(f"{_JOIN}ticket/{ticket}", [socket.gethostname()])
    try:
        base, rank, size = _poll_json(store, f"{_JOIN}admit/{ticket}", timeout, "this process's admission")
    except CollectiveTimeout:
        if store.add(f"{_JOIN}claim/{ticket}", 1) == 1:
            raise  # withdrawn: a later grow() skips this ticket
        # rank 0 claimed it first: the admission is on its way
        base, rank, size = _poll_json(store, f"{_JOIN}admit/{ticket}", timeout, "this process's admission")
    return build(rank, size, _fresh_store(store, base, rank, set(), timeout), list(range(size)))


def _lost_ranks(store) -> set:
    """Ranks gpucoll's store saw die (their process exited, their connection closed), by this communicator's
    numbering: only where the store is this communicator's own (a prefixed view numbers ranks of another one)."""
    if not isinstance(store, TCPStore):
        return set()
    return set(store.lost())


def _decide(store, base: str, world_size: int, timeout: float) -> None:
    """Wait for every rank that nobody named dead, then publish the survivors (ranks that arrived, not excluded)."""
    deadline = time.monotonic() + timeout
    arrived: dict = {}
    lost: set = set()
    polls = 0
    while True:
        for q in range(world_size):
            if q not in arrived and store.check([f"{base}here/{q}"]):
                arrived[q] = store.get_json(f"{base}here/{q}")
        if polls % 10 == 0:
            lost |= _lost_ranks(store)
        polls += 1
        dead = lost | {d for row in arrived.values() for d in row[0]}
        waiting = [q for q in range(world_size) if q not in arrived and q not in dead]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    excluded = {d for row in arrived.values() for d in row[1]}
    survivors = sorted(q for q in arrived if q not in excluded)
    store.set_json(f"{base}decided", survivors)
