"""`python -m gpucoll info` and the subcommand dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpucoll import config


def gpucoll_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpucoll", *args], check=False, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.spawns
def test_info_prints_every_variable_and_the_nccl_line():
    proc = gpucoll_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    names = [v["name"] for v in config.variables()]
    assert names and all(n.startswith("GPUCOLL_") for n in names)
    for name in names:
        assert name in out, f"{name} missing from `gpucoll info`"
    lines = out.splitlines()
    assert lines[0].startswith("gpucoll ")
    nccl = [line for line in lines if line.startswith("NCCL: ")]
    assert len(nccl) == 1
    if "not available" in nccl[0]:
        assert any("pip install" in line for line in lines)
    for prefix in ("build: ", "CUDA runtime: ", "CUDA driver: ", "CUDA devices: ", "NVML: ", "packages: "):
        assert any(line.startswith(prefix) for line in lines), f"no {prefix!r} line"


@pytest.mark.spawns
def test_info_json_parses():
    proc = gpucoll_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    for key in ("gpucoll", "build", "cuda", "nccl", "nvml", "config", "packages"):
        assert key in info
    assert isinstance(info["nccl"]["loaded"], bool)
    assert isinstance(info["cuda"]["device_count"], int)
    assert isinstance(info["build"]["cuda_built"], bool)
    assert {v["name"] for v in info["config"]} == {v["name"] for v in config.variables()}


@pytest.mark.spawns
def test_info_does_not_import_torch_or_cupy():
    code = (
        "import sys, runpy; sys.argv = ['gpucoll', 'info']\n"
        "try:\n    runpy.run_module('gpucoll', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED []"


@pytest.mark.spawns
def test_unknown_command_and_usage():
    proc = gpucoll_cli("no-such-command")
    assert proc.returncode == 2
    assert "unknown command" in proc.stderr and "info" in proc.stderr
    proc = gpucoll_cli("--help")
    assert proc.returncode == 0 and "info" in proc.stdout


@pytest.mark.spawns
def test_usage_lists_every_tool_and_each_runs_through_the_dispatcher(capsys):
    """`python -m gpucoll --help` listed info only: every console script gpucoll installs, and explain, are
    commands, each named with the script it also is."""
    import re
    from pathlib import Path

    from gpucoll import __main__ as cli

    # pyproject.toml's [project.scripts] (tomllib is Python 3.11+; gpucoll supports 3.9)
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section, re.MULTILINE))
    assert scripts and all(s.startswith("gpucoll-") for s in scripts), scripts
    proc = gpucoll_cli("--help")
    assert proc.returncode == 0
    listed = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    for script, target in scripts.items():
        command = script.removeprefix("gpucoll-")
        assert command in listed and f"(also: {script})" in listed[command], (script, proc.stdout)
        assert cli.COMMANDS[command][0] == target.split(":")[0]
    assert "python -m gpucoll.algo explain" in listed["explain"]
    assert cli.main(["explain", "sendrecv", "--nranks", "2"]) == 0
    assert "no algorithm to choose" in capsys.readouterr().out
    assert cli.main(["bench", "all_reduce", "--check"]) == 2  # gpucoll-bench's own parsing and exit status
    assert "-c/--check takes a number" in capsys.readouterr().err
