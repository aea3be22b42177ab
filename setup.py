"""Build gpucoll: setuptools drives CMake (a CMakeExtension/CMakeBuild pair) to build gpucoll._C.

Build-time variables (also listed by `python -m gpucoll info`):
  GPUCOLL_CUDA=auto|on|off   auto builds the CUDA sources when nvcc is found; on without nvcc is an error.
  GPUCOLL_CUDA_ARCHS="80;90" CUDA architectures; default: the local GPU's when one is present, else 80;90.
  CMAKE_ARGS                 extra arguments for CMake (e.g. -DGPUCOLL_WERROR=ON, as CI does).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _version():
    text = (ROOT / "gpucoll" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def _find_nvcc():
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc")):
        if candidate and Path(candidate).exists():
            return candidate
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _local_gpu_archs():
    """Compute capabilities of the GPUs on this machine, e.g. ['90'], or [] when none is visible."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})


class CMakeExtension(Extension):
    def __init__(self, name, sourcedir=""):
        super().__init__(name, sources=[])
        self.sourcedir = str(Path(sourcedir).resolve())


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        mode = os.environ.get("GPUCOLL_CUDA", "auto").strip().lower() or "auto"
        if mode not in ("auto", "on", "off"):
            raise SystemExit(f"GPUCOLL_CUDA={mode!r}: expected auto, on or off")
        nvcc = _find_nvcc() if mode != "off" else None
        if mode == "on" and nvcc is None:
            raise SystemExit("GPUCOLL_CUDA=on but nvcc was not found (looked at CUDACXX, PATH, CUDA_HOME, "
                             "/usr/local/cuda). Install the CUDA toolkit or build with GPUCOLL_CUDA=off.")
        import pybind11

        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DGPUCOLL_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DGPUCOLL_VERSION={_version()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if nvcc is None:
            args.append("-DGPUCOLL_CUDA=off")
        else:
            archs = os.environ.get("GPUCOLL_CUDA_ARCHS", "").strip() or ";".join(_local_gpu_archs()) or "80;90"
            args += [f"-DGPUCOLL_CUDA={mode}", f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        # Switching CUDA on/off changes the cached compiler: start that configuration from scratch.
        stamp = build_temp / "gpucoll-config.txt"
        config_key = "\n".join(args)
        if stamp.exists() and stamp.read_text() != config_key:
            shutil.rmtree(build_temp)
            build_temp.mkdir(parents=True)
        if shutil.which("ninja") and not (build_temp / "CMakeCache.txt").exists():
            args.append("-GNinja")
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(["cmake", "-S", ext.sourcedir, "-B", str(build_temp), *args], check=True)
        stamp.write_text(config_key)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", str(build_temp), "--parallel", jobs], check=True)


setup(
    version=_version(),
    ext_modules=[CMakeExtension("gpucoll._C", sourcedir=str(ROOT))],
    cmdclass={"build_ext": CMakeBuild},
)
