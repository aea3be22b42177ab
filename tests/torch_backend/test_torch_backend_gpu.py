"""The torch.distributed backend "gpucoll" on CUDA tensors (every test is @pytest.mark.gpu: skipped where no GPU is
usable). The CPU tests (tests/torch_backend/test_torch_backend.py, test_ddp.py) check the same operations against gloo
on CPU tensors; here the inputs move to the GPU and run on gpucoll's NCCL backend, and the reference is gloo on the
same values on CPU (exact: integer-valued inputs), and, where torch's NCCL can run the ranks (one GPU each), NCCL on
the same CUDA inputs too (AVG and PREMUL_SUM, which gloo lacks, are checked against the rule NCCL follows).

Two ranks: on two GPUs, or sharing one with NCCL's multi-rank mode (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1;
skipped with the reason otherwise).
"""

from __future__ import annotations

import pytest
import torch_ranks

from gpucoll import _C

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_C.build_info().get("cuda_emulated")),
                       reason="torch CUDA tensors need a real GPU (torch cannot allocate on gpucoll's emulated CUDA "
                              "device)"),
]

N_RANKS = 2


def _ranks_available() -> str | None:
    from gpucoll import _nccl

    count = int(_C.cuda_probe()["device_count"])
    if count >= N_RANKS:
        return None
    version = int(_nccl.load().get("version") or 0)
    if not _C.nccl_multi_rank_gpu_supported(version):
        return f"one GPU and NCCL {version} < 2.30: two ranks cannot share it (NCCL_MULTI_RANK_GPU_ENABLE)"
    return None


def _env() -> dict:
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if int(_C.cuda_probe()["device_count"]) < N_RANKS else {}


def _skip_unless_ranks():
    why = _ranks_available()
    if why:
        pytest.skip(why)


def _vals(shape, dtype, rank, seed, op="SUM", k=0):
    """Input `k` (its place among the tensors of one call) of `rank`: the tensors of a call differ from each other."""
    import torch

    g = torch.Generator().manual_seed((seed * 64 + k) * 1009 + rank)
    if op == "PRODUCT":
        x = torch.tensor([1, 2, -1, -2])[torch.randint(0, 4, shape, generator=g)]
    else:
        x = torch.randint(0 if dtype == torch.uint8 else -8, 9, shape, generator=g)
    return x.to(dtype)


