"""csrc/backends/nccl/nccl_api.h against the real nccl.h of the installed nvidia-nccl wheel, at compile time.

gpucoll declares the part of NCCL's C ABI it uses itself (NCCL is dlopen'ed, never included). A wrong enum value,
a parameter in the wrong place or a config field at the wrong offset would only show on a GPU, as a wrong result or
a crash. Here one translation unit includes both headers and static_asserts that every entry point of the
function table exists under that name in nccl.h with an ABI-identical signature, that every enum value matches,
and that our ncclConfig_t is a layout prefix of NCCL's. It compiles with the host compiler only (no GPU, no link).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
#include <cstddef>
#include <tuple>
#include <type_traits>

#include <nccl.h>

#include "backends/nccl/nccl_api.h"

namespace {

// Whether two types are passed and returned identically: the same type; enums of one size (ours are
// gpucoll::ncclResult_t etc., NCCL's are global); pointers with the same const-ness to ABI-identical
// pointees, where two distinct incomplete structs (gpucoll::ncclComm and ::ncclComm) count as identical;
// complete structs of one size (ncclUniqueId, passed by value).
template <class A, class B>
constexpr bool abi_same();

template <class T, class = void>
struct is_complete : std::false_type {};
template <class T>
struct is_complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {};

template <class A, class B>
constexpr bool abi_same() {
  if constexpr (std::is_same_v<A, B>) {
    return true;
  } else if constexpr (std::is_same_v<A, gpucoll::ncclConfig_t> && std::is_same_v<B, ::ncclConfig_t>) {
    return true;  // a prefix of NCCL's, checked field by field below (NCCL reads `size` bytes of it)
  } else if constexpr (std::is_const_v<A> != std::is_const_v<B>) {
    return false;
  } else if constexpr (std::is_enum_v<A> && std::is_enum_v<B>) {
    return sizeof(A) == sizeof(B);
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B>) {
    return abi_same<std::remove_pointer_t<A>, std::remove_pointer_t<B>>();
  } else if constexpr (std::is_class_v<std::remove_cv_t<A>> && std::is_class_v<std::remove_cv_t<B>>) {
    if constexpr (is_complete<A>::value && is_complete<B>::value) {
      return sizeof(A) == sizeof(B) && alignof(A) == alignof(B);
    } else {
      return !is_complete<A>::value && !is_complete<B>::value;
    }
  } else {
    return false;
  }
}

template <class F>
struct fn;
template <class R, class... A>
struct fn<R (*)(A...)> {
  using ret = R;
  using args = std::tuple<A...>;
};

template <class TA, class TB, std::size_t... I>
constexpr bool args_same(std::index_sequence<I...>) {
  return (abi_same<std::tuple_element_t<I, TA>, std::tuple_element_t<I, TB>>() && ...);
}

template <class Ours, class Theirs>
constexpr bool fn_same() {
  using A = typename fn<Ours>::args;
  using B = typename fn<Theirs>::args;
  if constexpr (std::tuple_size_v<A> != std::tuple_size_v<B>) {
    return false;
  } else {
    return abi_same<typename fn<Ours>::ret, typename fn<Theirs>::ret>() &&
           args_same<A, B>(std::make_index_sequence<std::tuple_size_v<A>>{});
  }
}

// Every entry point of the table: the dlsym name exists in nccl.h, with our signature.
#define CHECK_FN(name, required) \
  static_assert(fn_same<gpucoll::PFN_##name, decltype(&::name)>(), #name ": signature differs from nccl.h");
GPUCOLL_NCCL_FUNCTIONS(CHECK_FN)

#define SAME(v) static_assert(static_cast<long long>(gpucoll::v) == static_cast<long long>(::v), #v);
SAME(ncclSuccess) SAME(ncclUnhandledCudaError) SAME(ncclSystemError) SAME(ncclInternalError)
SAME(ncclInvalidArgument) SAME(ncclInvalidUsage) SAME(ncclRemoteError) SAME(ncclInProgress) SAME(ncclTimeout)
SAME(ncclNumResults)
SAME(ncclSum) SAME(ncclProd) SAME(ncclMax) SAME(ncclMin) SAME(ncclAvg) SAME(ncclNumOps) SAME(ncclMaxRedOp)
SAME(ncclInt8) SAME(ncclUint8) SAME(ncclInt32) SAME(ncclUint32) SAME(ncclInt64) SAME(ncclUint64)
SAME(ncclFloat16) SAME(ncclFloat32) SAME(ncclFloat64) SAME(ncclBfloat16) SAME(ncclFloat8e4m3)
SAME(ncclFloat8e5m2) SAME(ncclNumTypes)
SAME(ncclScalarDevice) SAME(ncclScalarHostImmediate)
static_assert(sizeof(gpucoll::ncclRedOp_t) == sizeof(::ncclRedOp_t), "ncclRedOp_t size");
static_assert(sizeof(gpucoll::ncclDataType_t) == sizeof(::ncclDataType_t), "ncclDataType_t size");
static_assert(sizeof(gpucoll::ncclUniqueId) == sizeof(::ncclUniqueId), "ncclUniqueId size");
static_assert(gpucoll::kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES, "NCCL_UNIQUE_ID_BYTES");
static_assert(gpucoll::kNcclConfigUndefInt == NCCL_CONFIG_UNDEF_INT, "NCCL_CONFIG_UNDEF_INT");
static_assert(gpucoll::kNcclApiMagic == NCCL_API_MAGIC, "NCCL_API_MAGIC");
static_assert(gpucoll::kNcclSplitNoColor == NCCL_SPLIT_NOCOLOR, "NCCL_SPLIT_NOCOLOR");
static_assert(gpucoll::kNcclShrinkDefault == NCCL_SHRINK_DEFAULT, "NCCL_SHRINK_DEFAULT");
static_assert(gpucoll::kNcclShrinkAbort == NCCL_SHRINK_ABORT, "NCCL_SHRINK_ABORT");
static_assert(gpucoll::nccl_version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE, "NCCL_VERSION");
static_assert(gpucoll::nccl_version_code(2, 8, 4) == NCCL_VERSION(2, 8, 4), "NCCL_VERSION, old scheme");

// Our ncclConfig_t is a prefix of NCCL's: same offsets and types for every field we declare.
#define FIELD(f)                                                                                            \
  static_assert(offsetof(gpucoll::ncclConfig_t, f) == offsetof(::ncclConfig_t, f), "ncclConfig_t::" #f); \
  static_assert(sizeof(gpucoll::ncclConfig_t::f) == sizeof(::ncclConfig_t::f), "ncclConfig_t::" #f);
FIELD(size) FIELD(magic) FIELD(version) FIELD(blocking) FIELD(cgaClusterSize) FIELD(minCTAs) FIELD(maxCTAs)
FIELD(netName) FIELD(splitShare)
static_assert(sizeof(gpucoll::ncclConfig_t) <= sizeof(::ncclConfig_t), "ncclConfig_t prefix");

}  // namespace

int main() {
  // What NCCL_CONFIG_INITIALIZER sets on the fields we have (run only if this file is ever linked).
  const ::ncclConfig_t theirs = NCCL_CONFIG_INITIALIZER;
  const gpucoll::ncclConfig_t ours = gpucoll::nccl_config_default();
  return (ours.magic == theirs.magic && ours.blocking == theirs.blocking && ours.netName == theirs.netName &&
          ours.splitShare == theirs.splitShare && ours.version <= theirs.version)
             ? 0
             : 1;
}
"""


