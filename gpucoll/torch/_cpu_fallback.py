"""CPU tensors under ``init_process_group("cpu:X,cuda:gpucoll")``: find (or make) the backend torch was asked to use.

torch lets a Python ProcessGroup stand for the whole group and drops the backend it made for CPU tensors; this
module recovers it from torch's calling frame. It relies on torch internals (checked on 2.11 and 2.13): where they
differ, CPU tensors run on gpucoll's host backend (the same results on one machine), and the log says so at
warning level, since that is not what the user asked for.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from gpucoll import _log
from gpucoll.torch._call import BACKEND_NAME, _seconds


def cpu_backend_from_caller(store, rank: int, size: int, timeout, depth: int = 1):
    """For init_process_group("cpu:X,cuda:gpucoll"): the torch backend the user named for CPU tensors, or None.

    torch's _new_process_group_helper calls the creator once per device and, given a Python ProcessGroup, uses it for
    the whole group. Its locals say what the user asked for CPU tensors and hold the backend it already made for them
    when "cpu" came first. `depth` is how many frames lie between this function and torch's (the creator's)."""
    try:
        frame = sys._getframe(depth)
        config = frame.f_locals.get("backend_config")
        device = frame.f_locals.get("device")
        if config is None or device is None:
            if frame.f_code.co_name == "_new_process_group_helper":
                _log.warn("gpucoll torch backend: torch's group constructor did not show its backend map; CPU "
                          "tensors run on gpucoll's host backend")
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
            return dist.ProcessGroupGloo(dist.PrefixStore("gpucoll-cpu-gloo/", store), rank, size,
                                         timeout if isinstance(timeout, datetime.timedelta)
                                         else datetime.timedelta(seconds=_seconds(timeout)))
        _log.warn(f"gpucoll torch backend: CPU tensors were given to {cpu!r}, which gpucoll cannot reach from here; "
                  f"they run on gpucoll's host backend")
    except Exception as e:  # noqa: BLE001 - a convenience; never a reason to fail init_process_group
        _log.warn(f"gpucoll torch backend: could not find the CPU backend torch made ({e}); CPU tensors run on "
                  f"gpucoll's host backend")
    return None
