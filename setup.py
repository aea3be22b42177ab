"""Build gpucoll: setuptools drives CMake (a CMakeExtension/CMakeBuild pair) to build gpucoll._C.

Build-time variables (also listed by `python -m gpucoll info`):
  GPUCOLL_CUDA=auto|on|off|emulate
                             auto builds the CUDA sources when nvcc is found; on without nvcc is an error;
                             emulate builds them with the host compiler against gpucoll's emulated CUDA device
                             (csrc/emulation/: the GPU code runs on the CPU, for tests; never chosen by auto).
  GPUCOLL_CUDA_ARCHS="80;90" CUDA architectures; default: the local GPU's when one is present, else 80;90.
  CMAKE_ARGS                 extra arguments for CMake (e.g. -DGPUCOLL_WERROR=ON, as CI does).
  GPUCOLL_BUILD_DIR          CMake's build directory (default build/gpucoll._C-<mode>-py<X.Y>, kept between installs).
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


def _build_dir(mode: str, name: str) -> Path:
    """Where CMake builds: GPUCOLL_BUILD_DIR, else build/<name>-<mode>-py<X.Y> in the source tree, kept between
    installs (pip's editable builds otherwise use a fresh temporary directory, so a second `pip install -e .`
    recompiled everything), one per mode so that switching between on and emulate does not start over."""
    given = os.environ.get("GPUCOLL_BUILD_DIR", "").strip()
    if given:
        return Path(given).resolve()
    return ROOT / "build" / f"{name}-{mode}-py{sys.version_info[0]}.{sys.version_info[1]}"


def _kept_pybind11(build_temp: Path, pybind11) -> str:
    """pybind11's CMake directory in a copy kept in the build directory (its headers and CMake files, 1.4 MB). Build
    isolation installs pybind11 in a fresh temporary environment for every pip run: with the headers at a new path
    each time, every binding would compile again on each install."""
    src = Path(pybind11.__file__).resolve().parent
    cmake_dir = Path(pybind11.get_cmake_dir()).resolve()
    if src not in cmake_dir.parents or not (src / "include").is_dir():
        return str(cmake_dir)  # a system pybind11 (headers and CMake files elsewhere, at a path that stays put)
    kept = build_temp / f"pybind11-{pybind11.__version__}"
    if not (kept / "share").is_dir():
        part = kept.with_name(kept.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        for sub in ("include", "share"):
            shutil.copytree(src / sub, part / sub)
        part.rename(kept)
    return str(kept / cmake_dir.relative_to(src))


class CMakeExtension(Extension):
    def __init__(self, name, sourcedir=""):
        super().__init__(name, sources=[])
        self.sourcedir = str(Path(sourcedir).resolve())


# The emulated CUDA runtime (GPUCOLL_CUDA=emulate): a shared library next to _C, which finds it through its RPATH, and
# the NCCL stand-in that runs on it (found by the NCCL loader next to the runtime).
EMU_LIBS = (Path("_emu") / "libgpucoll_cudaemu.so", Path("_emu") / "libnccl-emu.so")


class CMakeBuild(build_ext):
    def _emu_pairs(self):
        """(built, in place) paths of the emulator library beside each extension; the built one may not exist."""
        build_py = self.get_finalized_command("build_py")
        pairs = []
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            for lib in EMU_LIBS:
                pairs.append((Path(regular_file).parent / lib, Path(inplace_file).parent / lib))
        return pairs

    def copy_extensions_to_source(self):
        # Editable installs copy the extension modules into the source tree; the emulator must follow _C there
        # (and an emulator of an earlier emulate build must not stay behind next to a _C that does not use it).
        super().copy_extensions_to_source()
        for built, inplace in self._emu_pairs():
            if built.exists():
                inplace.parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(built), str(inplace), level=self.verbose)
            else:
                shutil.rmtree(inplace.parent, ignore_errors=True)

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            mapping.update({str(b): str(i) for b, i in self._emu_pairs() if b.exists()})
        return mapping

    def get_outputs(self):
        outputs = super().get_outputs()
        if not self.inplace:
            outputs += [str(b) for b, _ in self._emu_pairs() if b.exists()]
        return outputs

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        mode = os.environ.get("GPUCOLL_CUDA", "auto").strip().lower() or "auto"
        if mode not in ("auto", "on", "off", "emulate"):
            raise SystemExit(f"GPUCOLL_CUDA={mode!r}: expected auto, on, off or emulate")
        nvcc = _find_nvcc() if mode in ("auto", "on") else None
        if mode == "on" and nvcc is None:
            raise SystemExit("GPUCOLL_CUDA=on but nvcc was not found (looked at CUDACXX, PATH, CUDA_HOME, "
                             "/usr/local/cuda). Install the CUDA toolkit or build with GPUCOLL_CUDA=off.")
        import pybind11

        build_temp = _build_dir(mode, ext.name)
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DGPUCOLL_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DGPUCOLL_VERSION={_version()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if mode == "emulate":
            args.append("-DGPUCOLL_CUDA=emulate")
        elif nvcc is None:
            args.append("-DGPUCOLL_CUDA=off")
        else:
            archs = os.environ.get("GPUCOLL_CUDA_ARCHS", "").strip() or ";".join(_local_gpu_archs()) or "80;90"
            args += [f"-DGPUCOLL_CUDA={mode}", f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        # Switching CUDA on/off changes the cached compiler: start that configuration from scratch.
        stamp = build_temp / "gpucoll-config.txt"
        # The configuration, less the output directory, which changes with every pip run and must not throw the kept
        # build directory away (pip's temporary build-lib; a new one only relinks). pybind11 comes in by its version
        # (below: a copy kept here, wherever build isolation installed it).
        extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        # The interpreter by its resolved path: `pip` runs builds as .../bin/python3, `python -m pip` as .../bin/python
        # (the same interpreter), and .ci/run installs both ways: a spelling must not recompile everything.
        config_key = "\n".join([a for a in args if not a.startswith(("-DGPUCOLL_OUTPUT_DIR=", "-DPython_EXECUTABLE="))]
                               + [f"python {os.path.realpath(sys.executable)}", f"pybind11 {pybind11.__version__}",
                                  *extra])
        ninja = shutil.which("ninja")
        config_key += f"\nninja {bool(ninja)}"
        if stamp.exists() and stamp.read_text() != config_key:
            shutil.rmtree(build_temp)
            build_temp.mkdir(parents=True)
        args.append(f"-Dpybind11_DIR={_kept_pybind11(build_temp, pybind11)}")
        if ninja:
            # Each isolated build has its own ninja: the kept cache must not point at the last one's, now deleted.
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
            if not (build_temp / "CMakeCache.txt").exists():
                args.append("-GNinja")
        args += extra
        if mode != "emulate":
            # An emulator left by an earlier GPUCOLL_CUDA=emulate build would ship with a build that does not use it.
            shutil.rmtree(out_dir / "_emu", ignore_errors=True)
        subprocess.run(["cmake", "-S", ext.sourcedir, "-B", str(build_temp), *args], check=True)
        stamp.write_text(config_key)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", str(build_temp), "--parallel", jobs], check=True)


setup(
    version=_version(),
    # gpucoll-topo's example machines (gpucoll/topo_examples/, named by gpucoll-topo where no GPU is found): data
    # files, which setuptools leaves out of wheels unless named here.
    package_data={"gpucoll": ["topo_examples/*.txt", "topo_examples/*.xml", "topo_examples/*.json"]},
    ext_modules=[CMakeExtension("gpucoll._C", sourcedir=str(ROOT))],
    cmdclass={"build_ext": CMakeBuild},
)
