"""Shared test utilities: exact-by-construction inputs, the NumPy reference, bit-exact comparison, shm listings.

Inputs are integer-valued (or chosen from values whose products, minima and maxima are exact), so every result
is exactly representable and independent of the reduction order. avg on floating types is NCCL's pre-multiplied
sum (each input times 1/n rounded to the dtype, then summed): its inputs are multiples of n whose products with
NCCL's 1/n round back to exact integers, so that sum is exact too. Every rank can therefore check its result
bit for bit against this reference, as nccl-tests does.

bfloat16 has no NumPy dtype: here a bf16 array is a float32 array whose values are all exactly representable in
bf16 (the low 16 bits of each float32 are zero). Tests move it into a torch tensor when torch is available.

This module imports only NumPy and the standard library, so spawned workers import it cheaply.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "uint8", "int32", "int64")

# Significand bits (with the implicit one): integers up to 2**p are exact, sums of them stay exact below that.
_PRECISION = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}

# -- optional packages --------------------------------------------------------------------------------------------
# Every test that needs a package outside gpucoll's own dependencies skips through `require` (or with
# `missing_reason`), so its reason starts with MISSING: tests/conftest.py recognises that text and, under
# --require-deps (which .ci/run sets), fails such a test instead of skipping it. torch is not in the `test` extra
# (pip would pull a CUDA build); every other package is.

MISSING = "missing package"
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
_INSTALL = {"torch": TORCH_CPU}


def have(module: str) -> bool:
    """Whether `module` can be imported (a dotted name whose parent package is missing counts as missing:
    importlib.util.find_spec raises ModuleNotFoundError for it instead of returning None)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_reason(module: str, what: str = "") -> str:
    """The skip reason for a test that cannot run without `module` (the text --require-deps turns into a failure)."""
    top = module.split(".")[0]
    install = _INSTALL.get(top, 'pip install -e ".[test]"')
    return f"{MISSING}: {module} ({install})" + (f"; {what}" if what else "")


def require(module: str, what: str = ""):
    """Import and return `module`, or skip the calling test with missing_reason(module, what)."""
    import pytest

    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(missing_reason(module, what), allow_module_level=True)


HAVE_TORCH = have("torch")
HAVE_PYTEST_TIMEOUT = have("pytest_timeout")


def np_dtype(dtype: str):
    """The NumPy dtype that holds `dtype` (bfloat16 values live in float32)."""
    return np.dtype(np.float32 if dtype == "bfloat16" else dtype)


def timeout_mark(seconds: float):
    """`pytest.mark.timeout(seconds)` when pytest-timeout is installed, else a no-op mark list."""
    import pytest

    return [pytest.mark.timeout(seconds)] if HAVE_PYTEST_TIMEOUT else []


# -- inputs ------------------------------------------------------------------------------------------------------

def _rng(seed: int, dtype: str, op: str, count: int, rank: int) -> np.random.Generator:
    return np.random.default_rng([seed, DTYPES.index(dtype), OPS.index(op), count, rank])


def _int_root(limit: int, n: int) -> int:
    """Largest b with b**n <= limit."""
    b = round(limit ** (1.0 / n))
    while b**n > limit:
        b -= 1
    while (b + 1) ** n <= limit:
        b += 1
    return b


