"""What a rank runs in the multi-node NCCL tests (tests/multinode/test_nccl_nodes.py), launched into a node of
gpucoll.testing.cluster: gpucoll.init from the launcher's variables, then the step named on the command line. It
prints one JSON line (what it saw and every failure) and exits 0, or raises."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nccl"))

import helpers
import numpy as np

import gpucoll
from gpucoll.testing import DeviceArray


def _arrays(comm):
    dev = int(comm.device.split(":")[1])
    return (lambda a: DeviceArray.from_host(a, device=dev)), (lambda d: d.to_host())


def everything(comm) -> dict:
    """Every collective, dtype and op of the NCCL battery on the world, then each node's communicator and the
    communicator of the nodes' local rank 0s (split by node), and a subgroup of ranks 1 and 2 (on two nodes), every
    collective exact on each."""
    import nccl_ranks

    put, get = _arrays(comm)
    cases = nccl_ranks.battery(comm, "device_array", nccl_ranks_dtypes(), ops_for)
    out = {"cases": len(cases), "battery": {k: v for k, v in cases.items() if v}}
    local, nodes = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    per_node = comm.split(color=node, key=local)
    members = [q for q in range(comm.world_size) if q // int(os.environ["LOCAL_WORLD_SIZE"]) == node]
    out["node_comm"] = [per_node.rank, per_node.world_size, per_node.backend]
    out["node_fails"] = helpers.every_collective(per_node, members, "node", put=put, get=get)
    leaders = comm.split(color=0 if local == 0 else None, key=node)
    if leaders is not None:
        lm = [q * int(os.environ["LOCAL_WORLD_SIZE"]) for q in range(nodes)]
        out["leaders"] = [leaders.rank, leaders.world_size]
        out["leader_fails"] = helpers.every_collective(leaders, lm, "leaders", put=put, get=get)
    cross = comm.subgroup([1, 2])  # on different nodes in 2x2 and in 4x1
    if cross is not None:
        out["cross_fails"] = helpers.every_collective(cross, [1, 2], "subgroup [1, 2]", put=put, get=get)
    out["world_fails"] = helpers.every_collective(comm, list(range(comm.world_size)), "world", put=put, get=get)
    return out


def nccl_ranks_dtypes():
    return ("float32", "float16", "bfloat16", "int32", "int8", "uint8", "int64", "float64")


def ops_for(dtype):
    return ("sum", "prod", "min", "max", "avg") if dtype != "bfloat16" else ("sum", "max", "avg")


def loop(comm) -> dict:
    """Exact all-reduces until one raises (a fault the test strikes meanwhile) or until the file $STOP_FILE exists
    (rank 0 looks, and broadcasts its answer every 10 operations, so that every rank stops after the same one):
    what was raised, how long after the last completed operation, and which results were wrong. The operation a
    fault cuts short may return garbage before its error is raised (by the next call, as NCCL's asynchronous errors
    are): its result proves nothing."""
    put, get = _arrays(comm)
    n_elem = 1 << 16
    mine = (np.arange(n_elem) % 251 + 1000 * comm.rank).astype(np.float32)
    want = sum((np.arange(n_elem) % 251 + 1000 * q).astype(np.float32) for q in range(comm.world_size))
    flag = put(np.zeros(1, np.float32))
    print(json.dumps({"ready": comm.rank}), flush=True)
    n, t_last, fails = 0, time.monotonic(), []
    try:
        while True:
            # A fresh input each time (all_reduce works in place); to the host: the operation completed.
            if not np.array_equal(get(comm.all_reduce(put(mine))), want):
                fails.append(n)
            n, t_last = n + 1, time.monotonic()
            if n % 10 == 0:
                stop = float(comm.rank == 0 and os.path.exists(os.environ.get("STOP_FILE", "/nonexistent")))
                if get(comm.broadcast(put(np.full(1, stop, np.float32)) if comm.rank == 0 else flag, root=0))[0]:
                    return {"error": None, "fails": fails, "ops": n}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()) or ()),
                "after_s": time.monotonic() - t_last, "ops": n, "fails": fails}


def loop_then_shrink(comm) -> dict:
    """loop() until the fault, then shrink (every rank but $LOST, the lost node's, calls it: the ranks its error
    named are not waited for) and run every collective on the survivors' communicator."""
    out = loop(comm)
    lost = [int(q) for q in os.environ["LOST"].split(",")]
    if comm.rank in lost:
        return out
    t0 = time.monotonic()
    new = comm.shrink()
    put, get = _arrays(new)
    members = [q for q in range(comm.world_size) if q not in lost]
    out.update(shrunk=[new.rank, new.world_size, new.backend], shrink_s=time.monotonic() - t0,
               shrunk_fails=helpers.every_collective(new, members, "shrunk", put=put, get=get))
    return out


def main() -> None:
    step = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    t0 = time.monotonic()
    comm = gpucoll.init(timeout=timeout)
    seen = {"rank": comm.rank, "world": comm.world_size, "backend": comm.backend, "device": comm.device,
            "host": socket.gethostname(), "init_s": time.monotonic() - t0}
    seen.update(globals()[step](comm))
    print(json.dumps(seen), flush=True)
    if comm.rank == 0 and seen.get("error"):
        # Rank 0 serves the rendezvous store, as in a job that goes on (a shrink): the other survivors read the
        # heartbeats there for a while after their own error.
        time.sleep(4.0)
    os._exit(0)  # a cut peer may still be named by teardown; the result is out


if __name__ == "__main__":
    main()
