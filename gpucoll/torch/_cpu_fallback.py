"""CPU tensors that gpucoll's host backend does not take: find or make the torch backend that takes them.

* ``init_process_group("cpu:X,cuda:gpucoll")``: torch lets a Python ProcessGroup stand for the whole group and drops
  the backend it made for CPU tensors; this module recovers it from torch's calling frame. It relies on torch
  internals (checked on 2.11 and 2.13): where they differ, CPU tensors run on gpucoll's host backend (the same
  results on one machine), and the log says so at warning level, since that is not what the user asked for.
* ``init_process_group("gpucoll")`` with ranks on several machines: CPU tensors go to gloo, as with
  ``cpu:gloo,cuda:gpucoll``, decided at the group's first CPU operation (machines). (gpucoll's host backend across
  machines, backends/host_nodes.py, would run them on gloo between machines too, but not through the one-call
  torch paths this package's host groups take.)
"""

from __future__ import annotations

import datetime
import json
import socket
import sys

import torch
import torch.distributed as dist

from gpucoll import _log
from gpucoll.bootstrap.external import TorchStore
from gpucoll.torch._call import BACKEND_NAME, _seconds


def cpu_backend_from_caller(store, rank: int, size: int, timeout):
    """For init_process_group("cpu:X,cuda:gpucoll"): the torch backend the user named for CPU tensors, or None.

    torch's _new_process_group_helper calls the creator once per device and, given a Python ProcessGroup, uses it for
    the whole group. Its locals say what the user asked for CPU tensors and hold the backend it already made for them
    when "cpu" came first. Its frame is the first one out of gpucoll (the creator, and the creator that the entry
    point registers and that imports gpucoll.torch on first use, lie between)."""
    try:
        frame = sys._getframe(1)
        while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("gpucoll."):
            frame = frame.f_back
        if frame is None:
            return None
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
            return gloo_group(store, rank, size, timeout)
        _log.warn(f"gpucoll torch backend: CPU tensors were given to {cpu!r}, which gpucoll cannot reach from here; "
                  f"they run on gpucoll's host backend")
    except Exception as e:  # noqa: BLE001 - a convenience; never a reason to fail init_process_group
        _log.warn(f"gpucoll torch backend: could not find the CPU backend torch made ({e}); CPU tensors run on "
                  f"gpucoll's host backend")
    return None


def gloo_group(store, rank: int, size: int, timeout):
    """A gloo backend for the group of `store` (collective: every rank of the group makes it)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("gpucoll-cpu-gloo/", store), rank, size,
                                 timeout if isinstance(timeout, datetime.timedelta)
                                 else datetime.timedelta(seconds=_seconds(timeout)))


def machines(store, rank: int, size: int, timeout: float) -> list:
    """The names of the machines the group's ranks run on, sorted; every rank gets rank 0's answer (collective).
    Machines are told apart by host name, as gpucoll's host backend does."""
    store = TorchStore(store, timeout)
    me = socket.gethostname()
    if rank != 0:
        store.set(f"host/{rank}", me.encode())
        return json.loads(store.get("machines"))
    names = sorted({me, *(store.get(f"host/{r}").decode() for r in range(1, size))})
    store.set("machines", json.dumps(names).encode())
    return names


_logged_gloo = False


def log_gloo_across_machines(names: list) -> None:
    """Says once per process that CPU tensors go to gloo, and why."""
    global _logged_gloo
    if _logged_gloo:
        return
    _logged_gloo = True
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    _log.info(f"gpucoll torch backend: the group's ranks run on {len(names)} machines ({shown}); CPU tensors go "
              f"to gloo, as with init_process_group('cpu:gloo,cuda:gpucoll')")
