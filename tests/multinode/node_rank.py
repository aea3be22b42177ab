"""One rank of a multi-node test (tests/multinode), started by gpucoll.testing.cluster with a launcher's variables.

    python node_rank.py MODE     prints one JSON line: {"fails": [...], ...what the mode reports}

Modes: host (every collective on the host backend, exact, across machines), topology (the merged view and the
node-aware choice), torch (gpucoll.torch's CPU tensors across machines), no_torch (the host backend without an
engine between machines), elastic (see tests/multinode/test_node_loss.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import helpers

import gpucoll

_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bfloat16")
SENTINEL = 77


def _put(x: np.ndarray, dtype: str):
    """The library's array of `dtype` for reference values `x`: NumPy, or a torch tensor for bfloat16."""
    if dtype != "bfloat16":
        return np.array(x, dtype=helpers.np_dtype(dtype), copy=True)  # never the caller's array itself
    import torch

    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)


def _get(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    import torch

    return a.to(torch.float32).numpy()


def _all_reduce_exact(comm, dtype: str, op: str, count: int, seed: int, in_place: bool) -> list:
    """all_reduce into a sentinel-filled out=, and in place where asked, against the exact reference."""
    r, n = comm.rank, comm.world_size
    inputs = [helpers.make_input(dtype, op, count, q, n, seed=seed) for q in range(n)]
    want = np.asarray(helpers.reference(inputs, dtype, op), np.float64)
    fails = []
    out = _put(np.full(count, SENTINEL), dtype)
    comm.all_reduce(_put(inputs[r], dtype), out=out, op=op)
    why = helpers.compare_exact(_get(out).astype(np.float64), want)
    if why:
        fails.append(f"all_reduce {dtype} x {count} {op} out=: {why}")
    if in_place:
        x = _put(inputs[r], dtype)
        comm.all_reduce(x, op=op)
        if not np.array_equal(_get(x).astype(np.float64), want):
            fails.append(f"all_reduce {dtype} x {count} {op} in place")
    return fails


def host(comm) -> dict:
    r, n = comm.rank, comm.world_size
    try:  # bfloat16 arrays are torch tensors (a job under MPI may run without torch)
        import torch  # noqa: F401

        bf16 = True
    except ImportError:
        bf16 = False
    fails = helpers.every_collective(comm, list(range(n)), "every_collective")
    # Sizes on both sides of the leaders' 4 KiB record (4032 bytes of result ride in it; more take gloo's
    # all-reduce) and a large one, in a few dtypes; then 1003 elements in every dtype and op.
    for dtype, count in (("float32", 1008), ("float32", 1009), ("uint8", 4032), ("uint8", 4033),
                         ("float64", 70001), ("int32", 70001), ("bfloat16", 70001), ("float16", 3000)):
        if dtype == "bfloat16" and not bf16:
            continue
        for op in helpers.OPS:
            fails += _all_reduce_exact(comm, dtype, op, count, seed=11, in_place=False)
    for dtype in _DTYPES if bf16 else _DTYPES[:-1]:
        for op in helpers.OPS:
            fails += _all_reduce_exact(comm, dtype, op, 1003, seed=7, in_place=True)
        block = [(np.arange(5 * n) % 11 + q + 1).astype(np.float64) for q in range(n)]
        got = _get(comm.reduce_scatter(_put(block[r], dtype)))
        if not np.array_equal(got, sum(block)[r * 5:(r + 1) * 5]):
            fails.append(f"reduce_scatter {dtype}")
        got = _get(comm.all_gather(_put(block[r][:3], dtype)))
        if not np.array_equal(got, np.concatenate([b[:3] for b in block])):
            fails.append(f"all_gather {dtype}")
        for root in {0, n - 1, n // 2}:
            x = _put(block[r], dtype)
            comm.broadcast(x, root=root)
            if not np.array_equal(_get(x), block[root]):
                fails.append(f"broadcast {dtype} root {root}")
    # A call that differs on one rank raises on every rank, and the communicator goes on.
    for odd, size in ((n - 1, 4), (n // 2, 4), (n - 1, 50000), (n // 2, 50000)):  # a machine's last rank, and a
        # machine's first (its leader), in the leaders' record and through gloo's all-reduce
        try:
            comm.all_reduce(np.zeros(size + 1 if r == odd else size, np.float32))
            fails.append(f"a call with another count on rank {odd} did not raise")
        except gpucoll.errors.InvalidArgument as e:
            if f"rank {odd} " not in str(e):
                fails.append(f"the mismatch error does not name rank {odd}: {e}")
        problem = helpers.still_works(comm)
        if problem:
            fails.append(problem)
    store = comm._store
    bound = getattr(store, "bound_address", None)
    return {"fails": fails, "backend": type(comm._ops).__name__, "bound": bound and list(bound)[:2], "rank": r,
            "algorithm": comm._ops.algorithm_for(0, 4096, "float32", "auto")}


def split(comm) -> dict:
    """Communicators made from one across nodes: by local rank (one rank per node: every member on another
    machine), by node (one machine each: the host backend of one machine), and a subgroup of two nodes."""
    r, n = comm.rank, comm.world_size
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    fails, kinds = [], {}
    for name, color in (("by_local_rank", r % per_node), ("by_node", r // per_node)):
        child = comm.split(color)
        members = [q for q in range(n) if (q % per_node if name == "by_local_rank" else q // per_node) == color]
        fails += helpers.every_collective(child, members, name)
        kinds[name] = type(child._ops).__name__
        child.close()
    pair = [q for q in range(n) if q // per_node in (0, n // per_node - 1)]
    child = comm.subgroup(pair)
    if child is not None:
        fails += helpers.every_collective(child, pair, "subgroup")
        kinds["subgroup"] = type(child._ops).__name__
        child.close()
    return {"fails": fails, "kinds": kinds}


def topology(comm) -> dict:
    from gpucoll import topology as topo

    local = topo.load(os.environ["TOPO_EXAMPLE"])
    merged = topo.merge_through_store(comm._store, comm.rank, comm.world_size, local, prefix="test/topo")
    nodes = merged.num_hosts
    per_node = comm.world_size // nodes
    chosen = topo.select(merged, "all_reduce", 1 << 26, nranks_per_node=per_node, nodes=nodes)
    modelled = topo.select(topo.replicate(local, nodes), "all_reduce", 1 << 26, nranks_per_node=per_node,
                           nodes=nodes)
    return {"fails": [], "hosts": merged.host_names(), "gpus": merged.num_gpus if hasattr(merged, "num_gpus")
            else None, "chosen": {k: chosen[k] for k in ("backend", "algorithm", "link_class")},
            "modelled": {k: modelled[k] for k in ("backend", "algorithm", "link_class")}}


def torch_cpu(_comm) -> dict:
    import torch
    import torch.distributed as dist

    import gpucoll.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(os.environ.get("TORCH_BACKEND", "gpucoll"))
    r, n = dist.get_rank(), dist.get_world_size()
    fails = []
    t = torch.arange(6, dtype=torch.float32) + r
    dist.all_reduce(t)
    if not torch.equal(t, torch.arange(6, dtype=torch.float32) * n + n * (n - 1) / 2):
        fails.append(f"all_reduce gave {t.tolist()}")
    outs = [torch.full((2,), -1.0) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(r)))
    if [o.tolist() for o in outs] != [[float(q)] * 2 for q in range(n)]:
        fails.append(f"all_gather gave {[o.tolist() for o in outs]}")
    b = torch.full((3,), float(r))
    dist.broadcast(b, src=n - 1)
    if b.tolist() != [float(n - 1)] * 3:
        fails.append(f"broadcast gave {b.tolist()}")
    dist.barrier()
    dist.destroy_process_group()
    return {"fails": fails}


def elastic(comm) -> dict:
    """Train a little through gpucoll.elastic.run while one node goes away at step AT: its ranks SIGKILL themselves
    (LOSE=kill), or stop and wait for the test to cut the node's cable (LOSE=cut). Survivors report when they saw
    the failure (wall clock, against the time the lost node wrote to MARK) and what they did next."""
    import signal

    from gpucoll import elastic as el

    lost_node, at, steps, how = int(os.environ["LOST_NODE"]), int(os.environ["AT"]), int(os.environ["STEPS"]), \
        os.environ["LOSE"]
    mine = int(os.environ.get("GROUP_RANK", "-1"))  # -1: a process that joins the job later
    events, sums, times = [], [], []

    def step(c, state, i):
        if i == at and mine == lost_node and c.world_size == int(os.environ["WORLD_SIZE"]):
            if c.rank == c.world_size - 1:  # the node's last rank says when
                Path(os.environ["MARK"]).write_text(str(time.time()))
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "cut":
                time.sleep(3600)  # alive, unreachable once the test cuts the cable
            if how == "flap":
                time.sleep(0.5)  # the test cuts the cable now, while the others wait for this node
            # then go on: the cable comes back 2 s after the cut
        contact = os.environ.get("CONTACT")
        if contact and c.rank == 0 and c.world_size < int(os.environ["WORLD_SIZE"]) and not Path(contact).exists():
            address, port = c.join_address()  # shrink made a new store: a newcomer meets the job there
            Path(contact + ".tmp").write_text(f"{address} {port}")
            os.rename(contact + ".tmp", contact)
            deadline = time.monotonic() + 20  # hold the job until the newcomer has asked (the next admission)
            while c.waiting_to_join() == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        x = np.full(4, float(c.rank + 1), np.float32)
        c.all_reduce(x)
        sums.append([i, c.world_size, float(x[0])])
        times.append(time.time())
        state["w"] += x[:1]

    def on_event(kind, info):
        error = info.pop("error", None)
        events.append({"kind": kind, "at": time.time(), **info, **({"error": str(error), "type": type(
            error).__name__, "ranks": list(error.ranks)} if error is not None else {})})

    admit = int(os.environ.get("ADMIT", "0"))
    if comm is None:  # the newcomer: meet the job at rank 0's store
        comm, state = el.join_run(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), step,
                                  {"w": np.zeros(1, np.float64)}, steps=steps, backend="host", timeout=30,
                                  on_event=on_event, admit_every=admit)
    else:
        comm, state = el.run(comm, step, {"w": np.zeros(1, np.float64)}, steps=steps, on_event=on_event,
                             admit_every=admit)
    return {"fails": [], "events": events, "sums": sums, "times": times, "w": state["w"].tolist(), "rank": comm.rank,
            "world_size": comm.world_size, "backend": type(comm._ops).__name__}


def no_torch(_comm) -> dict:
    raise AssertionError("not reached: init raises")


MODES = {"host": host, "split": split, "topology": topology, "torch": torch_cpu, "no_torch": no_torch, "elastic": elastic}


def main() -> None:
    mode = sys.argv[1]
    t0 = time.monotonic()
    try:
        joining = mode == "torch" or os.environ.get("JOIN") == "1"
        timeout = float(os.environ.get("T", "30"))
        if os.environ.get("UNDER_MPI") == "1":  # launched by mpiexec: meet through MPI
            from mpi4py import MPI

            comm = gpucoll.init(backend="host", timeout=timeout, mpi_comm=MPI.COMM_WORLD)
        else:
            comm = None if joining else gpucoll.init(backend="host", timeout=timeout)
        report = MODES[mode](comm)
        if comm is not None:
            comm.close()
    except Exception as e:  # noqa: BLE001 - the test reads the error
        report = {"fails": [], "error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    report["seconds"] = time.monotonic() - t0
    if os.environ.get("REPORT_DIR"):  # mpiexec merges the ranks' output streams: a file each instead
        where = Path(os.environ["REPORT_DIR"]) / f"rank{os.environ.get('PMI_RANK', '')}.json"
        where.write_text(json.dumps(report))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
