"""The GPU tests' view of where they run and what allocates their CUDA arrays.

Providers: every GPU test that moves data is parametrised by its array provider. ``device_array``
(gpucoll.testing.DeviceArray: gpucoll's own device memory) runs everywhere a device is usable, gpucoll's emulated
CUDA device (a GPUCOLL_CUDA=emulate build) included; ``torch`` needs torch with CUDA, i.e. a real GPU, and skips
with the reason elsewhere. Each provider uploads NumPy inputs, makes outputs pre-filled with a sentinel, makes
misaligned views (an element offset from the allocation's start), and downloads results as NumPy (bfloat16 as
float32, exactly), so tests are written once for both.

This module imports gpucoll._C lazily and torch only when the torch provider is used.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest

PROVIDERS = ("device_array", "torch")
SENTINEL = 0xA5  # every byte of an output before a call: a kernel that skips an element leaves it visible


def emulated() -> bool:
    """Whether gpucoll runs on its emulated CUDA device (GPUCOLL_CUDA=emulate)."""
    from gpucoll import _C

    return bool(_C.build_info().get("cuda_emulated"))


def torch_cuda_problem() -> str | None:
    """Why torch CUDA tensors cannot be used here, or None."""
    if emulated():
        return ("torch cannot allocate on gpucoll's emulated CUDA device (a CPU emulation: torch's CUDA needs a real "
                "GPU); these run on a GPU")
    try:
        import torch
    except ImportError:
        return helpers.missing_reason("torch")
    if not torch.cuda.is_available():
        return "torch has no usable CUDA device"
    return None


def nccl_problem() -> str | None:
    """Why NCCL cannot run here (the custom backend's fallback, the nccl backend), or None."""
    from gpucoll.backends import nccl as _nccl_backend

    found = _nccl_backend.problems()
    return "; ".join(found) if found else None


def nccl_ranks_problem(world: int) -> str | None:
    """Why `world` NCCL ranks cannot run on this machine's GPUs, or None: gpucoll.spawn's own verdict (NCCL itself,
    or ranks that would share a GPU with an NCCL older than 2.30; the GPU image's NCCL was 2.28.9)."""
    from gpucoll.backends import nccl as _nccl_backend
    from gpucoll.errors import Unsupported

    try:
        _nccl_backend.spawn_plan(world, "nccl")
    except Unsupported as e:
        return str(e)
    return None


def require_nccl_ranks(world: int) -> None:
    """Skip, naming why, where `world` NCCL ranks cannot run here (see nccl_ranks_problem)."""
    why = nccl_ranks_problem(world)
    if why:
        pytest.skip(why)


def provider_params():
    """pytest params for the providers, each skipped with its reason where it cannot run."""
    why = None
    try:
        why = torch_cuda_problem()
    except Exception as e:  # noqa: BLE001 - a broken build is reported by the tests that use it
        why = f"cannot tell whether torch CUDA works: {e}"
    return [pytest.param("device_array"), pytest.param("torch", marks=pytest.mark.skipif(why is not None, reason=why or ""))]


class DeviceArrays:
    name = "device_array"

    def upload(self, a: np.ndarray, dtype: str, device: int = 0, offset: int = 0):
        """A device copy of `a` starting `offset` elements into its allocation (a misaligned view when offset > 0)."""
        from gpucoll.testing import DeviceArray

        base = DeviceArray(a.size + offset, dtype, device)
        base.fill_bytes(SENTINEL)
        view = base[offset:] if offset else base
        view.copy_from_host(a)
        return view

    def empty(self, count: int, dtype: str, device: int = 0, offset: int = 0):
        from gpucoll.testing import DeviceArray

        base = DeviceArray(count + offset, dtype, device)
        base.fill_bytes(SENTINEL)
        return base[offset:] if offset else base

    def download(self, x, dtype: str) -> np.ndarray:
        return x.to_host()

    def write(self, x, a: np.ndarray) -> None:
        x.copy_from_host(a)

    def fill_sentinel(self, x) -> None:
        x.fill_bytes(SENTINEL)

    def synchronize(self, device: int = 0) -> None:
        pass  # DeviceArray's copies are complete on return

    def ptr(self, x) -> int:
        return x.ptr


class TorchArrays:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def _dev(self, device):
        return f"cuda:{device}"

    def upload(self, a: np.ndarray, dtype: str, device: int = 0, offset: int = 0):
        torch = self.torch
        t = torch.from_numpy(np.ascontiguousarray(a))
        if dtype == "bfloat16":
            t = t.to(torch.bfloat16)
        base = torch.empty(a.size + offset, dtype=t.dtype, device=self._dev(device))
        base.view(torch.uint8).fill_(SENTINEL)
        view = base[offset:]
        view.copy_(t)
        torch.cuda.synchronize(device)
        return view

    def empty(self, count: int, dtype: str, device: int = 0, offset: int = 0):
        torch = self.torch
        base = torch.empty(count + offset, dtype=getattr(torch, dtype), device=self._dev(device))
        base.view(torch.uint8).fill_(SENTINEL)
        torch.cuda.synchronize(device)
        return base[offset:]

    def download(self, x, dtype: str) -> np.ndarray:
        torch = self.torch
        return (x.to(torch.float32) if dtype == "bfloat16" else x).cpu().numpy()

    def write(self, x, a: np.ndarray) -> None:
        torch = self.torch
        t = torch.from_numpy(np.ascontiguousarray(a))
        x.copy_(t.to(x.dtype))
        torch.cuda.synchronize(x.device)

    def fill_sentinel(self, x) -> None:
        x.view(self.torch.uint8).fill_(SENTINEL)
        self.torch.cuda.synchronize(x.device)

    def synchronize(self, device: int = 0) -> None:
        self.torch.cuda.synchronize(device)

    def ptr(self, x) -> int:
        return x.data_ptr()


def provider(name: str):
    return DeviceArrays() if name == "device_array" else TorchArrays()


# -- the GPU backends' one-call paths (tests/nccl/test_nccl_fast_path.py, tests/custom/test_custom_fast_path.py) ----

class Interface:
    """A __cuda_array_interface__ over `base`'s memory with the given overrides (strides, data, mask, typestr...)."""

    def __init__(self, base, **over):
        self.__cuda_array_interface__ = dict(base.__cuda_array_interface__, **over)


def reduce_on_interface_stream(comm, impl_cls, trials: int = 3):
    """all_reduce(x) of an interface that names a stream where a 32 MiB copy and then x's fill are still queued (a
    non-blocking stream): a call on any other stream reads x half-made. Returns (what impl_cls.all_reduce_array
    returned on each call, one line per wrong trial)."""
    from gpucoll import _C
    from gpucoll.testing import DeviceArray

    dev, n = int(comm.device.split(":")[1]), 20001
    stream = _C.CudaStream(dev)
    pad_src, pad_dst = DeviceArray((8 << 20,), "float32", dev), DeviceArray((8 << 20,), "float32", dev)
    host = np.arange(n, dtype=np.float32) % 97 + comm.rank
    want = (np.arange(n, dtype=np.float32) % 97) * comm.world_size + sum(range(comm.world_size))
    taken, bad = [], []
    real = impl_cls.all_reduce_array
    impl_cls.all_reduce_array = lambda self, *a: taken.append(real(self, *a)) or taken[-1]
    try:
        for trial in range(trials):
            x = DeviceArray((n,), "float32", dev)
            x.fill_bytes(SENTINEL)
            _C.cuda_copy(pad_dst.ptr, pad_src.ptr, pad_src.nbytes, dev, stream.handle)
            _C.cuda_copy(x.ptr, host.ctypes.data, host.nbytes, dev, stream.handle)
            comm.all_reduce(Interface(x, stream=stream.handle))
            stream.synchronize()
            if not np.array_equal(x.to_host(), want):
                bad.append(f"trial {trial}: {np.count_nonzero(x.to_host() != want)} elements wrong")
    finally:
        impl_cls.all_reduce_array = real
    return taken, bad


# Interfaces the one-call paths decline, with the general path's typed error (class name) and a word of its message.
DECLINED_INTERFACES = (
    (lambda x: Interface(x, shape=(4,), strides=(8,)), "InvalidArgument", "C-contiguous"),
    (lambda x: Interface(x, data=(x.ptr, True)), "InvalidArgument", "writable"),
    (lambda x: Interface(x, mask=object()), "Unsupported", "masked"),
    (lambda x: Interface(x, typestr=">f4"), "InvalidArgument", "byte order"),
    (lambda x: Interface(x, typestr="|V4"), "Unsupported", "raw bytes"),
    (lambda x: Interface(x, stream=-1), "InvalidArgument", "stream"),
)


def declined_interfaces_raise(comm, x) -> list:
    """Each of DECLINED_INTERFACES over x raises its typed error here; returns the words seen, in order."""
    from gpucoll import errors

    seen = []
    for make, exc, what in DECLINED_INTERFACES:
        with pytest.raises(getattr(errors, exc), match=what):
            comm.all_reduce(make(x))
        seen.append(what)
    return seen