def _nccl_include() -> Path | None:
    if not helpers.have("nvidia.nccl"):  # find_spec raises, not returns None, when no `nvidia` package exists
        return None
    spec = importlib.util.find_spec("nvidia.nccl")
    for d in spec.submodule_search_locations or []:
        if (Path(d) / "include" / "nccl.h").is_file():
            return Path(d) / "include"
    return None


def _cuda_include() -> Path | None:
    """nccl.h includes cuda_runtime.h: the toolkit's include directory (CUDA_HOME, or next to nvcc)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        roots.append(str(real.parent.parent))
        # A wrapper script (exec /usr/local/cuda-X/bin/nvcc "$@"): follow the path it names.
        try:
            text = real.read_text(errors="ignore")[:4096]
        except OSError:
            text = ""
        for word in text.split():
            if word.endswith("/bin/nvcc"):
                roots.append(str(Path(word).parent.parent))
    for root in filter(None, roots):
        for inc in (Path(root) / "include", Path(root) / "targets" / "x86_64-linux" / "include"):
            if (inc / "cuda_runtime.h").is_file():
                return inc
    return None


def _toolchain():
    """(c++, nccl.h's directory, cuda_runtime.h's directory), or a skip saying which is missing."""
    nccl_inc = _nccl_include()
    if nccl_inc is None:
        pytest.skip(helpers.missing_reason("nvidia.nccl", "nccl.h comes from the nvidia-nccl-cu13 wheel"))
    cxx = shutil.which("c++") or shutil.which("g++")
    cuda_inc = _cuda_include()
    if cxx is None or cuda_inc is None:
        pytest.skip(f"needs a C++ compiler ({cxx}) and the CUDA toolkit's headers ({cuda_inc}): nccl.h includes "
                    f"cuda_runtime.h")
    return cxx, nccl_inc, cuda_inc


def test_nccl_api_matches_the_installed_nccl_h(tmp_path):
    cxx, nccl_inc, cuda_inc = _toolchain()
    src = tmp_path / "nccl_abi_check.cc"
    src.write_text(CHECK)
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", str(nccl_inc),
                           "-isystem", str(cuda_inc), "-I", str(ROOT / "csrc"), str(src)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"nccl_api.h disagrees with {nccl_inc / 'nccl.h'}:\n{proc.stderr[-6000:]}"


def test_the_check_catches_a_wrong_declaration(tmp_path):
    """The same check with one enum value and one parameter type broken on purpose must fail to compile."""
    cxx, nccl_inc, cuda_inc = _toolchain()
    api = (ROOT / "csrc" / "backends" / "nccl" / "nccl_api.h").read_text()
    broken = api.replace("ncclMax = 2,", "ncclMax = 3,").replace(
        "using PFN_ncclSend = ncclResult_t (*)(const void* sendbuff, size_t count,",
        "using PFN_ncclSend = ncclResult_t (*)(const void* sendbuff, int count,")
    assert broken.count("ncclMax = 3,") == 1 and "const void* sendbuff, int count," in broken
    (tmp_path / "backends" / "nccl").mkdir(parents=True)
    (tmp_path / "backends" / "nccl" / "nccl_api.h").write_text(broken)
    src = tmp_path / "nccl_abi_check.cc"
    src.write_text(CHECK)
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-I", str(nccl_inc), "-isystem", str(cuda_inc),
                           "-I", str(tmp_path), "-I", str(ROOT / "csrc"), str(src)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "ncclMax" in proc.stderr and "ncclSend: signature differs" in proc.stderr, proc.stderr[-3000:]
