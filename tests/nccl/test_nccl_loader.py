"""The NCCL loader and the CUDA probe, each case in a fresh interpreter.

The loader caches its result per process and may find a copy of NCCL that torch or CuPy loaded first, so
every case runs `sys.executable -c ...` with a controlled environment and reads the state back as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import helpers
import pytest

from gpucoll import _nccl
from gpucoll._native import _C

pytestmark = pytest.mark.spawns

MIN_VERSION = 21800



# An emulated-device build (GPUCOLL_CUDA=emulate) loads gpucoll's NCCL stand-in in place of the search below; the
# search itself is tested on the nvcc and CPU builds (CI's first suite).
_NOT_EMULATED = pytest.mark.skipif(hasattr(_C, "emulator_config"),
                                   reason="an emulated-device build loads gpucoll's NCCL stand-in, never the wheel")


def run_py(code: str, env_extra: dict | None = None, unset=("GPUCOLL_NCCL_LIBRARY",), timeout: float = 120):
    env = dict(os.environ)
    for name in unset:
        env.pop(name, None)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOAD = """
import json
from gpucoll import _nccl
print(json.dumps(_nccl.load()))
"""


def wheel_lib() -> str:
    candidates = _nccl.wheel_candidates()
    if not candidates:
        pytest.skip(helpers.missing_reason("nvidia.nccl", "no nvidia-nccl-cu13/-cu12 wheel installed"))
    return candidates[0]


def build_fake_nccl(tmp_path, version: int, full: bool) -> str:
    """A shared library that claims to be NCCL `version`; `full` adds stubs for every required entry point."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake libnccl")
    names = [
        "ncclGetErrorString",
        "ncclGetLastError",
        "ncclGetUniqueId",
        "ncclCommInitRank",
        "ncclCommInitRankConfig",
        "ncclCommFinalize",
        "ncclCommDestroy",
        "ncclCommAbort",
        "ncclCommGetAsyncError",
        "ncclCommCount",
        "ncclCommCuDevice",
        "ncclCommUserRank",
        "ncclAllReduce",
        "ncclBroadcast",
        "ncclReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclSend",
        "ncclRecv",
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclRedOpCreatePreMulSum",
        "ncclRedOpDestroy",
    ]
    src = f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}\n"
    if full:
        src += "".join(f"int {n}(void) {{ return 0; }}\n" for n in names)
    else:
        src += "int ncclGetUniqueId(void) { return 0; }\n"
    c_file = tmp_path / f"fake_{version}_{int(full)}.c"
    so_file = tmp_path / f"libnccl_fake_{version}_{int(full)}.so.2"
    c_file.write_text(src)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so_file), str(c_file)], check=True, capture_output=True)
    return str(so_file)


def test_state_before_load_is_not_attempted():
    state = run_py("""
        import json
        from gpucoll import _nccl
        print(json.dumps(_nccl.state()))
    """)
    assert state["attempted"] is False
    assert state["loaded"] is False
    assert "not been loaded" in state["reason"]


def test_env_nonexistent_path_is_reported_without_fallback(tmp_path):
    missing = str(tmp_path / "nowhere" / "libnccl.so.2")
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": missing})
    assert state["loaded"] is False
    assert missing in state["reason"]
    assert "GPUCOLL_NCCL_LIBRARY" in state["reason"]
    assert "No such file" in state["reason"]
    # Naming a library is a decision: no other copy is tried, even when a wheel is installed.
    assert [t[0] for t in state["tried"]] == [missing]
    assert state["source"] == ""


def test_env_file_that_is_not_a_library(tmp_path):
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("this is not an ELF file\n" * 10)
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": str(bogus)})
    assert state["loaded"] is False
    assert str(bogus) in state["reason"]
    assert "ELF" in state["reason"] or "too short" in state["reason"], state["reason"]


def test_env_library_without_nccl_symbols():
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": "libm.so.6"})
    assert state["loaded"] is False
    assert "ncclGetVersion" in state["reason"]
    assert "not an NCCL library" in state["reason"]


def test_too_old_nccl_is_refused(tmp_path):
    old = build_fake_nccl(tmp_path, 21705, full=True)
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": old})
    assert state["loaded"] is False
    assert "2.17.5" in state["reason"] and "2.18.0" in state["reason"], state["reason"]


