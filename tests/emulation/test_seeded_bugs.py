"""The emulated tests can fail: deliberate one-line breaks of the custom kernels must be caught (seeded_bugs.py has
ten, from slice arithmetic to memory ordering; ``python tests/emulation/seeded_bugs.py`` runs them all). CI runs one
per detector, the two the issue names: a slice one element short (wrong elements: the harness's sentinel and
distinct values per element) and a deleted barrier(s, 1) (a data race: ThreadSanitizer)."""

from __future__ import annotations

import pytest
from seeded_bugs import BY_NAME, caught

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_a_slice_one_element_short_is_caught(plain_tree):
    ok, seen = caught(BY_NAME["block_slice_one_short"], plain_tree)
    assert ok, f"the harness passed a kernel whose slices are one element short ({seen})"


def test_a_deleted_barrier_is_caught(tsan_tree):
    ok, seen = caught(BY_NAME["two_shot_barrier_1_deleted"], tsan_tree)
    assert ok, f"the harness passed two-shot without its barrier(s, 1) ({seen})"
