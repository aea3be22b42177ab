"""The emulated CUDA runtime's own behaviours (csrc/emulation/README.md), checked by a native program
(native/runtime_checks.cc) built from csrc/: memory and copy rules, kernels with real barriers and per-block shared
memory, parameters copied at launch, stream order and the legacy stream's implicit synchronisation, events and
timing, host functions, stream capture (fork/join, replays of kernels that need each other concurrently, and every
capture error gpucoll's code must respect), residency (blocks beyond the device's slots wait), CUDA IPC between
processes, and a forked child refused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


# The default shape; one block per SM; and the cap at sm_90's own 32, where the occupancy model alone decides.
@pytest.mark.parametrize("shape", [(), ("--sms=3", "--blocks_per_sm=1"), ("--sms=2", "--blocks_per_sm=32")])
def test_runtime_checks(plain_tree, shape):
    res = plain_tree.run(*shape, name="runtime_checks", timeout=300)
    lines = res.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert res.returncode == 0 and not failed, res.stdout[-4000:] + res.stderr[-4000:]
    assert sum(line.startswith("ok ") for line in lines) >= 10, res.stdout
