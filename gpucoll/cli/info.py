"""``python -m gpucoll info``: what this installation can do here, and why not where it cannot.

Reads everything without importing torch or CuPy (their versions come from package metadata), so it works
and stays fast in any environment, including one whose GPU stack is broken.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import platform
import sys

from gpucoll import _nccl
from gpucoll._help import HelpFormatter, reader_may_leave
from gpucoll._native import _C, LOAD_ERROR
from gpucoll._version import __version__
from gpucoll.backends.usable import device_map, multi_rank_enabled
from gpucoll.bootstrap import detect_launch

# Versions reported when installed. CuPy ships under one distribution name per CUDA major.
PACKAGES = (
    "numpy",
    "torch",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "cupy",
    "mpi4py",
    "mpich",
    "nvidia-nccl-cu13",
    "nvidia-nccl-cu12",
)


def _native():
    """gpucoll._C, or the error text when the native core cannot be imported (gpucoll._native)."""
    if LOAD_ERROR:  # a broken build must still be diagnosable
        return None, LOAD_ERROR
    return _C, ""


def _nvml() -> dict:
    """Whether NVML (libnvidia-ml.so.1, shipped with the driver) can be loaded and initialised."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return {"available": False, "reason": f"libnvidia-ml.so.1 not loadable: {exc}"}
    init = getattr(lib, "nvmlInit_v2", None) or getattr(lib, "nvmlInit", None)
    if init is None:
        return {"available": False, "reason": "libnvidia-ml.so.1 has no nvmlInit"}
    rc = init()
    if rc != 0:
        text = ""
        err = getattr(lib, "nvmlErrorString", None)
        if err is not None:
            err.restype = ctypes.c_char_p
            text = (err(rc) or b"").decode(errors="replace")
        return {"available": False, "reason": f"nvmlInit failed: {text or 'error'} ({rc})"}
    version = ""
    get_version = getattr(lib, "nvmlSystemGetDriverVersion", None)
    if get_version is not None:
        buf = ctypes.create_string_buffer(96)
        if get_version(buf, ctypes.c_uint(len(buf))) == 0:
            version = buf.value.decode(errors="replace")
    shutdown = getattr(lib, "nvmlShutdown", None)
    if shutdown is not None:
        shutdown()
    return {"available": True, "reason": "", "driver_version": version}


def _packages() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def collect() -> dict:
    """Everything `gpucoll info` reports, as JSON-serialisable data."""
    info = {
        "gpucoll": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "native": None,
        "build": None,
        "cuda": None,
        "nccl": None,
        "nvml": _nvml(),
        "config": [],
        "packages": _packages(),
    }
    C, error = _native()
    if C is None:
        info["native"] = {"importable": False, "reason": error}
        info["nccl"] = {
            "loaded": False,
            "reason": f"native core not importable: {error}",
            "install_hint": "rebuild gpucoll first (pip install --no-build-isolation -e . in a checkout)",
        }
        return info
    info["native"] = {"importable": True, "reason": ""}
    info["build"] = dict(C.build_info())
    cuda = dict(C.cuda_probe())
    cuda["devices"] = [dict(d) for d in cuda["devices"]]
    info["cuda"] = cuda
    nccl = _nccl.load()
    nccl["tried"] = [list(t) for t in nccl["tried"]]
    if not nccl["loaded"]:
        nccl["install_hint"] = _nccl.install_hint(cuda.get("driver_version"))
    info["nccl"] = nccl
    info["device_map"] = _device_map(cuda, nccl)
    info["config"] = [dict(v) for v in C.config_vars()]
    return info