def test_missing_required_entry_points_are_named(tmp_path):
    partial = build_fake_nccl(tmp_path, 21903, full=False)
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": partial})
    assert state["loaded"] is False
    assert "2.19.3" in state["reason"]
    assert "ncclAllReduce" in state["reason"] and "ncclCommInitRankConfig" in state["reason"]
    assert "ncclGetUniqueId" not in state["reason"].split("entry points:")[-1]


def test_fake_library_with_every_required_symbol_loads_and_reports_optional(tmp_path):
    fake = build_fake_nccl(tmp_path, 21903, full=True)
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": fake})
    assert state["loaded"] is True, state["reason"]
    assert state["version"] == 21903 and state["version_string"] == "2.19.3"
    assert state["source"] == "GPUCOLL_NCCL_LIBRARY"
    assert sorted(state["missing_optional"]) == ["ncclAlltoAll", "ncclCommShrink", "ncclCommSplit", "ncclGather",
                                                 "ncclScatter"]


def test_nothing_found_is_a_state_not_an_error(tmp_path):
    # No env variable, no wheel paths, and a loader path without NCCL: every step fails, nothing raises.
    state = run_py(
        """
        import json
        from gpucoll import _C
        print(json.dumps(_C.nccl_load([])))
    """,
        {"LD_LIBRARY_PATH": str(tmp_path)},
    )
    if state["loaded"]:
        pytest.skip(f"the system loader finds an NCCL here ({state['path']})")
    assert state["attempted"] is True
    assert "no usable NCCL found" in state["reason"]
    assert [t[0] for t in state["tried"]] == ["libnccl.so.2", "libnccl.so.2"]


@_NOT_EMULATED
def test_wheel_is_found_and_loaded():
    lib = wheel_lib()
    state = run_py(LOAD)
    assert state["loaded"] is True, state["reason"]
    assert state["version"] >= MIN_VERSION
    major, minor, patch = (int(x) for x in state["version_string"].split("."))
    assert state["version"] == major * 10000 + minor * 100 + patch
    assert state["source"] == "wheel"
    assert os.path.realpath(state["path"]) == os.path.realpath(lib)
    assert state["reason"] == ""
    assert state["tried"][-1] == [lib, ""]


def test_env_path_to_wheel_library_loads():
    lib = wheel_lib()
    state = run_py(LOAD, {"GPUCOLL_NCCL_LIBRARY": lib})
    assert state["loaded"] is True, state["reason"]
    assert state["source"] == "GPUCOLL_NCCL_LIBRARY"
    assert state["version"] >= MIN_VERSION


@_NOT_EMULATED
def test_copy_already_in_process_is_reused():
    lib = wheel_lib()
    state = run_py(f"""
        import ctypes, json
        ctypes.CDLL({lib!r}, mode=ctypes.RTLD_GLOBAL)  # as torch would have done
        from gpucoll import _C
        print(json.dumps(_C.nccl_load([])))
    """)
    assert state["loaded"] is True, state["reason"]
    assert state["source"] == "process"
    assert os.path.realpath(state["path"]) == os.path.realpath(lib)


def test_load_is_cached_and_thread_safe():
    wheel_lib()
    result = run_py("""
        import json, threading
        from gpucoll import _C, _nccl
        cands = _nccl.wheel_candidates()
        out = []
        threads = [threading.Thread(target=lambda: out.append(_C.nccl_load(cands))) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps({"paths": sorted({s["path"] for s in out}), "loaded": [s["loaded"] for s in out],
                          "tries": [len(s["tried"]) for s in out], "state": _C.nccl_state()["loaded"]}))
    """)
    assert result["loaded"] == [True] * 8
    assert len(result["paths"]) == 1
    assert len(set(result["tries"])) == 1  # one search, seen by every thread
    assert result["state"] is True


