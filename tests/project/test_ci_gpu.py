""".ci/gpu, the GPU runner's check, where no GPU is: the one-line exit on a machine without one, the command line,
the budget's trimming, and summary.json against its schema. (.ci/run runs the whole script on the emulated
device; a GPU runs it for real.)"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

CI = Path(__file__).resolve().parents[2] / ".ci"
sys.path.insert(0, str(CI))

import gpu_check
import gpu_summary


def _run(args, tmp_path, path=None):
    env = dict(os.environ, PATH=path if path is not None else os.environ.get("PATH", ""))
    return subprocess.run(["bash", str(CI / "gpu"), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)


@pytest.mark.spawns
def test_no_gpu_exits_2_with_one_line(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with python3 and no nvidia-smi
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    res = _run([], tmp_path, path=f"{bindir}:/usr/bin:/bin")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(".ci/gpu: no NVIDIA GPU here"), lines
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "no-gpu" and summary["exit_code"] == 2
    assert gpu_summary.validate(summary) == []


@pytest.mark.spawns
@pytest.mark.parametrize("bad", [["--phase", "bogus"], ["--phase", ""], ["--budget", "0"]])
def test_bad_arguments_are_refused(bad, tmp_path):
    res = _run(bad, tmp_path)
    assert res.returncode == 2 and ".ci/gpu: error:" in res.stderr, res.stderr


def test_phases_parse():
    assert gpu_check.parse(["--phase", "test,bench"]).phases == ("test", "bench")
    assert gpu_check.parse([]).phases == gpu_check.PHASES
    assert gpu_check.parse(["--phase", "all"]).budget == gpu_check.DEFAULT_BUDGET


def test_a_small_budget_trims_the_lowest_priority_steps_first(tmp_path, monkeypatch):
    args = gpu_check.parse(["--emulated", "--phase", "test", "--out", str(tmp_path), "--budget", "60"])
    check = gpu_check.Check(args)
    clock = [1000.0]
    monkeypatch.setattr(gpu_check.time, "time", lambda: clock[0])
    check.t0, check.end = clock[0], clock[0] + 60
    ran = []

    def fake_run(cmd, *a, **k):  # every step uses its whole share
        ran.append(cmd)
        clock[0] = float(next(c for c in cmd if str(c).startswith("--deadline=")).split("=")[1])
        return 0, 1.0, ""

    monkeypatch.setattr(gpu_check, "run", fake_run)
    check.test()
    steps = check.summary["phases"]["test"]["steps"]
    assert [s["name"] for s in steps] == ["custom", "nccl", "torch", "cupy", "late"]
    status = [s["status"] for s in steps]
    # 60 s holds the first steps' minimum shares, not all of them: the tail goes.
    assert status[0] == "passed" and status[-1] == "trimmed", status
    assert status == sorted(status, key=lambda s: s == "trimmed"), status  # nothing runs after a trimmed step
    assert all(any(f"test step {s['name']}:" in t for t in check.summary["trimmed"])
               for s in steps if s["status"] == "trimmed")
    assert all("--deadline=" in " ".join(map(str, c)) for c in ran)


def test_share_splits_the_surplus_by_weight_and_drops_the_lowest_priority_first():
    # Everything fits: the first gets its minimum plus its weight's part of the surplus, not all of it.
    keep, mine = gpu_check.share(200.0, [30, 25, 40], [300, 100, 100])
    assert keep == 3 and mine == 30 + (200 - 95) * 300 / 500
    # Too little for all: the last (lowest priority) goes before anything earlier loses its minimum.
    keep, mine = gpu_check.share(60.0, [30, 25, 40], [300, 100, 100])
    assert keep == 2 and mine == 30 + 5 * 300 / 400
    assert gpu_check.share(10.0, [30, 25], [1, 1]) == (0, 10.0)


def test_a_step_that_overruns_costs_the_lowest_priority_not_the_next(tmp_path, monkeypatch):
    # The 2026-11-28 H200 run: the custom kernels' step ran to its deadline plus the tests in flight, and the NCCL
    # step right after it was trimmed while the later, lower-priority ones ran. Now the overrun lands on the tail.
    args = gpu_check.parse(["--phase", "test,sanitize,bench", "--out", str(tmp_path), "--budget", "300"])
    check = gpu_check.Check(args)
    clock = [1000.0]
    monkeypatch.setattr(gpu_check.time, "time", lambda: clock[0])
    check.t0, check.end = clock[0], clock[0] + 300
    ran = []

    def fake_run(cmd, log, timeout, env=None, title=""):
        step = title.split()[2]
        deadline = float(next(c for c in cmd if str(c).startswith("--deadline=")).split("=")[1])
        ran.append((step, deadline - clock[0]))
        clock[0] = deadline + (60 if step == "custom" else 0)  # custom overruns its deadline by a minute
        return 0, 1.0, ""

    monkeypatch.setattr(gpu_check, "run", fake_run)
    check.test()
    steps = {s["name"]: s for s in check.summary["phases"]["test"]["steps"]}
    assert steps["nccl"]["status"] == "passed", steps["nccl"]
    names = [n for n, _ in ran]
    assert names[:2] == ["custom", "nccl"], ran
    assert ran[0][1] < 300 - sum(s[3] for s in gpu_check._steps(False)[1:]), "custom took every surplus second"
    # nothing runs after a trimmed step, and the tail phases were planned for: what is left covers their minimums
    status = [s["status"] for s in check.summary["phases"]["test"]["steps"]]
    assert status == sorted(status, key=lambda s: s == "trimmed"), status


def test_every_gpu_test_file_belongs_to_a_step():
    """Each file of GPU tests (the gpu marker, in any feature's folder) is named by a step or swept up by the last
    step's run over tests/, whose --ignore list leaves out exactly the named files (and tests/emulation, the
    emulator's CPU checks, which .ci/run runs)."""
    gpu_files = {str(p.relative_to(CI.parent)) for p in helpers.gpu_test_files(CI.parent / "tests")
                 if p.parent.name != "emulation"}
    assert len(gpu_files) >= 10, gpu_files  # the scan itself works
    runs = [r for _, _, runs, _, _ in gpu_check._steps(False) for r in runs]
    named = {f for files, _ in runs for f in files if f.endswith(".py") and not f.startswith("--")}
    sweeps = [files for files, _ in runs if "tests/" in files]
    assert len(sweeps) == 1, sweeps
    ignored = {a.split("=", 1)[1] for a in sweeps[0] if a.startswith("--ignore=")}
    assert ignored == named | {"tests/emulation"}, ignored ^ (named | {"tests/emulation"})
    assert gpu_files - named, "a file no step names is still swept up (e.g. test_groups_gpu.py)"
    assert named <= gpu_files, named - gpu_files  # a step naming a file that does not exist runs nothing


def _sample() -> dict:
    counts = {"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "trimmed": 0}
    return {
        "schema": gpu_summary.SCHEMA_ID, "mode": "gpu", "status": "passed", "exit_code": 0, "started": "x",
        "duration_s": 1.0, "budget_s": 540, "phases_requested": ["build", "test"],
        "machine": {"python": "3.12", "cpus": 16, "gpus": [{"name": "H100", "driver": "580", "compute_capability": "9.0"}],
                    "nccl": "2.28.9"},
        "phases": {"build": {"status": "passed", "seconds": 28.0},
                   "test": {"status": "passed", "seconds": 9.0, "counts": counts, "failures": [],
                            "skip_reasons": [{"reason": "r", "count": 1}],
                            "steps": [{"name": "custom", "title": "t", "status": "passed", "seconds": 9.0,
                                       "counts": counts}]}},
        "trimmed": [], "files": ["summary.json", "junit.xml"],
    }


def test_schema_accepts_a_summary_and_names_what_breaks_it():
    assert gpu_summary.validate(_sample()) == []
    for path, value, expect in [(("status",), "ok", "summary.status"),
                                (("phases", "test", "counts", "failed"), -1, "summary.phases.test.counts.failed"),
                                (("phases", "test", "steps", 0, "name"), "misc", "summary.phases.test.steps[0].name"),
                                (("files",), [f"f{i}" for i in range(9)], "at most 8"),
                                (("machine", "cpus"), "16", "summary.machine.cpus")]:
        broken = copy.deepcopy(_sample())
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        found = gpu_summary.validate(broken)
        assert any(expect in f for f in found), (path, found)
    missing = copy.deepcopy(_sample())
    del missing["phases"]["test"]["failures"]
    assert any("missing 'failures'" in f for f in gpu_summary.validate(missing))


def test_mps_daemon_of_its_own_is_started_for_the_tests_and_stopped(tmp_path, monkeypatch):
    # A stand-in nvidia-cuda-mps-control: -d makes the control pipe, "quit" on stdin removes it (as the real one's
    # server does once its clients are gone).
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ctl = bindir / "nvidia-cuda-mps-control"
    ctl.write_text('#!/bin/sh\nif [ "$1" = -d ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi\n'
                   'read cmd; [ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"\n')
    ctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))  # no daemon of the machine's own
    check = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path / "out")]))
    check.mps_start("test")
    assert not check.mps_env  # by default only the figures run under it (see .ci/gpu_check.py)
    check.mps_start("bench")
    env = check.env()
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe != tmp_path / "none" and (pipe / "control").exists(), check.summary["machine"]
    assert check.summary["machine"]["mps"] == "a daemon of this run's own (figures)"
    check.mps_stop()
    assert not (pipe / "control").exists() and check.env()["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "none")
    # one already running is used as it is, and --mps off starts none
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "control").touch()
    other = gpu_check.Check(gpu_check.parse(["--mps", "all", "--out", str(tmp_path / "o2")]))
    other.mps_start("test")
    assert not other.mps_env and other.summary["machine"]["mps"].startswith("not used: a daemon of the machine")
    off = gpu_check.Check(gpu_check.parse(["--mps", "off", "--out", str(tmp_path / "o3")]))
    off.mps_start("bench")
    assert not off.mps_env and "mps" not in off.summary["machine"]
