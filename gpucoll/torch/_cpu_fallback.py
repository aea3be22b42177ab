"""CPU tensors under ``init_process_group("cpu:X,cuda:gpucoll")``: find (or make) the backend torch was asked to use.

torch lets a Python ProcessGroup stand for the whole group and drops the backend it made for CPU tensors; this
module recovers it from torch's calling frame. It relies on torch internals (checked on 2.13), so every failure
falls back to gpucoll's host backend, which gives the same results on one machine.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from gpucoll import _log


def _cpu_backend_from_caller(store, rank: int, size: int, timeout):
    """For init_process_group("cpu:X,cuda:gpucoll"): the torch backend the user named for CPU tensors, or None.

    torch's _new_process_group_helper calls the creator once per device and, given a Python ProcessGroup, uses it for
    the whole group. Its locals say what the user asked for CPU tensors and hold the backend it already made for them
    when "cpu" came first. Anything unexpected (another torch version) leaves CPU tensors to gpucoll's host backend,
    which gives the same results on one machine."""
    from gpucoll.torch._call import _seconds
    from gpucoll.torch.process_group import BACKEND_NAME  # at call time: process_group imports this module

    try:
        # Two frames up: this function, process_group.create, then torch's caller of the creator.
        frame = sys._getframe(2)
        config = frame.f_locals.get("backend_config")
        device = frame.f_locals.get("device")
        if config is None or device is None:
            return None
        mapping = dict(config.get_device_backend_map())
        cpu = str(mapping.get("cpu", "")).lower()
        if not cpu or cpu == BACKEND_NAME or str(device) == "cpu":
            return None
        pg = frame.f_locals.get("pg")
        if pg is not None:
            try:
                backend = pg._get_backend(torch.device("cpu"))
                if backend is not None:
                    return backend
            except RuntimeError:
                pass  # "cpu" comes after this device in the map: not made yet
        if cpu == "gloo":
            backend = dist.ProcessGroupGloo(dist.PrefixStore("gpucoll-cpu-gloo/", store), rank, size,
                                            timeout if isinstance(timeout, datetime.timedelta)
                                            else datetime.timedelta(seconds=_seconds(timeout)))
            return backend
        _log.info(f"gpucoll torch backend: CPU tensors were given to {cpu!r}, which gpucoll cannot reach from here; "
                  f"they run on gpucoll's host backend")
    except Exception as e:  # noqa: BLE001 - a convenience; never a reason to fail init_process_group
        _log.debug(f"gpucoll torch backend: could not find the CPU backend torch made: {e}")
    return None
