"""The emulated CUDA runtime's own behaviours (csrc/emulation/README.md), checked by a native program
(native/runtime_checks.cc) built here from csrc/ with CMake: memory and copy rules, kernels with real barriers
and per-block shared memory, parameters copied at launch, stream order and the legacy stream's implicit
synchronisation, events and timing, host functions, stream capture (fork/join, replays of kernels that need each
other concurrently, and every capture error gpucoll's code must respect), residency (blocks beyond the device's
slots wait), CUDA IPC between processes, and a forked child refused."""

from __future__ import annotations

import subprocess

import native_build
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    why = native_build.missing_tools()
    if why:
        pytest.skip(why)
    try:
        out = native_build.build(tmp_path_factory.mktemp("emu-native"), ["runtime_checks"])
    except subprocess.CalledProcessError as e:
        pytest.fail(f"building the runtime checks failed:\n{e.stdout[-4000:]}\n{e.stderr[-4000:]}")
    return out / "runtime_checks"


@pytest.mark.parametrize("shape", [{}, {"sms": "3", "blocks_per_sm": "1"}])
def test_runtime_checks(checks, shape):
    # The checks read the device shape through gpucoll_emu_get_config; the harness sets it from its arguments.
    args = [f"--{k}={v}" for k, v in shape.items()]
    res = native_build.run(checks, *args, timeout=300)
    lines = res.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert res.returncode == 0 and not failed, res.stdout[-4000:] + res.stderr[-4000:]
    assert sum(line.startswith("ok ") for line in lines) >= 10, res.stdout
