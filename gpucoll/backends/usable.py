"""Which backends can run in this process, and why not: each GPU backend's needs (a CUDA build, a usable GPU,
NCCL), what ``backend='auto'`` and GPUCOLL_BACKEND resolve to, and which GPU each rank uses.

Every sentence here says how to fix what it names. Nothing is set up: these are the checks ``init`` makes before
a backend is built (and ``spawn``, before any worker starts), and what ``python -m gpucoll info`` reports.
"""

from __future__ import annotations

import os

from gpucoll import _nccl, config
from gpucoll._native import _C
from gpucoll.errors import InvalidArgument, Unsupported

BACKENDS = ("auto", "host", "nccl", "custom")
MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
# What the custom backend's kernels implement, in the selector's "collective:algorithm" terms (select.py).
CUSTOM_ALGORITHMS = ("all_reduce:oneshot", "all_reduce:twoshot", "all_reduce:ring", "all_reduce:tree")


def resolve(backend: str) -> str:
    """The backend a communicator asked for `backend` runs on ('auto': GPUCOLL_BACKEND, else NCCL where a usable
    GPU exists and NCCL loads, else host); Unsupported, saying why, where the one asked for cannot run here."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        backend = config.get("GPUCOLL_BACKEND").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise InvalidArgument(f"GPUCOLL_BACKEND must be one of host, nccl, custom; got {backend!r}")
    if backend == "auto":
        # NCCL when the buffers will be CUDA: a usable GPU exists and NCCL loads.
        return "nccl" if auto_selects_nccl() else "host"
    if backend == "nccl":
        check_nccl_usable()
    if backend == "custom":
        check_custom_usable()
    return backend


# -- the GPU backends' needs ----------------------------------------------------------------------------------------

def gpu_problems(backend: str, unbuilt_reason: str, build=None, probe=None) -> list:
    """What keeps a GPU backend (`backend`, e.g. "the nccl backend") from running here, before its own needs: a
    build without CUDA, no usable GPU, a CUDA runtime the driver cannot serve. One sentence each, saying the fix."""
    build = dict(_C.build_info()) if build is None else build
    probe = dict(_C.cuda_probe()) if probe is None else probe
    out = []
    if not build.get("cuda_built"):
        out.append(unbuilt_reason)
    if not probe.get("device_count"):
        why = probe.get("reason") or "the CUDA driver reports no device"
        out.append(f"no usable CUDA GPU: {why}. {backend[0].upper()}{backend[1:]} needs an NVIDIA GPU with its "
                   f"driver (check nvidia-smi and CUDA_VISIBLE_DEVICES); use backend='host' for CPU arrays")
    elif build.get("cuda_built") and probe.get("runtime_device_count") == 0:
        out.append(f"the CUDA runtime gpucoll was built with cannot use the GPU: {probe.get('runtime_reason')} "
                   f"(update the driver, or rebuild gpucoll with the CUDA toolkit matching it)")
    return out


def nccl_problems(build=None, probe=None, nccl=None) -> list:
    """Why ``backend='nccl'`` cannot run in this process, one sentence each saying how to fix it; [] when it can.

    The arguments default to this process's state (``_C.build_info()``, ``_C.cuda_probe()``, ``_nccl.load()``);
    tests pass fakes. NCCL is looked for even when there is no GPU, so that every missing piece is named at once.
    """
    probe = dict(_C.cuda_probe()) if probe is None else probe
    out = gpu_problems("the nccl backend", _C.NCCL_BACKEND_UNBUILT_REASON, build, probe)
    nccl = _nccl.load() if nccl is None else nccl
    if not nccl.get("loaded"):
        out.append(f"NCCL is not available: {nccl.get('reason') or 'not loaded'}. Install it: "
                   f"{_nccl.install_hint(probe.get('driver_version'))}")
    return out


def custom_problems(build=None, probe=None) -> list:
    """Why ``backend='custom'`` cannot run in this process ([] when it can); the arguments default to this
    process's state, tests pass fakes."""
    return gpu_problems("the custom backend (gpucoll's own CUDA kernels)", _C.CUSTOM_BACKEND_UNBUILT_REASON, build,
                        probe)


def check_nccl_usable() -> None:
    """Unsupported listing everything that keeps ``backend='nccl'`` from running here."""
    found = nccl_problems()
    if found:
        raise Unsupported("backend='nccl' cannot run here:\n  - " + "\n  - ".join(found))


