"""Test-session set-up shared by every test directory.

* Tests sit in one folder per feature (tests/host, tests/nccl, tests/torch_backend, ...); how a test runs is a
  marker: `gpu`, `spawns` (it starts processes: ranks, CLIs), `slow` (tens of seconds). What several features'
  tests share is in tests/support/, which goes on sys.path, so test modules can `import helpers`. gpucoll.spawn
  starts workers with multiprocessing's "spawn" method, which ships the parent's sys.path to the children:
  functions defined at module level in a test file (and helpers) are importable there too.
* A test outside the gpu marker that starts a process without the `spawns` marker fails (the marker cannot drift
  from what the test does): subprocess, multiprocessing and os.fork are counted in this process while each test
  runs.
* `@pytest.mark.gpu` tests (the marker is registered in pyproject.toml) are skipped with the reason when no CUDA
  GPU is usable. The decision uses gpucoll._C.cuda_probe() and never imports torch or CuPy, which would be slow
  and could initialise CUDA in the pytest process before workers fork or spawn.
* `--require-deps` (.ci/run sets it through PYTEST_ADDOPTS) turns a skip for a missing package into a failure,
  for every test outside the gpu marker: on CI, where `pip install -e ".[test]"` and the pinned CPU torch are
  installed, such a skip means the extra or the environment lost a package and the tests it guards silently stopped
  running. Missing-package skips are recognised by their reason: tests skip through helpers.require /
  helpers.missing_reason (reason "missing package: ..."), and pytest.importorskip's own "could not import" counts
  too. So does a `netns` test's skip on a machine that cannot make network namespaces: CI can.
* `--deadline EPOCH` skips every test that would start later, with a reason .ci/gpu counts as trimmed.
* The `-r s` summary is folded by reason: one line per reason with its count, instead of pytest's one line per
  test location.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

_SUPPORT_DIR = str(Path(__file__).resolve().parent / "support")
if _SUPPORT_DIR not in sys.path:
    sys.path.insert(0, _SUPPORT_DIR)

from helpers import MISSING, missing_reason  # tests/support had to be put on sys.path first

# -- the emulated device's stream jitter ----------------------------------------------------------------------------
# On the emulated device every stream operation starts after a delay of up to GPUCOLL_EMU_JITTER_US drawn from
# GPUCOLL_EMU_SEED (csrc/emulation), so streams interleave differently from run to run. The suite turns it on unless
# the caller set it, with a fresh seed per session, named in the header (GPUCOLL_EMU_SEED=<seed> replays a run). Set
# here, before anything imports gpucoll, so every process of the session (xdist workers, ranks) has the same values.
# 50 us cost 3% of the emulated custom and one-call tests' time (257 s against 248 s, 2026-11-28).
# The same seed draws the first thread of each turn of a block's threads (GPUCOLL_EMU_SHUFFLE_THREADS), so that a
# missing __syncthreads fails the functional tests, not only ThreadSanitizer's.
JITTER_DEFAULT_US = "50"
os.environ.setdefault("GPUCOLL_EMU_JITTER_US", JITTER_DEFAULT_US)
os.environ.setdefault("GPUCOLL_EMU_SHUFFLE_THREADS", "1")
os.environ.setdefault("GPUCOLL_EMU_SEED", str(int.from_bytes(os.urandom(4), "little")))


# The host fence (GPUCOLL_EMU_HOST_FENCE: device memory closed to the process while the device is idle, so that host
# code touching it segfaults as on a GPU) costs an mprotect over every mapped page at each idle/busy transition: the
# whole emulated suite took 667 s with it everywhere against 558 s with it on this sample (2026-11-28). CI runs it on a sample, the ranks that
# the NCCL and group tests spawn (the NCCL stand-in's bootstrap is where it found host code in device memory), and
# --thorough everywhere. runtime_checks (tests/emulation/native) always has it.
_HOST_FENCE_SAMPLE = ("nccl", "groups")


@pytest.fixture(autouse=True)
def _host_fence_sample(request, monkeypatch):
    if Path(str(request.node.path)).parent.name in _HOST_FENCE_SAMPLE and "GPUCOLL_EMU_HOST_FENCE" not in os.environ:
        monkeypatch.setenv("GPUCOLL_EMU_HOST_FENCE", "1")  # the ranks it spawns read it when they import gpucoll


def pytest_report_header(config):
    return (f"emulated device (GPUCOLL_CUDA=emulate builds): stream jitter up to {os.environ['GPUCOLL_EMU_JITTER_US']}"
            f" us, thread order {'seeded' if os.environ['GPUCOLL_EMU_SHUFFLE_THREADS'] not in ('0', '') else 'index'},"
            f" GPUCOLL_EMU_SEED={os.environ['GPUCOLL_EMU_SEED']} (set it to replay this run)")

# -- the spawns marker, enforced ----------------------------------------------------------------------------------
# Processes this pytest process has started: Python interpreters, launchers and shells through subprocess (gpucoll's
# CLIs, torchrun, mpiexec, scripts), multiprocessing workers (gpucoll.spawn) and bare forks. Tool probes (a
# compiler, fc-list under matplotlib) are not what the marker is about and are not counted.
_STARTED = [0]
_LAUNCHERS = ("python", "torchrun", "mpiexec", "mpirun", "bash", "sh", "gpucoll-")


def _starts_a_job(args) -> bool:
    argv0 = args if isinstance(args, (str, bytes, os.PathLike)) else (args[0] if args else "")
    name = os.path.basename(os.fsdecode(argv0).split()[0]) if argv0 else ""
    return name.startswith(_LAUNCHERS) or os.fsdecode(argv0) == sys.executable


def _counting(fn, when=None):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            _STARTED[0] += 1
        return fn(*args, **kwargs)
    return counted


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__, lambda self, args, *a, **k: _starts_a_job(args))
multiprocessing.process.BaseProcess.start = _counting(multiprocessing.process.BaseProcess.start)
os.fork = _counting(os.fork)

_IMPORTORSKIP = "could not import "  # the reason pytest.importorskip gives
_OVER_BUDGET = "not started: past the time budget of this run"  # .ci/gpu counts these as trimmed
# A machine that cannot make network namespaces skips the multi-node tests; CI can, so --require-deps fails them.
_NO_NETNS = "cannot make network namespaces"


def pytest_addoption(parser):
    parser.addoption("--require-deps", action="store_true",
                     help="fail, instead of skip, any test outside the gpu marker that skips for a missing package "
                          "(set by .ci/run)")
    parser.addoption("--deadline", type=float, default=None, metavar="EPOCH",
                     help="skip every test that would start after this time (seconds since the epoch), with a "
                          "reason saying so: how .ci/gpu keeps a step inside its share of the budget")
    parser.addoption("--thorough", action="store_true",
                     help="run the emulator's costly modes in full instead of CI's sample (ThreadSanitizer at every "
                          "P up to 8 on every dtype; seeded bugs over 10 seeds): the nightly-style target, "
                          "docs/testing.md")


def pytest_runtest_setup(item):
    deadline = item.config.getoption("deadline")
    if deadline is not None and time.time() > deadline:
        pytest.skip(f"{_OVER_BUDGET} (--deadline)")
    if item.get_closest_marker("netns") is not None:
        from gpucoll.testing import cluster  # here: gpucoll must not be imported before the environment is set

        if (why := cluster.unavailable()) is not None:
            pytest.skip(f"{_NO_NETNS}: {why}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _missing_package(reason: str) -> bool:
    return reason.startswith((MISSING, _IMPORTORSKIP, _NO_NETNS))


def _missing_under_require_deps(report, config, gpu: bool) -> str | None:
    """The reason, when `report` is a skip for a missing package that --require-deps forbids; else None."""
    if not report.skipped or gpu or not config.getoption("require_deps"):
        return None
    reason = _skip_reason(report)
    return reason if _missing_package(reason) else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist, `-n N` alone hands whole modules to workers (as --dist loadfile does): a module's ranks,
    started once by its module-scoped fixtures, then serve all its tests, where spreading its tests over workers
    would start them once per worker. An explicit --dist is obeyed."""
    if config.getoption("dist") == "load" and "--dist" not in " ".join(config.invocation_params.args):
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._gpucoll_started = _STARTED[0]
    yield


