"""The emulated tests can fail: deliberate one-line breaks must be caught (seeded_bugs.py has fourteen in the custom
kernels, from slice arithmetic to memory ordering, and two in the backends' Python; ``python
tests/emulation/seeded_bugs.py`` runs them all). CI runs one per detector: a slice one element short (wrong
elements: the harness's sentinel and distinct values per element), a deleted barrier(s, 1) (a data race:
ThreadSanitizer), and the custom backend dropping its dependency on the caller's stream (the GPU suite's own
stream-order test, against a mutated copy of the package), plus the seeded thread order's missing __syncthreads and
two bad accesses the device faults on. With --thorough the native ones run over ten seeds of the thread order."""

from __future__ import annotations

import pytest
from seeded_bugs import BY_NAME, caught, suite_catches

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_a_slice_one_element_short_is_caught(plain_tree):
    ok, seen = caught(BY_NAME["block_slice_one_short"], plain_tree)
    assert ok, f"the harness passed a kernel whose slices are one element short ({seen})"


def test_a_deleted_barrier_is_caught(tsan_tree):
    ok, seen = caught(BY_NAME["two_shot_barrier_1_deleted"], tsan_tree)
    assert ok, f"the harness passed two-shot without its barrier(s, 1) ({seen})"


@pytest.mark.spawns
def test_a_dropped_stream_dependency_is_caught():
    """The custom backend ignoring stream= (the class issue 30 found caught 7 times in 19): its stream-order test,
    which queues 32 MiB on the caller's stream ahead of the input's fill, must fail, and pass unmutated."""
    n, seen = suite_catches(BY_NAME["custom_drops_stream_dependency"], runs=1)
    assert n == 1, f"the suite passed the custom backend ignoring stream= ({seen})"


def seeds(request):
    """CI: the mutation's own seed; --thorough: ten seeds of the emulator's thread order."""
    return range(1, 11) if request.config.getoption("--thorough") else ()


def test_a_missing_syncthreads_is_caught_by_the_seeded_thread_order(plain_tree, request):
    """begin_call without the __syncthreads after thread 0's writes to shared memory: in index order thread 0 always
    runs first and the harness passes it (seen 2026-11-28); with the seeded thread order it reads them unwritten."""
    ok, seen = caught(BY_NAME["begin_call_barrier_deleted"], plain_tree, seeds(request))
    assert ok, f"the harness passed begin_call without its __syncthreads ({seen})"


@pytest.mark.parametrize("name, error", [("block_copy_head_one_past", "cudaErrorIllegalAddress"),
                                         ("pack_split_ignores_misalignment", "cudaErrorMisalignedAddress")])
def test_a_bad_access_is_a_device_fault(plain_tree, request, name, error):
    """A read one element past an allocation, and a 16-byte pack off its boundary: the emulated device checks every
    global access of the kernels and faults as a GPU does, with CUDA's sticky error, which the harness's call raises
    (not wrong data found later, and not a segfault of the process: the misaligned pack was one before the checks)."""
    ok, seen = caught(BY_NAME[name], plain_tree, seeds(request))
    assert ok and error in seen, f"{name}: not caught as {error} ({seen})"