def _to_bf16_exact(x: np.ndarray) -> np.ndarray:
    """float32 values made bf16-representable by truncating the low 16 bits (fine for min/max inputs)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def make_input(dtype: str, op: str, count: int, rank: int, world_size: int, seed: int = 0) -> np.ndarray:
    """Rank `rank`'s input for an all_reduce of `count` elements with `op` over `world_size` ranks.

    Ranges, by op:
    * sum on floats: integers with |x| <= 2**p // world_size, so every partial sum is an exact integer.
    * avg on floats: x = y * world_size with integers |y| <= 2**p // world_size for which x times NCCL's 1/n,
      rounded to the dtype, is exactly y (avg_premul); the other elements are 0. Every partial sum of the
      products is then an exact integer and the result is exactly the mean.
    * prod on floats: values in {+-0.5, +-1, +-2} and some zeros: every product is a power of two, at most
      2**world_size in magnitude.
    * min/max on floats: arbitrary finite non-zero values of the dtype (selection is always exact; zeros are
      left out because min(-0.0, 0.0) legitimately depends on the order).
    * sum/prod on int8/uint8: the full range; the results wrap modulo 256 exactly as NumPy's do (C++ computes
      8-bit products and sums in int, so the wrap is well defined there too).
    * sum/avg/prod on int32/int64: ranges in which no sum or product overflows (signed overflow is undefined in
      C++, so wrapping is not something the library can promise for them).
    * avg on int8/uint8: ranges without overflow, negative values included, so truncation toward zero shows.
    * min/max on integers: the full range.
    """
    rng = _rng(seed, dtype, op, count, rank)
    W = world_size
    if dtype in FLOAT_DTYPES:
        nd = np_dtype(dtype)
        if op in ("sum", "avg"):
            bound = 2 ** _PRECISION[dtype] // W
            small = bound < 2**31
            x = rng.integers(-bound, bound, size=count, endpoint=True, dtype=np.int32 if small else np.int64)
            if op == "avg":
                y = x.astype(np.float64)
                x = y * W  # exact: |y * W| <= 2**p
                x[avg_premul(x, dtype, W) != y] = 0.0
        elif op == "prod":
            # 100 slots: 4 zeros, 15+15 of +-0.5, 20+20 of +-1, 13+13 of +-2 (a lookup is much faster than
            # Generator.choice with weights).
            table = np.repeat(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0]), [4, 15, 15, 20, 20, 13, 13])
            x = table[rng.integers(0, 100, size=count, dtype=np.uint8)]
        else:
            scale = {"float16": 2.0**-16, "bfloat16": 2.0**-10, "float32": 2.0**-8, "float64": 2.0**8}[dtype]
            x = rng.integers(-(2**31), 2**31, size=count, dtype=np.int64) * scale
            x[x == 0] = 1.0
            if dtype == "bfloat16":
                x = _to_bf16_exact(x.astype(np.float32))
            x = x.astype(nd)
            x[x == 0] = 1
        return np.ascontiguousarray(x, dtype=nd)

    info = np.iinfo(dtype)
    if op == "prod" and dtype in ("int32", "int64"):
        b = _int_root(int(info.max), W)
        lo, hi = -b, b
    elif op in ("sum", "avg") and dtype in ("int32", "int64"):
        lo, hi = -(int(info.max) // W), int(info.max) // W
    elif op == "avg":  # int8 / uint8
        hi = int(info.max) // W
        lo = 0 if dtype == "uint8" else -hi
    else:  # full range: min/max everywhere, sum/prod on 8-bit types
        lo, hi = int(info.min), int(info.max)
    return rng.integers(lo, hi, size=count, endpoint=True, dtype=np.dtype(dtype))


# -- reference ---------------------------------------------------------------------------------------------------

def round_to_precision(x: np.ndarray, p: int) -> np.ndarray:
    """Round float64 values to `p` significand bits, to nearest with ties to even (normal range only).

    Used for bf16. A quotient a/n rounded to float64 first and then to p bits equals the correctly rounded
    quotient when 53 >= 2p + 2, which holds for every p used here."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    return np.ldexp(np.rint(m * 2.0**p), e - p)  # scaling by 2**k is exact; rint rounds half to even


def avg_scalar(dtype: str, world_size: int) -> float:
    """NCCL's 1/n for avg on a floating dtype (src/enqueue.cc): 1.0/n in double, rounded to float32, then to
    float16/bfloat16 (a double rounding NCCL does and gpucoll copies); float64 keeps 1.0/n."""
    s = 1.0 / world_size
    if dtype == "float64":
        return s
    s = float(np.float32(s))
    if dtype == "float16":
        return float(np.float16(s))
    if dtype == "bfloat16":
        return float(round_to_precision(np.array([s]), 8)[0])
    return s


def avg_premul(x: np.ndarray, dtype: str, world_size: int) -> np.ndarray:
    """Each input element times avg_scalar, rounded once to the dtype (NCCL's FuncPreMulSum pre-op), as float64.
    The product of two values of a floating dtype is exact in float64, so rounding it once is the dtype's own
    correctly rounded multiplication."""
    prod = np.asarray(x, dtype=np.float64) * avg_scalar(dtype, world_size)
    if dtype == "float64":
        return prod
    if dtype == "bfloat16":
        return round_to_precision(prod, 8)
    return prod.astype(np.dtype(dtype)).astype(np.float64)


