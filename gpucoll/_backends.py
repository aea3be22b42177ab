"""Building this rank's backend for a Communicator: the host backend's shared-memory segment, the NCCL
communicator, or the custom backend with its per-call selector (gpucoll/_select.py), over the rendezvous store.
Every rank calls ``build`` together: each backend's set-up is collective."""

from __future__ import annotations

import socket

from gpucoll.errors import Unsupported


def build(launch, store, kind: str, timeout: float, local_size: int, device, requested: str = "auto"):
    """(kind, impl, selector or None, chosen): `kind` as resolved ('auto' that became 'custom': chosen=True).
    The store is closed again if the backend cannot be built."""
    from gpucoll import _C, _custom_backend, config

    _C.set_log_rank(launch.rank)
    chosen = (requested == "auto" and kind == "nccl" and not config.get("GPUCOLL_BACKEND").strip()
              and _custom_backend.takes_auto(launch.world_size))
    if chosen:
        kind = "custom"
    selector = None
    try:
        if kind == "nccl":
            from gpucoll import _nccl_backend

            impl = _nccl_backend.init_backend(launch, store, timeout, device)
        elif kind == "custom":
            impl = _custom_backend.init_backend(launch, store, timeout, device)
            try:
                from gpucoll import _select

                selector = _select.build(store, launch.rank, launch.world_size, device=impl.device,
                                         local_size=local_size, avail=impl.availability(),
                                         p2p_failed=impl.p2p_failed_pairs(), timeout=timeout)
            except BaseException:
                impl.close()
                raise
        else:
            impl = _init_host(launch, store, timeout)
    except BaseException:
        store.close()
        raise
    return kind, impl, selector, chosen


def _init_host(launch, store, timeout: float):
    from gpucoll import _C

    host = socket.gethostname()
    # Several communicators may be built over one store (torch's, or repeated inits): each gets its own keys.
    generation = (store.add("gpucoll/host/count", 1) - 1) // launch.world_size
    prefix = f"gpucoll/host/{generation}/"
    store.set(f"{prefix}hostname/{launch.rank}", host.encode())
    if launch.rank == 0:
        for r in range(1, launch.world_size):
            other = store.get(f"{prefix}hostname/{r}", timeout=timeout).decode()
            if other != host:
                store.set(f"{prefix}shm", b"")
                raise Unsupported(f"the host backend needs every rank on one machine; rank {r} runs on {other!r}, "
                                  f"rank 0 on {host!r}")
        name = _C.HostComm.make_name()
        impl = _C.HostComm(0, launch.world_size, float(timeout), name, True)
        store.set(f"{prefix}shm", name.encode())
    else:
        name = store.get(f"{prefix}shm", timeout=timeout).decode()
        if not name:
            raise Unsupported("the host backend needs every rank on one machine (rank 0 found ranks on other hosts)")
        impl = _C.HostComm(launch.rank, launch.world_size, float(timeout), name, False)
    impl.wait_attached()
    return impl