def _unmarked_start(item, report) -> bool:
    """Whether this setup or call started a process although the test lacks the spawns marker (reported once)."""
    if report.when == "teardown" or report.failed or _STARTED[0] == getattr(item, "_gpucoll_started", _STARTED[0]):
        return False
    item._gpucoll_started = _STARTED[0]
    # GPU tests take other paths on a GPU than on the emulated device, where CI runs them: not enforced there.
    return item.get_closest_marker("spawns") is None and item.get_closest_marker("gpu") is None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _unmarked_start(item, report):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a process in its {report.when} without @pytest.mark.spawns "
                           "(tests/conftest.py): mark the test or its module (pytestmark)")
        return
    reason = _missing_under_require_deps(report, item.config, item.get_closest_marker("gpu") is not None)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = f"skipped for a missing package, which --require-deps (.ci/run) forbids: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level importorskip. Failing the collection would interrupt the whole session; the module stays
    # skipped and the session fails at the end instead (pytest_sessionfinish).
    outcome = yield
    reason = _missing_under_require_deps(outcome.get_result(), collector.config, gpu=False)
    if reason is not None:
        collector.config._gpucoll_missing_modules.append(f"{collector.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if session.config._gpucoll_missing_modules and session.exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if config.getoption("thorough"):
        os.environ.setdefault("GPUCOLL_EMU_HOST_FENCE", "1")  # before xdist's workers or any rank import gpucoll
    config._gpucoll_missing_modules = []
    # Take the skips out of pytest's own short summary; pytest_terminal_summary prints them folded by reason.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and "s" in reporter.reportchars:
        reporter.reportchars = reporter.reportchars.replace("s", "")
        config._gpucoll_fold_skips = True


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in getattr(config, "_gpucoll_missing_modules", []):
        terminalreporter.write_line(f"FAILED (--require-deps) module skipped for a missing package: {line}", red=True)
    skipped = terminalreporter.stats.get("skipped", []) if getattr(config, "_gpucoll_fold_skips", False) else []
    if not skipped:
        return
    counts = Counter(_folded(_skip_reason(rep)) for rep in skipped)
    terminalreporter.write_sep("=", "skipped tests by reason")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"SKIPPED [{n}] {reason}")


