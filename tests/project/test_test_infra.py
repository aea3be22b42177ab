"""The test suite's own guards (tests/conftest.py): under --require-deps, which .ci/run sets, a test outside the
gpu marker that skips for a missing package fails, and the skip summary has one line per reason."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

TESTS = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest

import helpers


def test_importorskip():
    pytest.importorskip("gpucoll_no_such_module")

def test_require():
    helpers.require("gpucoll_no_such_package.sub")

def test_require_for_a_stated_reason():
    helpers.require("gpucoll_no_such_package.sub", "what it is needed for")

@pytest.mark.parametrize("i", range(3))
def test_other_reason(i):
    pytest.skip("not a missing package")

@pytest.mark.gpu
def test_gpu_marked():
    helpers.require("gpucoll_no_such_package")

def test_passes():
    assert helpers.have("gpucoll_no_such_package.sub") is False and helpers.have("numpy")
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("gpucoll_no_such_module_at_import")

def test_never_runs():
    pass
'''


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "support/helpers.py"):
        shutil.copy(TESTS / name, tmp_path / Path(name).name)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env, check=False)


@pytest.mark.spawns
def test_missing_packages_skip_by_default_with_one_summary_line_per_reason(tmp_path):
    res = _run(tmp_path)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "1 passed" in out and "8 skipped" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert "SKIPPED [3] not a missing package" in lines, lines
    # one line for the package, whatever each test said it needed it for, whichever of its modules it imported
    # (.sub), and however it skipped (pytest.importorskip's "could not import ..." included)
    pkg = [ln for ln in lines if ln.split("] ", 1)[1].startswith("missing package: gpucoll_no_such_package (pip")]
    # 2 tests, and the gpu-marked one where a device lets it run (a GPU, or the emulated device)
    assert len(pkg) == 1 and pkg[0].startswith(("SKIPPED [2] ", "SKIPPED [3] ")), lines
    assert any(ln.startswith("SKIPPED [1] missing package: gpucoll_no_such_module (pip install") for ln in lines)
    assert any(ln.startswith("SKIPPED [1] missing package: gpucoll_no_such_module_at_import (") for ln in lines)
    assert len(lines) == len({ln.split("] ", 1)[1] for ln in lines}), "one line per reason"


@pytest.mark.spawns
def test_require_deps_fails_missing_package_skips_outside_the_gpu_marker(tmp_path):
    res = _run(tmp_path, "--require-deps")
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "FAILED test_sample.py::test_importorskip" in out and "FAILED test_sample.py::test_require" in out, out
    assert "test_gpu_marked" not in out.split("short test summary info")[-1], out  # stays a skip
    assert "SKIPPED [3] not a missing package" in out
    assert "module skipped for a missing package: test_module_skip.py" in out
    assert "FAILED test_sample.py::test_require_for_a_stated_reason" in out
    assert "3 failed, 1 passed" in out, out


@pytest.mark.spawns
def test_a_module_level_missing_package_alone_fails_the_session(tmp_path):
    res = _run(tmp_path, "--require-deps", "test_module_skip.py")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "module skipped for a missing package" in res.stdout


# -- what CI installs and runs ---------------------------------------------------------------------------------------
ROOT = TESTS.parent
_PIP_NAME = {"nvidia": "nvidia-nccl-cu13"}  # import name -> the package of the `test` extra that provides it


def _test_extra() -> list[str]:
    # (a regex, not tomllib: that needs Python 3.11 and gpucoll supports 3.9)
    line = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    return [re.split(r"[<>=!~\[; ]", req.strip().strip('"'), maxsplit=1)[0].lower() for req in line.split(",")]


def test_every_package_a_test_requires_is_in_the_test_extra_except_torch():
    """A package a test skips without must come with `pip install -e ".[test]"`, or CI (--require-deps) fails;
    torch is the exception, installed pinned before the extra (an unpinned torch pulls a CUDA build)."""
    pattern = re.compile(r"""(?:require|missing_reason|importorskip)\(\s*["']([\w.]+)["']""")
    wanted = set()
    gpu = helpers.gpu_test_files(TESTS)
    assert len(gpu) >= 10, gpu  # the scan itself works
    for path in TESTS.rglob("test_*.py"):
        if path not in gpu and path.name != Path(__file__).name:
            wanted |= {m.split(".")[0] for m in pattern.findall(path.read_text())}
    assert {"matplotlib", "tqdm", "mpi4py", "nvidia", "torch"} <= wanted, wanted  # the scan itself works
    extra = _test_extra()
    missing = sorted(m for m in wanted - {"torch"} if _PIP_NAME.get(m, m) not in extra)
    assert not missing, f"tests skip without {missing}, which the test extra {extra} does not install"
    assert "torch" not in extra


def test_ci_runs_the_readme_test_command_with_require_deps():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[test]" && python -m pytest -q'
    emulated = 'GPUCOLL_CUDA=emulate pip install -e ".[test]" && python -m pytest -m gpu'
    lines = [line.strip() for line in ci.splitlines()]
    assert command in readme and command in lines, "CI runs the README's test command as its own line"
    assert emulated in readme and emulated in lines, "CI runs the README's emulated-device command as its own line"
    gpu_check = next(line for line in lines if line.startswith("bash .ci/gpu "))
    assert "--emulated" in gpu_check and lines.index(gpu_check) > lines.index(emulated), \
        "then .ci/gpu on the emulated device, so that the GPU runner's check cannot rot"
    addopts = [line for line in lines if line.startswith("export PYTEST_ADDOPTS=")]
    assert len(addopts) == 1 and "--require-deps" in addopts[0].split("=", 1)[1].strip('"').split(), addopts
    assert lines.index(addopts[0]) < lines.index(command)
    assert ci.index('pip install -q "torch==2.13.0"') < ci.index(command) < ci.index(emulated)
