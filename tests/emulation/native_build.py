"""Builds tests/emulation/native/ (the emulated runtime's own checks and the virtual-ranks harness) with CMake, from
a private copy of this checkout's csrc/ that a check may mutate (the seeded-bug checks), and runs the results.
Used by tests/emulation/ and by ``python tests/emulation/seeded_bugs.py``. Needs cmake and a C++ compiler (ninja
when available), not the installed gpucoll.

A Tree is one copy of csrc/ with one build directory: after a mutation only the files that depend on the mutated
one are recompiled, so several checks share one full build.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "native"
CSRC = Path(__file__).resolve().parents[2] / "csrc"


def missing_tools() -> str | None:
    """Why the native checks cannot be built here, or None."""
    for tool in ("cmake", os.environ.get("CXX") or "c++"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


def no_aslr() -> list:
    """A prefix that runs a program with address-space randomisation off, where setarch can: ThreadSanitizer's
    shadow-memory layout does not survive the 32 random bits of recent kernels (vm.mmap_rnd_bits)."""
    setarch = shutil.which("setarch")
    return [setarch, platform.machine(), "-R"] if setarch else []


def tsan_problem() -> str | None:
    """Why ThreadSanitizer programs cannot be built and run here, or None."""
    why = missing_tools()
    if why:
        return why
    cxx = os.environ.get("CXX") or "c++"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        res = subprocess.run([cxx, "-fsanitize=thread", "-x", "c++", "-", "-o", str(exe)], input="int main(){}",
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return f"{cxx} cannot link with -fsanitize=thread: {res.stderr[-300:]}"
        for prefix in (no_aslr(), []):
            res = subprocess.run([*prefix, str(exe)], capture_output=True, text=True, check=False)
            if res.returncode == 0:
                return None
    return f"a ThreadSanitizer program does not run here: {res.stderr[-300:]}"


class BuildError(RuntimeError):
    pass


class Tree:
    """A copy of csrc/ under `root`/csrc, built in `root`/build."""

    def __init__(self, root: Path, tsan: bool = False):
        self.root = Path(root)
        self.src = self.root / "csrc"
        self.build_dir = self.root / "build"
        self.tsan = tsan
        self._defines = None
        # The targets built from the sources as they are now: a mutation (or its undoing) empties it. Per target,
        # because a build of one target leaves another's binary as it was (a runtime_checks build after a mutation
        # was undone once left vranks_harness mutated for the next test on the tree).
        self._fresh = set()
        if not self.src.exists():
            shutil.copytree(CSRC, self.src, ignore=shutil.ignore_patterns("python", "topo"))

    ALL_KERNELS = "one_shot;two_shot;ring;tree;compressed"

    def build(self, targets=("vranks_harness",), defines: str = "", kernels: str = ALL_KERNELS,
              timeout: float = 1200.0) -> None:
        """Configure (again when `defines` or `kernels` changed: test switches of the kernel sources, and which
        kernel files to build) and build `targets`. Raises BuildError with the compiler's output."""
        try:
            if self._defines != (defines, kernels):
                args = ["cmake", "-S", str(NATIVE), "-B", str(self.build_dir), f"-DGPUCOLL_SOURCE_DIR={self.src}",
                        f"-DGPUCOLL_TSAN={'ON' if self.tsan else 'OFF'}", f"-DGPUCOLL_EXTRA_DEFINES={defines}",
                        f"-DGPUCOLL_KERNELS={kernels}"]
                if shutil.which("ninja") and not (self.build_dir / "CMakeCache.txt").exists():
                    args.append("-GNinja")
                subprocess.run(args, check=True, capture_output=True, text=True, timeout=timeout)
                self._defines = (defines, kernels)
                self._fresh = set()
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
            subprocess.run(["cmake", "--build", str(self.build_dir), "--parallel", jobs, "--target", *targets],
                           check=True, capture_output=True, text=True, timeout=timeout)
            self._fresh.update(targets)
        except subprocess.CalledProcessError as e:
            raise BuildError(f"{' '.join(e.cmd[:4])}... failed:\n{e.stdout[-4000:]}\n{e.stderr[-4000:]}") from None

    def exe(self, name: str = "vranks_harness") -> Path:
        return self.build_dir / name

    def run(self, *args, name: str = "vranks_harness", timeout: float = 900.0, env=None):
        """Runs a program of the tree, rebuilding it first if the sources changed since it was built."""
        if name not in self._fresh:
            self.build((name,), *(self._defines or ("", self.ALL_KERNELS)))
        return run(self.exe(name), *args, timeout=timeout, env=env, prefix=no_aslr() if self.tsan else ())

    @contextlib.contextmanager
    def mutated(self, path: str, old: str, new: str):
        """`old` replaced by `new` (exactly once) in csrc/`path` for the duration; restored afterwards."""
        f = self.src / path
        text = f.read_text()
        if text.count(old) != 1:
            raise ValueError(f"{path}: the text to mutate occurs {text.count(old)} times (expected once): {old!r}")
        f.write_text(text.replace(old, new))
        self._fresh = set()
        try:
            yield
        finally:
            f.write_text(text)
            self._fresh = set()


def run(exe: Path, *args, timeout: float = 900.0, env=None, prefix=()) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([*prefix, str(exe), *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


# A small device keeps ThreadSanitizer's per-fiber state (about 0.8 MB per CUDA thread) bounded: 4 slots.
TSAN_DEVICE = ("--sms=2", "--bps=2")
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=0"}


def tsan_reports(res: subprocess.CompletedProcess) -> int:
    return res.stderr.count("WARNING: ThreadSanitizer")
