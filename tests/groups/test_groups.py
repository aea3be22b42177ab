"""Sub-communicators on the host backend: split (MPI_Comm_split semantics: color, key, color None opts out),
subgroup(Group) with the Group algebra, nested splits, and sub-communicators running concurrently with each other
(two threads, one per communicator, as tensor-parallel groups inside data-parallel ones) and with the parent.
Every collective on every sub-communicator is checked exactly; values derive from each rank's global rank, so a
rank that landed in the wrong group or at the wrong position shows up. One spawn per world size (2, 3, 5, 8)."""

from __future__ import annotations

import threading

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll import Group
from gpucoll.errors import InvalidArgument

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

def _groups(comm) -> dict:
    P, r = comm.world_size, comm.rank
    fails = []
    every = list(range(P))
    # split by parity, ordered by descending global rank (key = -rank)
    sub = comm.split(r % 2, key=-r)
    members = sorted((q for q in every if q % 2 == r % 2), reverse=True)
    if sub.world_size != len(members) or sub.rank != members.index(r):
        fails.append(f"split: global rank {r} is rank {sub.rank} of {sub.world_size}; expected "
                     f"{members.index(r)} of {len(members)}")
    fails += helpers.every_collective(sub, members, "split by parity")
    # color None opts out; the others form one communicator in rank order
    low = comm.split(None if r == 0 else 7)
    if r == 0:
        if low is not None:
            fails.append("split(None) returned a communicator")
    else:
        fails += helpers.every_collective(low, every[1:], "split without rank 0")
    # subgroup of a Group made by the algebra: (evens | {1}) - {0}, on every rank; outsiders get None
    g = (Group(range(0, P, 2)) | Group([1])) - Group([0]) if P > 1 else Group([0])
    sg = comm.subgroup(g)
    if (sg is None) != (r not in g):
        fails.append(f"subgroup {g}: global rank {r} got {sg!r}")
    elif sg is not None:
        fails += helpers.every_collective(sg, list(g), f"subgroup {g}")
        sg.close()
    # nested: split the parity communicator again by position
    nested = sub.split(sub.rank // 2)
    nested_members = [members[i] for i in range(len(members)) if i // 2 == sub.rank // 2]
    fails += helpers.every_collective(nested, nested_members, "nested split")
    # concurrency: two sibling communicators (parity and halves) in two threads at once, 30 calls each, while the
    # parent runs all_reduces on this thread.
    halves = comm.split(r * 2 // P if P > 1 else 0)
    halves_members = [q for q in every if q * 2 // P == r * 2 // P] if P > 1 else [0]
    errors: list = []

    def run(c, mem, tag):
        try:
            for i in range(30):
                got = c.all_reduce(np.full(257, i, np.float32) + mem[c.rank])
                want = np.full(257, i * len(mem), np.float32) + sum(mem)
                if not np.array_equal(got, want):
                    errors.append(f"{tag} call {i}")
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{tag}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(sub, members, "parity thread")),
               threading.Thread(target=run, args=(halves, halves_members, "halves thread"))]
    for t in threads:
        t.start()
    for i in range(30):
        if not np.array_equal(comm.all_reduce(np.full(64, r + i, np.float32)),
                              np.full(64, sum(every) + P * i, np.float32)):
            errors.append(f"parent call {i}")
    for t in threads:
        t.join(120)
    fails += errors
    # Ranks that ask for different subgroups: the same InvalidArgument on every rank, and the parent still works.
    try:
        comm.subgroup(Group([0, r]) if P > 1 else Group([0, 1 + r]))
        mismatch = None
    except InvalidArgument as e:
        mismatch = str(e)
    fails += helpers.every_collective(comm, every, "parent after the refused subgroup")
    for c in (nested, halves, sub, low):
        if c is not None:
            c.close()
    return {"fails": fails, "mismatch": mismatch}


@pytest.mark.parametrize("P", (2, 3, 5, 8))
def test_split_subgroup_nested_concurrent(P):
    results = gpucoll.spawn(_groups, P, backend="host", timeout=60.0)
    fails = [f for res in results for f in res["fails"]]
    assert not fails, helpers.format_failures(fails)
    messages = {res["mismatch"] for res in results}
    assert len(messages) == 1 and None not in messages, messages
    assert "same subgroup" in messages.pop()


def _bad_args(comm) -> list:
    out = []
    for call in (lambda: comm.split(-1), lambda: comm.split("a"), lambda: comm.split(0, key=1.5),
                 lambda: comm.subgroup([0, comm.world_size]), lambda: comm.subgroup([-1])):
        try:
            call()
            out.append(None)
        except InvalidArgument as e:
            out.append(str(e))
    comm.close()
    try:
        comm.split(0)
        out.append(None)
    except gpucoll.errors.InvalidUsage as e:
        out.append(str(e))
    return out


def test_bad_arguments_raise_on_every_rank_without_hanging():
    results = gpucoll.spawn(_bad_args, 2, backend="host", timeout=30.0)
    assert results[0] == results[1]
    assert all(m is not None for m in results[0]), results[0]
    assert "color" in results[0][0] and "key" in results[0][2] and "rank" in results[0][3]
    assert "closed" in results[0][5]