def _ops_worker(rank, n):
    import torch
    import torch.distributed as dist

    from gpucoll.errors import InvalidArgument, Unsupported

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    R = dist.ReduceOp
    gc = dist.new_group(backend="gpucoll")
    # torch's NCCL needs a GPU per rank (it refuses two ranks on one GPU before NCCL 2.30)
    gn = dist.new_group(backend="nccl") if dist.is_nccl_available() and torch.cuda.device_count() >= n else None
    failures = []
    seed = [0]
    calls = [0]  # inp() calls so far in this run of a check's function: the k of the next tensor

    def run(fn, *args):
        calls[0] = 0
        return fn(*args)

    def check(name, fn):
        """fn(group, device) -> list of tensors: gpucoll on CUDA against gloo on CPU (and NCCL), same inputs."""
        seed[0] += 1
        try:
            got = [t.cpu() for t in run(fn, gc, dev)]
            torch.cuda.synchronize()
            refs = [("gloo", run(fn, dist.group.WORLD, torch.device("cpu")))]
            if gn is not None:
                refs.append(("nccl", [t.cpu() for t in run(fn, gn, dev)]))
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name}: {type(e).__name__}: {e}")
            return
        for ref, want in refs:
            if len(got) != len(want):
                failures.append(f"{name}: {len(got)} outputs, {ref} {len(want)}")
            for i, (a, b) in enumerate(zip(got, want)):
                if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                    failures.append(f"{name}: output {i} differs from {ref}'s: {a.flatten()[:6].tolist()} vs "
                                    f"{b.flatten()[:6].tolist()}")

    def inp(shape, dtype, device, op="SUM", r=None, k=None):
        if k is None:
            k, calls[0] = calls[0], calls[0] + 1
        return _vals(shape, dtype, rank if r is None else r, seed[0], op, k).to(device)

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            for async_op in (False, True):
                def f(g, d, dtype=dtype, op=op, async_op=async_op):
                    x = inp((5, 7), dtype, d, op)
                    w = dist.all_reduce(x, op=getattr(R, op), group=g, async_op=async_op)
                    if async_op:
                        w.wait()
                    return [x]
                check(f"all_reduce {dtype} {op} async={async_op}", f)

    def f(g, d):
        x = inp((64,), torch.float32, d)
        if d.type == "cuda":
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5), group=g)
        else:
            x = sum(inp((64,), torch.float32, d, r=r, k=0) * 0.5 for r in range(n))
        return [x]
    check("all_reduce PREMUL_SUM", f)

    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64):
        def f(g, d, dtype=dtype):
            x = inp((5, 7), dtype, d)
            if d.type == "cuda":
                dist.all_reduce(x, op=R.AVG, group=g)
            else:  # gloo has no AVG: the sum divided by n (integers truncate toward zero, as NCCL's AVG does)
                dist.all_reduce(x, group=g)
                x = x / n if x.is_floating_point() else torch.div(x, n, rounding_mode="trunc")
            return [x]
        check(f"all_reduce {dtype} AVG", f)

    def f(g, d):
        ts = [inp((3, 4), torch.int64, d), inp((5,), torch.int64, d)]
        dist.all_reduce_coalesced(ts, group=g)
        return ts
    check("all_reduce_coalesced", f)

    for root in range(n):
        def f(g, d, root=root):
            x = inp((9,), torch.float64, d)
            dist.broadcast(x, root, group=g)
            y = inp((11,), torch.int32, d)
            dist.reduce(y, root, group=g)
            return [x] + ([y] if rank == root else [])
        check(f"broadcast/reduce root={root}", f)

        def f(g, d, root=root):
            outs = [torch.zeros(3, device=d) for _ in range(n)] if rank == root else None
            dist.gather(inp((3,), torch.float32, d), outs, dst=root, group=g)
            y = torch.zeros(2, dtype=torch.int64, device=d)
            dist.scatter(y, [inp((2,), torch.int64, d) + j for j in range(n)] if rank == root else None, src=root,
                         group=g)
            return (outs or []) + [y]
        check(f"gather/scatter root={root}", f)

    def f(g, d):
        outs = [torch.zeros(2, 3, dtype=torch.bfloat16, device=d) for _ in range(n)]
        dist.all_gather(outs, inp((2, 3), torch.bfloat16, d), group=g)
        out = torch.zeros(n * 4, dtype=torch.int64, device=d)
        dist.all_gather_into_tensor(out, inp((4,), torch.int64, d), group=g)
        return outs + [out]
    check("all_gather", f)

    def f(g, d):
        y = torch.zeros(4, dtype=torch.int32, device=d)
        dist.reduce_scatter(y, [inp((4,), torch.int32, d) + r for r in range(n)], group=g)
        z = torch.zeros(3, device=d)
        dist.reduce_scatter_tensor(z, inp((n * 3,), torch.float32, d), op=R.MAX, group=g)
        return [y, z]
    check("reduce_scatter", f)

    def f(g, d):
        out = torch.zeros(n * 2, 3, device=d)
        dist.all_to_all_single(out, inp((n * 2, 3), torch.float32, d), group=g)
        ins, outs = [rank + j + 1 for j in range(n)], [j + rank + 1 for j in range(n)]
        uneven = torch.zeros(sum(outs), device=d)
        dist.all_to_all_single(uneven, inp((sum(ins),), torch.float32, d), outs, ins, group=g)
        return [out, uneven]
    check("all_to_all_single", f)

    def f(g, d):
        r = torch.zeros(1000, device=d)
        req = dist.isend(inp((1000,), torch.float32, d), (rank + 1) % n, group=g)
        dist.recv(r, (rank - 1) % n, group=g)
        req.wait()
        return [r]
    check("isend + recv", f)

    # a CUDA Work: wait orders the current stream, get_future is a CUDA future holding the outputs
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    w = dist.all_reduce(x, group=gc, async_op=True)
    vals = w.get_future().wait()
    if not (isinstance(vals, list) and vals[0] is x and float(x[0]) == n * (n + 1) / 2):
        failures.append(f"async CUDA all_reduce future: {vals!r:.200}")
    torch.cuda.synchronize()
    if not w.is_completed():
        failures.append("CUDA Work not completed after synchronize")
    dist.barrier(group=gc)

    # bad input: gpucoll's typed error on every rank, before anything is enqueued; the group stays usable
    bad = [
        ("BAND", Unsupported,
         lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32, device=dev), op=R.BAND, group=gc)),
        ("bool all_reduce", Unsupported,
         lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool, device=dev), group=gc)),
        ("PREMUL_SUM on ints", Unsupported,
         lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32, device=dev), op=dist._make_nccl_premul_sum(2.0),
                                 group=gc)),
        ("all_gather_into_tensor sizes", InvalidArgument,
         lambda: dist.all_gather_into_tensor(torch.zeros(n * 3 + 1, device=dev), torch.ones(3, device=dev),
                                             group=gc)),
        ("reduce_scatter_tensor sizes", InvalidArgument,
         lambda: dist.reduce_scatter_tensor(torch.zeros(3, device=dev), torch.ones(n * 3 - 1, device=dev),
                                            group=gc)),
        ("CPU outputs for a CUDA input", InvalidArgument,
         lambda: dist.all_gather([torch.zeros(2) for _ in range(n)], torch.ones(2, device=dev), group=gc)),
    ]
    for name, exc, call in bad:
        try:
            call()
            failures.append(f"bad input {name} on CUDA: no error")
        except exc:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"bad input {name} on CUDA: {type(e).__name__} instead of {exc.__name__}: {e}")
        x = torch.ones(4, dtype=torch.int64, device=dev)
        dist.all_reduce(x, group=gc)
        if x.tolist() != [n] * 4:
            failures.append(f"after bad input {name}: all_reduce gave {x.tolist()}")
    return failures


