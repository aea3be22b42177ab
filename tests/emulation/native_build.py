"""Builds tests/emulation/native/ (the emulated runtime's own checks and the virtual-ranks harness) with CMake, from
this checkout's csrc/ or from a mutated copy of it, and runs the results. Used by the emulation tests and by
``python tests/emulation/seeded_bugs.py``. Needs cmake and a C++ compiler (ninja when available), not the
installed gpucoll."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "native"
CSRC = Path(__file__).resolve().parents[2] / "csrc"


def missing_tools() -> str | None:
    """Why the native checks cannot be built here, or None."""
    for tool in ("cmake", os.environ.get("CXX") or "c++"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


def build(build_dir: Path, targets, source_dir: Path = CSRC, tsan: bool = False, defines: str = "",
          timeout: float = 900.0) -> Path:
    """Configure (once per build_dir) and build `targets`; returns build_dir. Raises CalledProcessError with the
    compiler's output on failure."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / "CMakeCache.txt").exists():
        args = ["cmake", "-S", str(NATIVE), "-B", str(build_dir), f"-DGPUCOLL_SOURCE_DIR={source_dir}",
                f"-DGPUCOLL_TSAN={'ON' if tsan else 'OFF'}", f"-DGPUCOLL_EXTRA_DEFINES={defines}"]
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.run(args, check=True, capture_output=True, text=True, timeout=timeout)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs, "--target", *targets], check=True,
                   capture_output=True, text=True, timeout=timeout)
    return build_dir


def run(exe: Path, *args, timeout: float = 600.0, env=None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([str(exe), *map(str, args)], check=False, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
