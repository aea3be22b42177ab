"""Every code snippet of README.md runs as written: each ```python block is saved to a file and run the way its
first line says (`# run: torchrun --standalone --nproc-per-node 2 NAME.py`), else with `python NAME.py`; every
`python -m gpucoll...` command of the README's shell blocks runs too. Nothing is edited before running."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.DOTALL)
SHELL_COMMANDS = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", TEXT, re.DOTALL)
                  for line in block.splitlines() if line.startswith("python -m gpucoll")]

# Launcher variables of an enclosing job would describe the wrong processes.
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_",
         "OMPI_", "PMI_", "SLURM_", "GPUCOLL_")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _command(block: str, path: Path) -> list[str]:
    first = block.splitlines()[0]
    if not first.startswith("# run: "):
        return [sys.executable, str(path)]
    words = shlex.split(first[len("# run: "):])
    assert words[-1].endswith(".py"), f"the run line must end with the script's name: {first}"
    if words[0] == "torchrun":
        helpers.require("torch.distributed", "the snippet runs under torchrun")
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words[0] == "python":
        words[0] = sys.executable
    return [*words[:-1], str(path)]


def test_the_readme_has_the_snippets_this_test_runs():
    assert len(PYTHON_BLOCKS) >= 3 and len(SHELL_COMMANDS) >= 3


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet_runs_as_written(index, tmp_path):
    block = PYTHON_BLOCKS[index]
    if "torch" in block:
        helpers.require("torch", "the snippet uses torch")
    first = block.splitlines()[0]
    name = first.split()[-1] if first.startswith("# run: ") else f"snippet{index}.py"
    path = tmp_path / name
    path.write_text(block)
    proc = subprocess.run(_command(block, path), capture_output=True, text=True, timeout=180, env=_env(),
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
        f"README snippet {index} failed:\n{block}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("command", SHELL_COMMANDS)
def test_readme_command_runs(command, tmp_path):
    words = shlex.split(command)
    assert words[0] == "python"
    proc = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=120, env=_env(),
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip()