@pytest.mark.gpu
def test_ops_on_cuda_match_gloo():
    _skip_unless_ranks()
    res = torch_ranks.run(_ops_worker, N_RANKS, env=_env(), timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(res) for f in fs]
    assert not failures, "\n".join(failures)


def _ddp_worker(rank, n, mode):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpucoll.torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if mode == "mixed":
        # device_id= as torch's docs now advise: torch asks the cuda backend whether it splits (gpucoll: no)
        dist.init_process_group("cpu:gloo,cuda:gpucoll", device_id=dev)

    def train(group=None, hook=None):
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
        ddp = DDP(model, device_ids=[dev.index], process_group=group, bucket_cap_mb=0.005)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(7 + rank)
        for _ in range(50):
            x, y = torch.randn(16, 32, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()]

    if mode == "mixed":
        out = {"gpucoll_default": train()}
        dist.destroy_process_group()
        return out
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {"gloo": train(), "gpucoll_group": train(group=dist.new_group(backend="gpucoll")),
           "allreduce_hook": train(hook=gpucoll.torch.allreduce_hook),
           "fp16_gloo": train(hook=default_hooks.fp16_compress_hook),
           "fp16_hook": train(hook=gpucoll.torch.fp16_compress_hook),
           "bf16_gloo": train(hook=_torch_bf16_hook),
           "bf16_hook": train(hook=gpucoll.torch.bf16_compress_hook)}
    if dist.is_nccl_available() and torch.cuda.device_count() >= n:  # torch's NCCL: a GPU per rank
        out["nccl"] = train(group=dist.new_group(backend="nccl"))
    return out


def _torch_bf16_hook(state, bucket):
    """torch's bf16_compress_hook under another name (DDP checks the name against torch's CUDA/NCCL build)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


@pytest.mark.gpu
def test_ddp_on_cuda_matches_gloo():
    import torch

    _skip_unless_ranks()
    res = torch_ranks.run(_ddp_worker, N_RANKS, "gloo", env=_env(), timeout=300)
    mixed = torch_ranks.run(_ddp_worker, N_RANKS, "mixed", backend=None, env=_env(), timeout=300)
    pairs = [("gpucoll_group", "gloo"), ("allreduce_hook", "gloo"), ("gpucoll_default", "gloo"),
             ("fp16_hook", "fp16_gloo"), ("bf16_hook", "bf16_gloo")]
    if "nccl" in res[0]:
        pairs += [("gpucoll_group", "nccl"), ("gpucoll_default", "nccl")]
    for r in range(N_RANKS):
        res[r].update(mixed[r])
        for name, ref in pairs:
            for i, (a, b) in enumerate(zip(res[r][name], res[r][ref])):
                assert torch.allclose(a, b, rtol=0, atol=1e-6), f"{name} vs {ref}: rank {r} parameter {i}"
            for a, b in zip(res[r][name], res[0][name]):
                assert torch.equal(a, b), f"{name}: rank {r} differs from rank 0"
