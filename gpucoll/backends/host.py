"""Building this rank's backend for a Communicator: the host backend's shared-memory segment, the NCCL
communicator, or the custom backend with its per-call selector (gpucoll/_select.py), over the rendezvous store.
Every rank calls ``build`` together: each backend's set-up is collective."""

from __future__ import annotations

import json
import socket

from gpucoll.bootstrap._server import pid_exited
from gpucoll.errors import CollectiveTimeout, InvalidArgument, SystemError, Unsupported


def build(launch, store, kind: str, timeout: float, local_size: int, device, requested: str = "auto"):
    """(kind, impl, selector or None, chosen): `kind` as resolved ('auto' that became 'custom': chosen=True).
    The store is closed again if the backend cannot be built."""
    from gpucoll import _C, _custom_backend, config

    _stage("build")
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
        # Ranks still waiting for this one's keys learn at once, and rank 0's server stays up a little for the
        # ones that have not connected yet (gpucoll's store; others only close).
        abandon = getattr(store, "abandon", None)
        if abandon is not None:
            abandon(launch.world_size)
        else:
            store.close()
        raise
    return kind, impl, selector, chosen


# Tests only: called with the name of each step of the host backend's set-up (the kill sweep of
# tests/reliability/ stops ranks at each). None in normal use.
_STAGE_HOOK = None


def _stage(name: str) -> None:
    if _STAGE_HOOK is not None:
        _STAGE_HOOK(name)


def _parse_handle(raw: bytes):
    """The region handle rank 0 published, validated: it came over the network and becomes a /proc path."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        pid, fd, token = doc["pid"], doc["fd"], doc["token"]
        values = (pid, fd, *token)
        ok = (len(token) == 2 and all(type(v) is int for v in values) and 0 < pid < 2**31 and 0 <= fd < 2**31
              and all(0 <= t < 2**64 for t in token))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgument(f"the rendezvous store holds a malformed host-backend region handle: {raw[:200]!r}")
    return pid, fd, token[0], token[1]


def _init_host(launch, store, timeout: float):
    from gpucoll import _C

    host = socket.gethostname()
    # Several communicators may be built over one store (torch's, or repeated inits): each gets its own keys.
    generation = (store.add("gpucoll/host/count", 1) - 1) // launch.world_size
    prefix = f"gpucoll/host/{generation}/"
    store.set(f"{prefix}hostname/{launch.rank}", host.encode())
    _stage("registered")
    if launch.rank == 0:
        for r in range(1, launch.world_size):
            other = store.get(f"{prefix}hostname/{r}", timeout=timeout).decode()
            if r == launch.world_size - 1:
                _stage("met")  # every rank has reached the store
            if other != host:
                store.set(f"{prefix}region", b"")
                raise Unsupported(f"the host backend needs every rank on one machine; rank {r} runs on {other!r}, "
                                  f"rank 0 on {host!r}")
        impl = _C.HostComm(0, launch.world_size, float(timeout))
        _stage("created")
        pid, fd, t0, t1 = impl.handle
        store.set(f"{prefix}region", json.dumps({"pid": pid, "fd": fd, "token": [t0, t1]}).encode())
    else:
        raw = store.get(f"{prefix}region", timeout=timeout)
        if not raw:
            raise Unsupported("the host backend needs every rank on one machine (rank 0 found ranks on other hosts)")
        handle = _parse_handle(raw)
        try:
            impl = _C.HostComm(launch.rank, launch.world_size, float(timeout), handle)
        except SystemError:
            if pid_exited(handle[0]):
                raise CollectiveTimeout(f"rank 0 exited before this rank could attach to the host backend's region "
                                        f"(its process {handle[0]} is gone)", ranks=(0,)) from None
            raise
    _stage("attached")
    # Every rank attached before rank 0 lets go of the region's descriptor. Through the store where it has a
    # barrier: gpucoll's server notices a rank whose connection closed (it died) and names it at once;
    # wait_attached then only confirms (and is the whole wait over a store without one).
    barrier = getattr(store, "barrier", None)
    if barrier is not None:
        barrier(f"{prefix}attached", launch.world_size, timeout=timeout, rank=launch.rank)
    impl.wait_attached()
    _stage("ready")
    return impl
