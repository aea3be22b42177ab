"""The built module keeps the C++ runtime it links statically to itself.

Seen on the GPU image: its compiler links libstdc++ statically, _C exported that copy's symbols, and after
`import torch` (which puts the shared libstdc++ in the global scope) the loader bound part of _C's references to the
shared copy: the first `ostream << long` in _C (select_algorithm, from every host and custom collective) crashed
with SIGSEGV. CMakeLists.txt hides archive symbols (--exclude-libs,ALL); CI's emulated build links libstdc++
statically (GPUCOLL_STATIC_LIBSTDCXX) so that the check below has something to check there."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

import gpucoll

# Mangled prefixes of libstdc++'s own (non-template) internals: std::locale, std::ios_base, std::ostream/istream,
# the facets. A module that links libstdc++ dynamically never defines them; one that links it statically must not
# export them.
_RUNTIME = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base", "_ZNSo", "_ZNSi", "_ZNKSt7num_put", "_ZNSt7num_put",
            "_ZNSt7codecvt", "_ZNKSt7codecvt", "_ZNSt5ctype", "_ZNKSt5ctype")


def _libraries() -> list:
    root = os.path.dirname(gpucoll.__file__)
    return sorted(glob.glob(os.path.join(root, "_C*.so")) + glob.glob(os.path.join(root, "_emu", "*.so")))


def test_no_cxx_runtime_symbols_are_exported():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    libs = _libraries()
    assert libs, "gpucoll._C is not built"
    for lib in libs:
        out = subprocess.run([nm, "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
        leaked = [ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-1].startswith(_RUNTIME)]
        assert not leaked, f"{os.path.basename(lib)} exports {len(leaked)} libstdc++ symbols, e.g. {leaked[:5]}"


@pytest.mark.spawns
def test_selection_after_torch_is_imported():
    """The crash's own path: torch first, then a host-backend selection (which formats numbers with an ostream)."""
    pytest.importorskip("torch")
    code = ("import torch\nfrom gpucoll import _C\n"
            "print(_C.select_algorithm(0, 1, 1024, 1, 'auto'), _C.select_algorithm(0, 4, 1 << 20, 4, 'auto'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
