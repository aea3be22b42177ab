"""The torch.distributed backend "gpucoll", known to torch without ``import gpucoll.torch``.

torch calls every entry point of the group "torch.backends" at the end of ``import torch`` (torch >= 2.5, unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0); gpucoll's (pyproject.toml) is ``register`` here. It runs inside every ``import torch``
of the environment, gpucoll used or not, so it only puts the name in torch's table of backends: it imports the
``gpucoll`` package (errors and version, no native core, no NumPy) and torch.distributed, which torch has imported by
then, and nothing that touches CUDA. ``import gpucoll.torch`` itself (gpucoll's native core, 0.1-0.2 s) happens in
the first group made with backend "gpucoll", which then registers the real creator for the next ones.

An exception from an entry point makes ``import torch`` fail ("Failed to load the backend extension"), so none
leaves ``register``: without it, init_process_group("gpucoll") needs ``import gpucoll.torch`` as before.
"""

from __future__ import annotations

BACKEND_NAME = "gpucoll"


def register() -> None:
    """Registers "gpucoll" with torch.distributed; gpucoll.torch loads on first use."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
            return  # no torch.distributed in this build, or gpucoll.torch registered already
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    except Exception:  # noqa: BLE001, S110 - never break `import torch` (see the module docstring)
        pass


def _create(store, rank: int, size: int, timeout=None):
    # Deferred on purpose, the one function-level import of a gpucoll module (tests/project/import_graph.py lists it apart):
    # at `import torch`, gpucoll.torch would load the native core into every torch program.
    from gpucoll.torch import process_group

    return process_group.create(store, rank, size, timeout)