def avg_int(total: np.ndarray, world_size: int, dtype: str) -> np.ndarray:
    """Integer avg: the (wrapped) sum divided with truncation toward zero, as C and NCCL do (not floor)."""
    s = total.astype(np.int64)
    q = np.where(s >= 0, s // world_size, -((-s) // world_size))
    return q.astype(np.dtype(dtype))


def reference(inputs: Sequence[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """The exact all_reduce result of `inputs` (one array per rank, from make_input) in `dtype` (float32 for
    bfloat16)."""
    W = len(inputs)
    if dtype in FLOAT_DTYPES:
        if op in ("sum", "avg", "prod"):
            stack = [np.asarray(a, dtype=np.float64) for a in inputs]  # every input value is exact in float64
        if op == "avg":  # NCCL's pre-multiplied sum: exact for make_input's inputs (integer products)
            stack = [avg_premul(a, dtype, W) for a in stack]
        if op in ("sum", "avg"):
            acc = stack[0].copy()
            for a in stack[1:]:
                acc += a  # exact: integers far below 2**53
        elif op == "prod":
            acc = stack[0].copy()
            for a in stack[1:]:
                acc *= a  # exact: powers of two and zeros
        else:  # min/max select one of the inputs: exact in the storage dtype itself
            acc = np.array(inputs[0], copy=True)
            for a in inputs[1:]:
                (np.minimum if op == "min" else np.maximum)(acc, a, out=acc)
            return acc
        if dtype == "bfloat16":
            return round_to_precision(acc, 8).astype(np.float32)
        return acc.astype(np.dtype(dtype))  # correctly rounded float64 -> float16/float32 conversion

    nd = np.dtype(dtype)
    acc = np.array(inputs[0], dtype=nd, copy=True)
    for a in inputs[1:]:
        if op in ("sum", "avg"):
            np.add(acc, a, out=acc)  # wraps modulo 2**bits, like the library
        elif op == "prod":
            np.multiply(acc, a, out=acc)
        elif op == "min":
            np.minimum(acc, a, out=acc)
        else:
            np.maximum(acc, a, out=acc)
    if op == "avg":
        acc = avg_int(acc, W, dtype)
    return acc


# -- comparison --------------------------------------------------------------------------------------------------

def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def bf16_bits(f32: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns of float32 values that are exactly representable in bf16."""
    u = _bits(np.asarray(f32, dtype=np.float32))
    if np.any(u & np.uint32(0xFFFF)):
        raise ValueError("values are not exactly representable in bfloat16")
    return (u >> np.uint32(16)).astype(np.uint16)


def mismatch(got_bits: np.ndarray, want_bits: np.ndarray, got_values=None, want_values=None) -> str | None:
    """None when the bit patterns are equal, else a short description of the first difference."""
    got_bits = np.asarray(got_bits).reshape(-1)
    want_bits = np.asarray(want_bits).reshape(-1)
    if got_bits.shape != want_bits.shape:
        return f"shape: got {got_bits.shape[0]} elements, expected {want_bits.shape[0]}"
    bad = np.flatnonzero(got_bits != want_bits)
    if bad.size == 0:
        return None
    i = int(bad[0])
    gv = got_values.reshape(-1)[i] if got_values is not None else got_bits[i]
    wv = want_values.reshape(-1)[i] if want_values is not None else want_bits[i]
    return f"{bad.size} of {got_bits.size} elements differ; first at [{i}]: got {gv!r}, expected {wv!r}"


def compare_exact(got: np.ndarray, want: np.ndarray) -> str | None:
    """Bit-exact comparison of two NumPy arrays of the same dtype; None when equal."""
    if got.dtype != want.dtype:
        return f"dtype: got {got.dtype}, expected {want.dtype}"
    return mismatch(_bits(got), _bits(want), np.asarray(got).reshape(-1), np.asarray(want).reshape(-1))


# -- /dev/shm ----------------------------------------------------------------------------------------------------

def shm_names(prefix: str = "gpucoll") -> set:
    """Names in /dev/shm that start with `prefix` (empty set where /dev/shm does not exist)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def format_failures(failures: list[str], limit: int = 40) -> str:
    head = "\n".join(f"  {f}" for f in failures[:limit])
    more = f"\n  ... and {len(failures) - limit} more" if len(failures) > limit else ""
    return f"{len(failures)} failure(s):\n{head}{more}"


def merge_rank_failures(per_rank: Sequence[dict[str, list[str]]], key: str) -> list[str]:
    """Failures under `key` from every rank's report dict, each prefixed with the rank."""
    out = []
    for r, report in enumerate(per_rank):
        out += [f"rank {r}: {f}" for f in report.get(key, [])]
    return out


def still_works(comm) -> str:
    """"" if a correct int64 all_reduce on `comm` gives the right answer, else what went wrong: checks that a
    communicator is usable (ranks in step) after a series of rejected calls."""
    W, r = comm.world_size, comm.rank
    x = np.arange(5, dtype=np.int64) + r
    try:
        comm.all_reduce(x)
    except Exception as exc:  # noqa: BLE001
        return f"a correct all_reduce raised {type(exc).__name__}: {exc}"
    want = np.arange(5, dtype=np.int64) * W + W * (W - 1) // 2
    return "" if np.array_equal(x, want) else f"a correct all_reduce gave {x.tolist()}, expected {want.tolist()}"


# -- the rendezvous store's wire, for hostile-peer tests ---------------------------------------------------------

def store_socket(port: int, secret: str | bytes | None = None, host: str = "127.0.0.1", timeout: float = 5.0):
    """A raw socket to a gpucoll store at port, through its handshake with `secret` (None: the session's
    GPUCOLL_STORE_SECRET): what a job member could send next is up to the test."""
    import secrets
    import socket

    from gpucoll.bootstrap import _wire as w
    from gpucoll.bootstrap.store import job_secret

    key = w.derive_key(job_secret(secret))
    s = socket.create_connection((host, port), timeout=timeout)
    hello = w._recv_exact(s, w.HELLO_BYTES)
    nonce = secrets.token_bytes(w.NONCE_BYTES)
    s.sendall(w.HELLO_MAGIC + nonce + w.client_mac(key, hello[5:], nonce))
    verdict = w._recv_exact(s, 1 + w.MAC_BYTES)
    if verdict[:1] != bytes([w.AUTH_OK]):
        raise ConnectionError(f"the store refused the handshake: {verdict[:1]!r}")
    return s


def every_collective(comm, members: list, tag: str, n: int = 1003, put=None, get=None) -> list:
    """Every collective (and a send/recv ring) on `comm`, whose rank i is global rank members[i], checked exactly
    (float32 integers derived from global ranks, so a rank in the wrong group or position shows); failures as text.
    For communicators made from others (split, subgroup, shrink). `put` makes the library's array from a NumPy one
    and `get` reads one back (default: NumPy arrays themselves; DeviceArray.from_host / .to_host on a GPU)."""
    put = put or (lambda a: a.copy())
    get = get or np.asarray
    P, r, g = comm.world_size, comm.rank, members[comm.rank]
    fails = []

    def expect(name, got, want):
        if got is None or not np.array_equal(get(got), want):
            fails.append(f"{tag}: {name} on global rank {g} (rank {r} of {P})")

    def x_of(q):
        return (np.arange(n) % 13 + members[q]).astype(np.float32)

    def blocks_of(q):
        return (np.arange(P * 5) + 100 * members[q]).astype(np.float32)

    expect("all_reduce", comm.all_reduce(put(x_of(r))), sum(x_of(q) for q in range(P)))
    root = P - 1
    expect("broadcast", comm.broadcast(put(x_of(r)), root=root), x_of(root))
    got = comm.reduce(put(x_of(r)), op="max", root=0)
    if r == 0:
        expect("reduce", got, np.max([x_of(q) for q in range(P)], axis=0))
    expect("all_gather", comm.all_gather(put(x_of(r))), np.concatenate([x_of(q) for q in range(P)]))
    expect("reduce_scatter", comm.reduce_scatter(put(blocks_of(r))),
           sum(blocks_of(q) for q in range(P))[r * 5:(r + 1) * 5])
    expect("all_to_all", comm.all_to_all(put(blocks_of(r))),
           np.concatenate([blocks_of(q)[r * 5:(r + 1) * 5] for q in range(P)]))
    got = comm.gather(put(x_of(r)), root=root)
    if r == root:
        expect("gather", got, np.concatenate([x_of(q) for q in range(P)]))
    expect("scatter", comm.scatter(put(blocks_of(0)), root=0), blocks_of(0)[r * 5:(r + 1) * 5])
    comm.barrier()
    if P > 1:
        buf = put(np.zeros(n, np.float32))
        with comm.group():
            comm.send(put(x_of(r)), (r + 1) % P)
            comm.recv(buf, (r - 1) % P)
        expect("send/recv", buf, x_of((r - 1) % P))
    return fails


def run_threads(n, fn):
    """Run fn(i) in n threads; re-raise the first failure in the test thread."""
    errors = []

    def wrap(i):
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "threads hung"
    if errors:
        raise errors[0]


_GPU_MARK = re.compile(r"^(?:pytestmark = [^\n]*|    |@)pytest\.mark\.gpu\b", re.MULTILINE)


def gpu_test_files(tests: Path) -> set:
    """The test files under `tests` that hold GPU tests (the gpu marker on the module or on a test), by path.
    tests/project is left out: the suite's own checks quote the marker in their samples."""
    return {p for p in tests.rglob("test_*.py") if p.parent.name != "project" and _GPU_MARK.search(p.read_text())}


def torch_import_error():
    """None when torch imports in this process (a spawned rank), else why not: its cases are then left out."""
    if not HAVE_TORCH:
        return missing_reason("torch")
    try:
        import torch  # noqa: F401 - imported once up front
    except Exception as exc:  # noqa: BLE001
        return f"import torch failed: {type(exc).__name__}: {exc}"
    return None
