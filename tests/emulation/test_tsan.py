"""ThreadSanitizer on the custom kernels' flag protocol: the virtual-ranks harness (native/vranks_harness.cc) built
with -fsanitize=thread, P ranks in one process on the emulated device, where every CUDA thread is a fiber TSan
knows about and __syncthreads is a release/acquire barrier among a block's threads. The kernels' PTX primitives run
as C++ atomics with the same orders (backends/custom/kernels/sync_primitives.cuh), so TSan checks the protocol against the memory
model the PTX promises.

* The real protocol: no report, through every kernel, multi-block calls, pieces, registered and in-place inputs,
  and the timeout path (a peer that never arrives): P = 2 and 3 on float32 and P = 8 on bfloat16 in CI, every P
  from 2 to 8 on every dtype with --thorough.
* The check has teeth: the same build with the flags' release store weakened to relaxed
  (GPUCOLL_EMU_TEST_WEAK_RELEASE, a test-only switch) must be reported: peers then read staged data that nothing
  orders after its writes."""

from __future__ import annotations

import pytest
from native_build import TSAN_DEVICE, TSAN_ENV, tsan_reports

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


# What CI runs (about 45 s on 2 cores) and what --thorough runs (about 8 minutes): every P up to 8 on every dtype.
# P = 8 needs 8 co-resident blocks, hence 4 SMs x 2.
SAMPLE = (("--ranks=2,3", *TSAN_DEVICE), ("--ranks=8", "--dtypes=bfloat16", "--sms=4", "--bps=2"))
THOROUGH = (("--ranks=2,3", "--dtypes=all", *TSAN_DEVICE), ("--ranks=4,5,6,7,8", "--dtypes=all", "--sms=4", "--bps=2"))


def test_real_protocol_has_no_data_race(tsan_tree, request):
    tsan_tree.build()
    for args in THOROUGH if request.config.getoption("--thorough") else SAMPLE:
        res = tsan_tree.run("--tsan", *args, env=TSAN_ENV, timeout=1800)
        assert tsan_reports(res) == 0, f"{args}: " + res.stderr[-6000:]
        assert res.returncode == 0 and " 0 failures" in res.stdout, f"{args}: " + res.stdout[-2000:]
    res = tsan_tree.run("--missing-peer", *TSAN_DEVICE, timeout=300, env=TSAN_ENV)
    assert tsan_reports(res) == 0, res.stderr[-6000:]
    assert res.returncode == 0 and "timed out as it must" in res.stdout, res.stdout


def test_a_relaxed_release_is_reported(tsan_tree):
    # Only two-shot is built with the switch (one kernel file to recompile); the next user of the tree rebuilds
    # what it needs.
    tsan_tree.build(defines="GPUCOLL_EMU_TEST_WEAK_RELEASE", kernels="two_shot")
    res = tsan_tree.run("--ranks=2", "--tsan", "--algos=twoshot", *TSAN_DEVICE, env=TSAN_ENV)
    assert tsan_reports(res) >= 1 and "data race" in res.stderr, res.stdout[-2000:] + res.stderr[-2000:]

