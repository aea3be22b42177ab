"""The host backend's copies between the user's arrays and its work buffers at every offset modulo 4 KiB that
glibc's memcpy handles slowly on AMD (the destination 1 to 63 bytes past the source, where kernels.cc's copy_bytes
takes its own loop) and at a few others, with lengths that end inside that loop's 64-byte blocks: exact sums, and the
memory on either side of each array untouched."""

from __future__ import annotations

import numpy as np
import pytest

import gpucoll

pytestmark = pytest.mark.spawns

SENTINEL = -7.0
LENGTHS = (511, 512, 1000, 4097, 70_001)  # elements: under and over the 2 KiB where memcpy turns to rep movsb
OFFSETS = (0, 1, 2, 4, 15, 16, 17, 1023)  # float32 elements past a page: 0 to 64 bytes, and one far from it


def _worker(comm):
    P, r = comm.world_size, comm.rank
    errs = []
    for n in LENGTHS:
        for off in OFFSETS:
            page = np.full(1024 + off + n + 64, SENTINEL, np.float32)
            base = (-page.ctypes.data % 4096) // 4  # the first element on a page boundary
            x = page[base + off: base + off + n]
            x[:] = np.arange(n, dtype=np.float32) % 1000 + r + 1  # distinct per element and rank, exact sums
            comm.all_reduce(x)
            want = P * (np.arange(n, dtype=np.float32) % 1000) + P * (P + 1) / 2
            if not np.array_equal(x, want):
                bad = np.flatnonzero(x != want)
                errs.append(f"n={n} offset={off}: {bad.size} wrong, first [{bad[0]}] = {x[bad[0]]}, want {want[bad[0]]}")
            outside = np.concatenate([page[:base + off], page[base + off + n:]])
            if not (outside == SENTINEL).all():
                errs.append(f"n={n} offset={off}: memory beside the array was written")
    return errs


@pytest.mark.parametrize("nranks", [1, 3])
def test_copies_at_every_offset_are_exact_and_stay_inside_the_array(nranks):
    results = gpucoll.spawn(_worker, nranks, backend="host", timeout=120.0)
    assert results == [[]] * nranks, results