def _folded(reason: str) -> str:
    """A missing package is one reason whatever the test says it needed it for (the part after "; "), whichever
    of its modules it imported (torch.distributed is torch), and however it skipped (pytest.importorskip's own
    "could not import 'torch': ..." included)."""
    if reason.startswith(_IMPORTORSKIP) and "'" in reason:
        return missing_reason(reason.split("'")[1].split(".")[0])
    if reason.startswith(MISSING):
        module = reason[len(MISSING) + 2:].split(" ")[0]
        return missing_reason(module.split(".")[0])
    return reason


def _gpu_unusable_reason():
    """None when a CUDA GPU is usable, else why not (computed once per session)."""
    try:
        from gpucoll import _C
    except Exception as exc:  # noqa: BLE001 - an unbuilt extension is a reason to skip, not to crash collection
        return f"gpucoll._C cannot be imported ({type(exc).__name__}: {exc})"
    probe = getattr(_C, "cuda_probe", None)
    if probe is None:
        return "gpucoll._C has no cuda_probe(): cannot tell whether a CUDA GPU is usable"
    try:
        info = probe()
    except Exception as exc:  # noqa: BLE001
        return f"gpucoll._C.cuda_probe() failed: {type(exc).__name__}: {exc}"
    try:
        count = int(info.get("device_count", 0) or 0)
    except (AttributeError, TypeError, ValueError):
        return f"gpucoll._C.cuda_probe() returned an unexpected value: {info!r}"
    if count < 1:
        why = info.get("reason") or info.get("runtime_reason") or "device_count is 0"
        return f"no usable CUDA GPU: {why}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


# -- fixtures shared by several features' tests ------------------------------------------------------------------
@pytest.fixture
def store(monkeypatch):
    """A TCPStore server on a free loopback port (the rendezvous store the backends bootstrap through); the test's
    environment holds its job secret, for the clients the test makes."""
    from gpucoll.bootstrap.store import TCPStore, new_secret

    monkeypatch.setenv("GPUCOLL_STORE_SECRET", new_secret())
    s = TCPStore("127.0.0.1", 0, is_server=True, timeout=10.0)
    yield s
    s.close()


@pytest.fixture
def no_selection_env(monkeypatch):
    """No GPUCOLL_* variable that steers the choice of algorithm or topology leaks in from the caller's shell."""
    for name in ("GPUCOLL_ALGO", "GPUCOLL_TUNING_FILE", "GPUCOLL_TOPO_FILE", "GPUCOLL_TOPO_DUMP_FILE"):
        monkeypatch.delenv(name, raising=False)
