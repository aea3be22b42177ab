"""What the NCCL GPU tests run inside their ranks (tests/nccl/test_nccl_gpu.py), on a GPU or on gpucoll's emulated
device: CUDA arrays from several providers, NCCL's arithmetic as a reference, and the battery of collectives.

Arrays. ``gpucoll.testing.DeviceArray`` works everywhere a CUDA build runs (the emulated device included); torch and
CuPy CUDA arrays only on a real GPU. Every output is pre-filled with a sentinel byte, so an element a collective
fails to write shows.

Reference. Inputs are integer-valued (tests/support/helpers.py), so reductions are exact and independent of the order in
which NCCL combines ranks. Where NCCL rounds by definition, the reference does the same rounding: ncclAvg on
floating types is a pre-multiplied sum (each input times 1/nranks in the element type, then summed); at a world
size that is not a power of two every rank holds the same values for avg, so the rounded result does not depend on
the order either. fp8 values are small integers whose pairwise sums are exact; NCCL computes fp8 through half.

This module imports only NumPy, helpers and gpucoll at module level (spawned ranks import it cheaply).
"""

from __future__ import annotations

import helpers
import numpy as np

import gpucoll
from gpucoll.backends.premul import PreMulSum

FP8 = ("float8_e4m3fn", "float8_e5m2")
N = 96  # elements per rank-block: divisible by 1, 2, 3, 4 and 8
SENTINEL = 0xA5  # the byte every output is filled with before the collective that must overwrite it
PROVIDERS = ("device_array", "torch", "cupy")


# -- fp8 in NumPy (no NumPy type): code <-> value tables ----------------------------------------------------------

def _fp8_values(dtype: str) -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    if dtype == "float8_e4m3fn":
        e, m = (codes >> 3) & 0xF, codes & 0x7
        v = np.where(e == 0, m * 2.0**-9, (8 + m) * np.exp2(e - 10.0))
        v[(codes & 0x7F) == 0x7F] = np.nan
    else:
        e, m = (codes >> 2) & 0x1F, codes & 0x3
        v = np.where(e == 0, m * 2.0**-16, (4 + m) * np.exp2(e - 17.0))
        v[e == 31] = np.where(m[e == 31] == 0, np.inf, np.nan)
    return sign * v


_FP8_TABLES = {d: _fp8_values(d) for d in FP8}


def fp8_encode(values, dtype: str) -> np.ndarray:
    """Round to the nearest fp8 value, ties to even, saturating to the largest finite one (NCCL's __NV_SATFINITE)."""
    table = _FP8_TABLES[dtype]
    pos = table[:0x80]
    finite = np.flatnonzero(np.isfinite(pos))
    vals = pos[finite]  # increasing with the code
    x = np.asarray(values, np.float64).reshape(-1)
    a = np.minimum(np.abs(x), vals[-1])
    hi = np.clip(np.searchsorted(vals, a), 0, len(vals) - 1)
    lo = np.clip(hi - 1, 0, len(vals) - 1)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(finite[lo] % 2 == 0, lo, hi)))
    codes = finite[pick].astype(np.uint8)
    return np.where(np.signbit(x), codes | 0x80, codes).astype(np.uint8).reshape(np.shape(values))


def fp8_decode(bits, dtype: str) -> np.ndarray:
    return _FP8_TABLES[dtype][np.asarray(bits, np.uint8)].astype(np.float32)


# -- NCCL's arithmetic where it rounds ------------------------------------------------------------------------------

def _round(dtype: str, v):
    v = np.asarray(v, np.float64)
    if dtype == "float16":
        return np.asarray(v.astype(np.float16), np.float64)
    if dtype == "bfloat16":
        return helpers.round_to_precision(v, 8)
    if dtype == "float32":
        return np.asarray(v.astype(np.float32), np.float64)
    if dtype in FP8:  # the operation rounds to half, the conversion back to fp8
        return fp8_decode(fp8_encode(v.astype(np.float16).astype(np.float64), dtype), dtype).astype(np.float64)
    return v


def _avg_scalar(dtype: str, world: int) -> float:
    if dtype == "float64":
        return 1.0 / world
    f = float(np.float32(1.0 / world))  # float(1.0 / nRanks), then to the element type
    if dtype in FP8:
        return float(fp8_decode(fp8_encode(f, dtype), dtype))
    return float(_round(dtype, f))


def _is_pow2(n: int) -> bool:
    return n & (n - 1) == 0


