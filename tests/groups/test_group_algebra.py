"""gpucoll.Group: the seed notes' set algebra over ranks (union, intersection, difference), ordered by rank, with
bad members refused by type. The communicators built from groups are tested in tests/groups/test_groups.py."""

from __future__ import annotations

import pytest

from gpucoll import Group
from gpucoll.errors import InvalidArgument


def test_algebra_and_order():
    a, b = Group([3, 0, 2, 2]), Group(range(2, 6))
    assert a.ranks == (0, 2, 3) and len(a) == 3 and list(a) == [0, 2, 3]
    assert (a | b).ranks == (0, 2, 3, 4, 5) == a.union(b).ranks
    assert (a & b).ranks == (2, 3) == a.intersection([2, 3, 9]).ranks
    assert (a - b).ranks == (0,) == a.difference(b).ranks
    assert (a ^ b).ranks == (0, 4, 5) == a.symmetric_difference(b).ranks
    assert 2 in a and 1 not in a
    assert a.rank_of(3) == 2 and a.rank_of(1) is None
    assert Group(a) == a and hash(Group([0, 2, 3])) == hash(a) and a != b
    assert repr(a) == "Group([0, 2, 3])"
    assert len(Group()) == 0


@pytest.mark.parametrize("bad", [[-1], [1.0], [True], ["0"], "01", 3])
def test_bad_members_are_refused(bad):
    with pytest.raises(InvalidArgument):
        Group(bad)
