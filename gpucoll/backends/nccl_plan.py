"""Can the nccl backend's ranks run here, and with what environment (``gpucoll.spawn``, gpucoll-bench): the plan
the nccl backend (nccl.py, which re-exports it) hands its launchers. The checks themselves live in usable.py, below
every backend."""

from __future__ import annotations

import os

from gpucoll import _log, _nccl
from gpucoll._native import _C
from gpucoll.backends.usable import MULTI_RANK_ENV, resolve
from gpucoll.backends.usable import nccl_problems as problems
from gpucoll.errors import Unsupported


def spawn_plan(nranks: int, backend: str, probe=None, nccl=None, build=None, env=None):
    """(backend, extra environment) for the workers of ``gpucoll.spawn``. Explicit 'nccl' raises Unsupported
    saying why the ranks cannot run (what is missing, or GPU count and NCCL version); 'auto' falls back to host."""
    env = os.environ if env is None else env
    if backend == "auto":
        if resolve("auto") != "nccl":
            return "host", {}
        try:
            return spawn_plan(nranks, "nccl", probe, nccl, build, env)
        except Unsupported as e:
            _log.info(f"gpucoll.spawn(backend='auto'): using the host backend: {e}")
            return "host", {}
    if backend != "nccl":
        return backend, {}
    found = problems(build, probe, nccl)
    if found:
        raise Unsupported(f"gpucoll.spawn(backend='nccl', nranks={nranks}) cannot run here:\n  - "
                          + "\n  - ".join(found))
    probe = dict(_C.cuda_probe()) if probe is None else probe
    nccl = _nccl.load() if nccl is None else nccl
    count = int(probe["device_count"])
    if nranks <= count:
        return "nccl", {}
    version = int(nccl["version"])
    if not _C.nccl_multi_rank_gpu_supported(version):
        raise Unsupported(
            f"gpucoll.spawn(backend='nccl') with {nranks} ranks needs {nranks} GPUs, but {count} "
            f"{'is' if count == 1 else 'are'} visible; several ranks on one GPU need NCCL >= "
            f"{version_text(_C.NCCL_MULTI_RANK_GPU_VERSION)} ({MULTI_RANK_ENV}=1), and the loaded NCCL is "
            f"{nccl.get('version_string') or version_text(version)}. Use nranks <= {count}, or install a newer NCCL "
            f"(pip install -U nvidia-nccl-cu13)")
    if env.get(MULTI_RANK_ENV, "1").strip() != "1":
        raise Unsupported(f"gpucoll.spawn(backend='nccl') with {nranks} ranks on {count} GPU(s) needs ranks to "
                          f"share GPUs, but {MULTI_RANK_ENV}={env[MULTI_RANK_ENV]!r} forbids it; unset it or set 1")
    return "nccl", {MULTI_RANK_ENV: "1"}


def version_text(code: int) -> str:
    major, rest = divmod(int(code), 10000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"
