"""Native calls that wait for the device let other Python threads run, destructors included: cudaFree waits for
every stream, and a DeviceArray dropped while a collective is in flight used to hold the GIL for that whole wait.
Rank 0's rendezvous store and the NCCL watchdog are Python threads, so the peers that collective waited for (blocked
on the store) never came and nothing timed out: a 3-rank split test hung in CI that way (2026-11-27). Here the peer
is a virtual rank that a Python thread launches while the main thread frees memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpucoll._native import _C
from gpucoll.backends import custom
from gpucoll.testing import DeviceArray, virtual_ranks

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]

N = 4096


def test_freeing_device_memory_lets_the_peer_thread_launch():
    custom.check_usable("this test")
    with virtual_ranks(2, timeout=20.0) as vr:
        xs = [DeviceArray.from_host((np.arange(N) % 7 + 10 * (r + 1)).astype(np.float32)) for r in range(2)]
        algo = custom.resolve_algo("auto", xs[0].nbytes, 2)
        dtype, op = _C.DType.float32, _C.RedOp.sum
        launched = threading.Event()

        def rank1():
            time.sleep(0.3)  # the main thread is inside cudaFree by now
            vr.comms[1].all_reduce(xs[1].ptr, xs[1].ptr, N, dtype, op, algo, vr.streams[1])
            launched.set()

        # Rank 0's kernel spins until rank 1's arrives; rank 1's is launched by the thread.
        vr.comms[0].all_reduce(xs[0].ptr, xs[0].ptr, N, dtype, op, algo, vr.streams[0])
        t = threading.Thread(target=rank1, daemon=True)
        t.start()
        scratch = DeviceArray(1 << 10, "float32")
        t0 = time.monotonic()
        del scratch  # cudaFree: waits for rank 0's kernel, hence for the thread
        freed_after = time.monotonic() - t0
        t.join(timeout=30.0)
        assert launched.is_set(), "the peer thread never ran while the main thread freed device memory"
        vr.synchronize()  # CollectiveTimeout if rank 0's kernel gave up waiting
        want = sum((np.arange(N) % 7 + 10 * (r + 1)).astype(np.float32) for r in range(2))
        for r in range(2):
            np.testing.assert_array_equal(xs[r].to_host(), want)
        assert freed_after < 15.0, f"freeing took {freed_after:.1f} s: it waited for the kernel's timeout"