def make(dtype: str, op, count: int, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s input (values; bfloat16 and fp8 as exactly representable float32)."""
    # premul_sum(0.5) takes sum's ranges: half of each exact integer, every partial sum exact (avg's inputs are
    # world_size times larger, made for avg's own pre-multiplication).
    name = "sum" if isinstance(op, PreMulSum) else op
    if dtype in FP8:
        rng = np.random.default_rng([rank if name != "avg" or _is_pow2(world) else 0, count, world, len(name)])
        if name == "prod":
            return rng.choice(np.array([-2.0, -1.0, 1.0, 2.0], np.float32), size=count)
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), count)
        return rng.integers(1, 4, size=count).astype(np.float32) * sign
    if op == "avg" and dtype in helpers.FLOAT_DTYPES and not _is_pow2(world):
        rank = 0  # the same values on every rank: NCCL's rounded pre-multiplied sum is then order-independent
    return helpers.make_input(dtype, name, count, rank, world, seed=11)


def reference(inputs, dtype: str, op) -> np.ndarray:
    """The reduction NCCL computes, as `dtype` values (float32 for bfloat16 and fp8)."""
    W = len(inputs)
    if isinstance(op, PreMulSum):
        if dtype in FP8:
            return _fp8_reduce(inputs, dtype, "sum", float(op.scalar))
        if dtype in helpers.INT_DTYPES:  # wrapping integer arithmetic, as the device's
            return helpers.reference([np.asarray(a) * np.asarray(op.scalar).astype(a.dtype) for a in inputs], dtype,
                                     "sum")
        acc = sum(np.asarray(a, np.float64) * op.scalar for a in inputs)  # exact: 0.5 times small integers
        return acc.astype(np.float32 if dtype == "bfloat16" else helpers.np_dtype(dtype))
    if dtype in FP8:
        return _fp8_reduce(inputs, dtype, op, _avg_scalar(dtype, W) if op == "avg" else None)
    if op == "avg" and dtype in helpers.FLOAT_DTYPES and not _is_pow2(W):
        s = _avg_scalar(dtype, W)
        y = _round(dtype, np.asarray(inputs[0], np.float64) * s)
        acc = y
        for _ in range(W - 1):
            acc = _round(dtype, acc + y)
        return acc.astype(np.float32 if dtype == "bfloat16" else helpers.np_dtype(dtype))
    return helpers.reference(inputs, dtype, op)


def _fp8_reduce(inputs, dtype: str, op: str, scalar) -> np.ndarray:
    xs = [np.asarray(a, np.float64) for a in inputs]
    if scalar is not None:
        xs = [_round(dtype, x * scalar) for x in xs]
    acc = xs[0]
    for x in xs[1:]:
        if op in ("sum", "avg"):
            acc = _round(dtype, acc + x)
        elif op == "prod":
            acc = _round(dtype, acc * x)
        else:
            acc = (np.minimum if op == "min" else np.maximum)(acc, x)
    return acc.astype(np.float32)


def premul_for(dtype: str):
    """Floats (fp8 too): 0.5 keeps integer inputs exact. Integers: -1 (1 for uint8) keeps them in range."""
    if dtype in helpers.FLOAT_DTYPES or dtype in FP8:
        return gpucoll.premul_sum(0.5)
    return gpucoll.premul_sum(1 if dtype == "uint8" else -1)


def op_name(op) -> str:
    return "premul" if isinstance(op, PreMulSum) else op


# -- arrays -----------------------------------------------------------------------------------------------------------

class Arrays:
    """CUDA arrays of one provider on one device: upload, download, sentinel-filled outputs, a caller stream."""

    def __init__(self, kind: str, device: int):
        self.kind, self.device = kind, device
        if kind == "torch":
            import torch

            torch.cuda.set_device(device)
            self._torch = torch
        elif kind == "cupy":
            import cupy

            self._cupy = cupy
            cupy.cuda.Device(device).use()

    def unsupported(self, dtype: str) -> str | None:
        if self.kind == "cupy" and (dtype == "bfloat16" or dtype in FP8):
            return f"CuPy has no {dtype}"
        return None

    def put(self, values: np.ndarray, dtype: str):
        values = np.ascontiguousarray(values)
        if self.kind == "device_array":
            from gpucoll.testing import DeviceArray

            if dtype in FP8:
                return DeviceArray.from_host(fp8_encode(values, dtype), dtype=dtype, device=self.device)
            return DeviceArray.from_host(values, dtype=dtype, device=self.device)
        if self.kind == "torch":
            torch = self._torch
            if dtype == "bfloat16" or dtype in FP8:
                t = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(f"cuda:{self.device}")
                return t.to(getattr(torch, dtype))
            return torch.from_numpy(values).to(f"cuda:{self.device}")
        return self._cupy.asarray(values)

    def get(self, x, dtype: str) -> np.ndarray:
        """Values on the host after the work queued on the caller's stream (float32 for bfloat16 and fp8)."""
        if self.kind == "device_array":
            raw = x.to_host()
            return fp8_decode(raw, dtype) if dtype in FP8 else raw
        if self.kind == "torch":
            torch = self._torch
            if dtype == "bfloat16" or dtype in FP8:
                return x.to(torch.float32).cpu().numpy()
            return x.cpu().numpy()
        return self._cupy.asnumpy(x)

    def empty(self, n: int, dtype: str):
        """n elements, every byte SENTINEL."""
        if self.kind == "device_array":
            from gpucoll.testing import DeviceArray

            x = DeviceArray(n, dtype, self.device)
            x.fill_bytes(SENTINEL)
            return x
        if self.kind == "torch":
            torch = self._torch
            t = torch.empty(n, dtype=getattr(torch, dtype), device=f"cuda:{self.device}")
            t.view(torch.uint8).fill_(SENTINEL)
            return t
        cupy = self._cupy
        a = cupy.empty(n, dtype=dtype)
        a.view(cupy.uint8).fill(SENTINEL)
        return a

    def copy(self, x):
        if self.kind == "device_array":
            y = x.empty_like()
            y.copy_(x)
            return y
        return x.clone() if self.kind == "torch" else x.copy()

    def sentinel_like(self, dtype: str, n: int) -> np.ndarray:
        """What an untouched output of n elements reads as."""
        raw = np.full(n * np.dtype(_storage(dtype)).itemsize, SENTINEL, np.uint8).view(_storage(dtype))
        if dtype in FP8:
            return fp8_decode(raw, dtype)
        if dtype == "bfloat16":
            return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return raw

    def synchronize(self) -> None:
        if self.kind == "torch":
            self._torch.cuda.synchronize()
        elif self.kind == "cupy":
            self._cupy.cuda.Device(self.device).synchronize()


def _storage(dtype: str):
    return {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}.get(dtype, dtype)


def check(got: np.ndarray, want: np.ndarray, what: str, failures: list) -> None:
    msg = helpers.compare_exact(np.asarray(got).reshape(-1), np.asarray(want).reshape(-1))
    if msg:
        failures.append(f"{what}: {msg}")


# -- the battery --------------------------------------------------------------------------------------------------

def reductions(comm, A: Arrays, dtype: str, op, failures: list) -> None:
    """all_reduce (in place and out=), reduce_scatter, reduce onto every root (out= on every rank: untouched but on
    root), each output sentinel-filled, against NCCL's arithmetic."""
    W, r = comm.world_size, comm.rank
    inputs = [make(dtype, op, W * N, q, W) for q in range(W)]
    want = reference(inputs, dtype, op)
    tag = f"{dtype}/{op_name(op)}"
    x = A.put(inputs[r], dtype)
    y = A.copy(x)
    comm.all_reduce(y, op=op)
    check(A.get(y, dtype), want, f"all_reduce in place {tag}", failures)
    out = A.empty(W * N, dtype)
    comm.all_reduce(x, out=out, op=op)
    check(A.get(out, dtype), want, f"all_reduce out= {tag}", failures)
    check(A.get(x, dtype), inputs[r], f"all_reduce out= left x {tag}", failures)
    out = A.empty(N, dtype)
    comm.reduce_scatter(x, out=out, op=op)
    check(A.get(out, dtype), want.reshape(W, N)[r], f"reduce_scatter {tag}", failures)
    for root in range(W):
        out = A.empty(W * N, dtype)
        comm.reduce(x, out=out, op=op, root=root)
        expect = want if r == root else A.sentinel_like(dtype, W * N)
        check(A.get(out, dtype), expect, f"reduce root={root} {tag}", failures)


def movement(comm, A: Arrays, dtype: str, failures: list, native: bool = True) -> None:
    """all_gather, all_to_all, and broadcast/gather/scatter from every root, bit for bit."""
    W, r = comm.world_size, comm.rank
    inputs = [make(dtype, "max", W * N, q, W) for q in range(W)]
    tag = f"{dtype}{'' if native else ' (grouped send/recv)'}"
    x = A.put(inputs[r], dtype)
    out = A.empty(W * W * N, dtype)
    comm.all_gather(x, out=out)
    check(A.get(out, dtype), np.concatenate(inputs), f"all_gather {tag}", failures)
    out = A.empty(W * N, dtype)
    comm.all_to_all(x, out=out)
    want = np.concatenate([inputs[q].reshape(W, N)[r] for q in range(W)])
    check(A.get(out, dtype), want, f"all_to_all {tag}", failures)
    for root in range(W):
        b = A.copy(x)
        comm.broadcast(b, root=root)
        check(A.get(b, dtype), inputs[root], f"broadcast root={root} {tag}", failures)
        out = A.empty(W * W * N, dtype)
        comm.gather(x, out=out, root=root)
        want = np.concatenate(inputs) if r == root else A.sentinel_like(dtype, W * W * N)
        check(A.get(out, dtype), want, f"gather root={root} {tag}", failures)
        out = A.empty(N, dtype)
        comm.scatter(x, out=out, root=root)
        check(A.get(out, dtype), inputs[root].reshape(W, N)[r], f"scatter root={root} {tag}", failures)


def p2p(comm, A: Arrays, failures: list) -> None:
    """A ring in one group (each rank sends to the next and receives from the previous: without NCCL's group
    semantics every rank would wait in its send), then pairwise exchanges of distinct sizes."""
    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    mine = A.put(np.arange(1000, dtype=np.int32) + 1000 * r, "int32")
    got = A.empty(1000, "int32")
    with comm.group():
        comm.send(mine, nxt)
        comm.recv(got, prv)
    check(A.get(got, "int32"), np.arange(1000, dtype=np.int32) + 1000 * prv, "ring send/recv", failures)
    for peer in range(W):
        if peer == r:
            continue
        n = 17 + 5 * min(r, peer) + 3 * max(r, peer)  # one size per pair
        data = A.put(np.arange(n, dtype=np.float64) * (r + 1), "float64")
        back = A.empty(n, "float64")
        with comm.group():
            comm.recv(back, peer)
            comm.send(data, peer)
        check(A.get(back, "float64"), np.arange(n, dtype=np.float64) * (peer + 1), f"exchange with {peer}", failures)


def async_work(comm, A: Arrays, failures: list) -> None:
    """async_op: the Work's result, wait() ordering the caller's stream after it, is_completed, synchronize."""
    W, r = comm.world_size, comm.rank
    vals = np.arange(4 * N, dtype=np.int64) + r
    x = A.put(vals, "int64")
    out = A.empty(4 * N, "int64")
    work = comm.all_reduce(x, out=out, async_op=True)
    if not isinstance(work, gpucoll.Work) or work.result() is not out:
        failures.append(f"async all_reduce returned {work!r}")
    work.wait()
    check(A.get(out, "int64"), sum(np.arange(4 * N, dtype=np.int64) + q for q in range(W)), "async all_reduce",
          failures)
    work.synchronize()
    if not work.is_completed():
        failures.append("async all_reduce not completed after synchronize()")
    w2 = comm.all_gather(x, async_op=True)
    w2.synchronize()
    if not w2.is_completed():
        failures.append("async all_gather not completed after synchronize()")
    check(A.get(w2.result(), "int64"), np.concatenate([np.arange(4 * N, dtype=np.int64) + q for q in range(W)]),
          "async all_gather", failures)


def grouped(comm, A: Arrays, failures: list) -> None:
    """Collectives inside one group launch together at its end; a Work of the group cannot be waited for inside."""
    from gpucoll.errors import InvalidUsage

    W = comm.world_size
    a = A.put(np.arange(64, dtype=np.float32), "float32")
    b = A.put(np.arange(64, dtype=np.float32) * 2, "float32")
    with comm.group():
        comm.all_reduce(a)
        wb = comm.all_reduce(b, op="max", async_op=True)
        try:
            wb.synchronize()
            failures.append("synchronize() inside the group did not raise")
        except InvalidUsage:
            pass
    wb.synchronize()
    check(A.get(a, "float32"), np.arange(64, dtype=np.float32) * W, "group all_reduce sum", failures)
    check(A.get(b, "float32"), np.arange(64, dtype=np.float32) * 2, "group all_reduce max", failures)


def battery(comm, kind: str, dtypes, ops_for) -> dict:
    """{case: failures} for every dtype x op and the other cases, on arrays of provider `kind`."""
    A = Arrays(kind, int(comm.device.split(":")[1]))
    out: dict = {}

    def run(case, fn, *args):
        failures: list = []
        try:
            fn(*args, failures)
        except Exception as exc:  # noqa: BLE001 - reported per case; the ranks stay in step (every rank raises)
            failures.append(f"raised {type(exc).__name__}: {exc}")
        out[case] = failures

    for dtype in dtypes:
        if A.unsupported(dtype):
            out[f"reduce/{dtype}"] = ["SKIP " + A.unsupported(dtype)]
            continue
        for op in ops_for(dtype):
            run(f"reduce/{dtype}/{op_name(op)}", reductions, comm, A, dtype, op)
        run(f"move/{dtype}", movement, comm, A, dtype)
    native = getattr(comm._ops, "gpu", comm._ops).native  # gpucoll.init's backend='auto' routes through it (backends/router.py)
    native._set_prefer_native(False)  # the grouped send/recv that NCCL < 2.28 needs
    try:
        for dtype in ("float32", "int8", "bfloat16"):
            if not A.unsupported(dtype):
                run(f"grouped/{dtype}", lambda c, a, d, f: movement(c, a, d, f, native=False), comm, A, dtype)
    finally:
        native._set_prefer_native(True)
    run("p2p", p2p, comm, A)
    run("async", async_work, comm, A)
    run("group", grouped, comm, A)
    A.synchronize()
    return out