def _device_map(cuda: dict, nccl: dict) -> dict:
    """Which GPU each local rank of the nccl backend would use here (gpucoll.backends.usable.pick_device)."""
    count = int(cuda.get("device_count") or 0)
    try:
        launch = detect_launch()
        local, source = launch.local_world_size, f"{launch.launcher} launcher"
        this = launch.local_rank
    except Exception:  # noqa: BLE001 - no launcher: show one rank per visible GPU
        local, source, this = max(count, 1), "no launcher: one rank per GPU", None
    shared = bool(nccl.get("loaded")) and multi_rank_enabled(nccl.get("version") or 0)
    return {
        "local_world_size": local,
        "source": source,
        "this_local_rank": this,
        "shared_gpus": shared,
        "map": [[lr, dev] for lr, dev in device_map(local, count, shared)],
    }


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def format_text(info: dict) -> str:
    lines = [f"gpucoll {info['gpucoll']}  (Python {info['python']}, {info['platform']})"]
    native = info["native"]
    if not native["importable"]:
        lines.append(f"native core: NOT importable: {native['reason']}")
    build = info["build"]
    if build is not None:
        if build.get("cuda_emulated"):
            lines.append(f"build: CUDA EMULATED (GPUCOLL_CUDA=emulate), compiler {build['compiler']}")
            lines.append("  The CUDA device below is gpucoll's CPU emulation, not a GPU: the GPU code runs on the CPU, "
                         "for tests. Its timings are not GPU timings.")
        elif build["cuda_built"]:
            archs = build["cuda_archs"] or "?"
            lines.append(f"build: CUDA on (archs {archs}), compiler {build['compiler']}")
        else:
            lines.append(f"build: CUDA off (host-only), compiler {build['compiler']}")
    cuda = info["cuda"]
    if cuda is not None:
        runtime = cuda["runtime_version_string"] or "none (built without CUDA)"
        if cuda.get("emulated"):
            driver = f"emulated ({cuda['driver_path'] or 'libgpucoll_cudaemu.so'})"
        elif cuda["driver_version"]:
            driver = f"{cuda['driver_version_string']} ({cuda['driver_path'] or 'libcuda.so.1'})"
        else:
            driver = "none"
        lines.append(f"CUDA runtime: {runtime}")
        lines.append(f"CUDA driver: {driver}")
        if cuda["device_count"]:
            lines.append(f"CUDA devices: {cuda['device_count']}" + (" (emulated: not GPUs)" if cuda.get("emulated") else ""))
            for d in cuda["devices"]:
                lines.append(
                    f"  [{d['index']}] {d['name']}  sm_{d['major']}{d['minor']}  "
                    f"{_fmt_bytes(d['total_memory'])}  {d['pci_bus_id']}"
                )
            if cuda["runtime_device_count"] == 0:  # e.g. a driver older than the runtime gpucoll was built with
                lines.append(f"  but this build's CUDA runtime cannot use them: {cuda['runtime_reason']}")
        else:
            lines.append(f"CUDA devices: 0 ({cuda['reason']})")
    nccl = info["nccl"]
    if nccl.get("loaded"):
        if nccl["source"] == "emulator":
            lines.append(f"NCCL: gpucoll's NCCL stand-in for the emulated device (not NVIDIA's NCCL; reports NCCL "
                         f"{nccl['version_string']}; timings are not GPU timings) from {nccl['path']}")
        else:
            lines.append(f"NCCL: {nccl['version_string']} from {nccl['path']} ({nccl['source']})")
        if nccl.get("missing_optional"):
            lines.append(f"  (lacks the optional {', '.join(nccl['missing_optional'])})")
    else:
        lines.append(f"NCCL: not available: {nccl['reason']}")
        lines.append(f"  install: {nccl['install_hint']}")
    dmap = info.get("device_map")
    if dmap:
        lines.append(f"nccl device per local rank ({dmap['source']}; LOCAL_RANK picks, device= overrides"
                     + ("; ranks share GPUs via NCCL_MULTI_RANK_GPU_ENABLE" if dmap["shared_gpus"] else "") + "):")
        for lr, dev in dmap["map"]:
            mark = "  <- this process" if lr == dmap["this_local_rank"] else ""
            lines.append(f"  local rank {lr} -> " + (f"cuda:{dev}" if dev is not None else "no GPU") + mark)
    nvml = info["nvml"]
    if nvml["available"]:
        lines.append(f"NVML: available (driver {nvml.get('driver_version') or '?'})")
    else:
        lines.append(f"NVML: not available: {nvml['reason']}")
    if info["config"]:
        lines.append("configuration (GPUCOLL_*):")
        for v in info["config"]:
            shown = v["value"] if v["value"] != "" else "(empty)"
            origin = "set" if v["is_set"] else "default"
            lines.append(f"  {v['name']} = {shown}  [{v['type']}, {origin}]")
            lines.append(f"      {v['description']}")
    if info["packages"]:
        lines.append("packages: " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()))
    else:
        lines.append("packages: none of " + ", ".join(PACKAGES))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpucoll info", formatter_class=HelpFormatter,
                                     description="Report gpucoll's build, CUDA, NCCL and configuration.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


@reader_may_leave
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(format_text(info))
    return 0
