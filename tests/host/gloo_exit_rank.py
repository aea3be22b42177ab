"""The process of tests/host/test_gloo_engine_exit.py: a gloo engine of the host backend across machines
(gpucoll/backends/host_engines.py) still referenced at exit, as the traceback of a failed call keeps it. Its
process group must be destroyed while Python still runs (see _LIVE in host_engines.py), which this process checks in
an exit handler that runs after gpucoll's: handlers run in the reverse order of their registration, and this one is
registered before host_engines is imported."""

import atexit
import sys

ENGINE = None


def _after_gpucolls_exit_handlers() -> None:
    print(f"process group at exit: {'closed' if ENGINE.pg is None else 'still open'}", flush=True)


atexit.register(_after_gpucolls_exit_handlers)

from gpucoll.backends import host_engines
from gpucoll.bootstrap.store import TCPStore


def main() -> None:
    global ENGINE
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=30.0, secret=sys.argv[1])
    ENGINE = host_engines.Gloo(store, 0, 1, 30.0)
    ENGINE.barrier()
    print("ran", flush=True)


if __name__ == "__main__":
    main()
