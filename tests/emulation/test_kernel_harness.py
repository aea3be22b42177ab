"""gpucoll's custom allreduce kernels under the native virtual-ranks harness (native/vranks_harness.cc): P ranks in
one process through the real CustomComm and launchers, every kernel at P = 2, 3, 5, 8, messages in pieces and in
several blocks, registered and in-place inputs, each element checked against the host backend's arithmetic; and a
rank whose peer never arrives times out instead of hanging.

The Python-level matrix (tests/custom/test_custom_gpu.py) covers the kernels through the public API; this one runs
without the installed gpucoll and is the base of the ThreadSanitizer and seeded-bug checks."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


def test_every_kernel_matches_the_host_backend(plain_tree):
    # --quick: float32 and bfloat16, sum and avg (the full dtype x op matrix runs through the public API in
    # tests/custom/test_custom_gpu.py; `vranks_harness` without --quick runs it here too).
    res = plain_tree.run("--ranks=2,3,5,8", "--quick", timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " 0 failures" in res.stdout


def test_missing_peer_times_out(plain_tree):
    res = plain_tree.run("--missing-peer", timeout=120)
    assert res.returncode == 0 and "timed out as it must" in res.stdout, res.stdout + res.stderr