def check_custom_usable(what: str = "backend='custom'") -> None:
    found = custom_problems()
    if found:
        raise Unsupported(f"{what} cannot run here:\n  - " + "\n  - ".join(found))


def auto_selects_nccl() -> bool:
    """``backend='auto'``: NCCL when a usable GPU exists and NCCL loads (the GPU is checked first, so a machine
    without one never loads NCCL)."""
    if not _C.build_info()["cuda_built"]:
        return False
    probe = _C.cuda_probe()
    if not probe["device_count"] or probe["runtime_device_count"] == 0:
        return False
    return bool(_nccl.load()["loaded"])


def custom_takes_auto(world_size: int) -> bool:
    """Whether backend='auto' on a GPU becomes the custom backend (our kernels with NCCL behind them, chosen per call
    by the topology model) rather than NCCL alone: kernels built, 2 to CUSTOM_MAX_RANKS ranks and at least as many
    visible GPUs. Processes sharing a GPU stay on NCCL: our spinning kernels progress there only as the GPU
    time-slices between processes (a correctness mode, asked for with backend='custom')."""
    if not 2 <= world_size <= _C.CUSTOM_MAX_RANKS or custom_problems():
        return False
    return int(_C.cuda_probe().get("device_count") or 0) >= world_size


# -- which GPU ------------------------------------------------------------------------------------------------------

def auto_placement_problem(local_world_size: int, device) -> str:
    """Why backend='auto' cannot give this node's ranks NCCL ("" when it can): more local ranks than GPUs, no
    device= and ranks not allowed to share a GPU. Then 'auto' means the host backend, where init() would otherwise
    fail on the second rank with an error about GPUs the job never asked for."""
    if device is not None:
        return ""
    count = int(_C.cuda_probe()["device_count"])
    if local_world_size <= count or multi_rank_enabled(int(_nccl.load()["version"])):
        return ""
    return (f"{local_world_size} ranks on this node and {count} GPU(s), and ranks may not share a GPU (NCCL >= 2.30 "
            f"with {MULTI_RANK_ENV}=1)")


def multi_rank_enabled(version: int, env=None) -> bool:
    """Whether ranks may share a GPU: NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL's own switch)."""
    env = os.environ if env is None else env
    return env.get(MULTI_RANK_ENV, "").strip() == "1" and _C.nccl_multi_rank_gpu_supported(int(version))


def _parse_device(device) -> int:
    if isinstance(device, bool):
        raise InvalidArgument(f"device must be a CUDA device index, 'cuda:N' or a torch.device; got {device!r}")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        text = device.strip().lower().removeprefix("cuda:")
        if text.isdigit():
            return int(text)
    elif getattr(device, "type", None) == "cuda" and getattr(device, "index", None) is not None:
        return int(device.index)  # torch.device('cuda:N')
    raise InvalidArgument(f"device must be a CUDA device index, 'cuda:N' or a torch.device; got {device!r}")


def pick_device(local_rank: int, device, device_count: int, shared_ok: bool) -> int:
    """The GPU of a rank: `device` when given, else the local rank's own GPU, else (when ranks may share GPUs)
    local_rank % device_count."""
    if device is not None:
        d = _parse_device(device)
        if not 0 <= d < device_count:
            raise InvalidArgument(f"device={device!r} is not a visible GPU: {device_count} visible (0.."
                                  f"{device_count - 1}); check CUDA_VISIBLE_DEVICES")
        return d
    if device_count < 1:
        raise InvalidArgument("no CUDA GPU is visible to pick a device from")
    if local_rank < device_count:
        return local_rank
    if shared_ok:
        return local_rank % device_count
    raise InvalidArgument(f"local rank {local_rank} has no GPU of its own: {device_count} visible. Start at most "
                          f"{device_count} ranks per node, pass device=, or let ranks share GPUs (NCCL >= 2.30 with "
                          f"{MULTI_RANK_ENV}=1)")


def device_map(local_world_size: int, device_count: int, shared_ok: bool) -> list:
    """[(local_rank, device or None)] as init() would assign them (None: that local rank would get an error)."""
    out = []
    for lr in range(max(local_world_size, 0)):
        try:
            out.append((lr, pick_device(lr, None, device_count, shared_ok)))
        except InvalidArgument:
            out.append((lr, None))
    return out