def test_nccl_check_message_and_real_calls():
    wheel_lib()
    result = run_py("""
        import json
        from gpucoll import _C, _nccl, errors
        _nccl.load()
        out = {"uid_len": len(_C._nccl_unique_id())}
        try:
            _C._nccl_check(1, "ncclCommInitRank")
        except errors.NcclError as e:
            out["check"] = [type(e).__name__, e.message, e.call, e.location]
        out["ok"] = [_C._nccl_check(0, "x"), _C._nccl_check(7, "x")]
        if _C.cuda_probe()["device_count"] == 0:
            try:
                _C._nccl_smoke_init()
                out["init"] = "succeeded"
            except errors.NcclError as e:
                out["init"] = e.message
        print(json.dumps(out))
    """)
    assert result["uid_len"] == 128
    name, message, call, location = result["check"]
    assert name == "NcclError"
    assert call == "ncclCommInitRank"
    assert "ncclCommInitRank failed: ncclUnhandledCudaError" in message
    assert "unhandled cuda error" in message  # ncclGetErrorString's text
    assert location.startswith("python/runtime.cc:")
    assert result["ok"] == [0, 7]  # ncclSuccess and ncclInProgress pass
    if "init" in result:  # no GPU: a real ncclCommInitRank fails through nccl_check
        assert "ncclCommInitRank failed: ncclUnhandledCudaError" in result["init"], result["init"]


def test_nccl_require_raises_unsupported_with_the_reason(tmp_path):
    missing = str(tmp_path / "libnccl.so.2")
    result = run_py(
        """
        import json
        from gpucoll import _C, _nccl, errors
        _nccl.load()
        try:
            _C._nccl_unique_id()
            print(json.dumps("no error"))
        except errors.Unsupported as e:
            print(json.dumps(e.message))
    """,
        {"GPUCOLL_NCCL_LIBRARY": missing},
    )
    assert missing in result and "pip install nvidia-nccl-cu13" in result


def test_cuda_probe_never_raises_and_explains_zero():
    probe = run_py("""
        import json
        from gpucoll import _C
        print(json.dumps(_C.cuda_probe()))
    """)
    if probe["device_count"] == 0:
        assert probe["reason"], probe
        assert probe["devices"] == []
    else:
        assert len(probe["devices"]) == probe["device_count"]
        for d in probe["devices"]:
            assert d["name"] and d["major"] >= 3
    if probe["runtime_version"] is not None:  # CUDA build: the runtime answers even without a driver
        assert probe["runtime_version"] >= 11000
        if probe["runtime_device_count"] == 0:
            assert probe["runtime_reason"]


FAKE_DRIVER = r"""
#include <string.h>
int cuDriverGetVersion(int* v) { *v = 12080; return 0; }
int cuInit(unsigned f) { (void)f; return NDEV == 0 ? 100 : 0; }
int cuDeviceGetCount(int* n) { *n = NDEV; return 0; }
int cuDeviceGet(int* d, int i) { *d = i; return 0; }
int cuDeviceGetName(char* b, int n, int d) { strncpy(b, d ? "Fake A100" : "Fake H100", n); return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) { *v = a == 75 ? (d ? 8 : 9) : 0; return a == 75 || a == 76 ? 0 : 1; }
int cuDeviceTotalMem_v2(unsigned long* b, int d) { (void)d; *b = 80ul << 30; return 0; }
int cuGetErrorName(int r, const char** s) { *s = r == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN"; return 0; }
int cuGetErrorString(int r, const char** s) { *s = r == 100 ? "no CUDA-capable device is detected" : "?"; return 0; }
"""


@pytest.mark.parametrize("ndev", [0, 2])
def test_cuda_probe_with_a_fake_driver(tmp_path, ndev):
    # A stand-in libcuda.so.1 on LD_LIBRARY_PATH drives the probe's device listing and cuInit error paths.
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake libcuda")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run(
        [cc, "-shared", "-fPIC", f"-DNDEV={ndev}", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "fake.c")],
        check=True,
        capture_output=True,
    )
    probe = run_py(
        """
        import json
        from gpucoll import _C
        print(json.dumps(_C.cuda_probe()))
    """,
        {"LD_LIBRARY_PATH": str(tmp_path)},
    )
    if not probe["driver_path"].startswith(str(tmp_path)):
        pytest.skip(f"a real driver was loaded instead of the fake: {probe['driver_path']}")
    assert probe["driver_version"] == 12080 and probe["driver_version_string"] == "12.8"
    assert probe["device_count"] == ndev
    if ndev == 0:
        assert probe["driver_available"] is False
        assert probe["reason"] == "cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"
    else:
        assert probe["driver_available"] is True and probe["reason"] == ""
        assert [(d["name"], d["compute_capability"]) for d in probe["devices"]] == [
            ("Fake H100", "9.0"),
            ("Fake A100", "8.0"),
        ]
        assert probe["devices"][0]["total_memory"] == 80 << 30
        assert probe["devices"][0]["pci_bus_id"] == ""  # the fake has no cuDeviceGetPCIBusId
