"""The collective plugins of gpucoll-bench and what they share.

nccl-tests' contract, one small file per collective (see all_reduce.py), each exporting ``TEST``, a CollTest:

  byte_counts(count, nranks[, itemsize]) -> Counts: elements sent/received per rank for a row of `count`
                                   elements, and where an in-place call's input and output sit inside the
                                   receive buffer (nccl-tests rounds per-rank blocks to 16 bytes: itemsize)
  init_data(ctx)                -> fill this rank's input (ctx.send, also in place), poison the output when it
                                   is a separate buffer, return the Expects to check
  get_bw(count, itemsize, sec, nranks) -> (algbw, busbw) in GB/s
  run(comm, send, recv, ctx)    -> one call of the collective

Adding a collective is one file here plus one line in _REGISTRY.

In place follows nccl-tests (its startColl): the input sits at recvbuf + send_inplace_offset * rank and the output
at recvbuf + recv_inplace_offset * rank, so all_gather's input is this rank's slice of its output and
reduce_scatter's output is this rank's slice of its input. A plugin's run() makes the same call in both cases;
only the views differ. Where nccl-tests does not check in place (alltoall, sendrecv), in_place_checked is False.

The data helpers below give every rank an input whose reduction is exact in every dtype and for every op,
whatever order the algorithm combines the ranks in (all partial results are exactly representable), so that
checks compare bits. Patterns repeat every period(nranks) elements, a prime, so a chunk that lands at the
wrong offset (offsets are multiples of chunk sizes, usually powers of two) does not line up with the pattern.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

_SEED = 0x6770756E  # any constant: every rank must derive the same inputs for every rank
POISON = 0xA5  # byte written to outputs before a checked call: never a value the patterns produce

# name on the command line -> module defining TEST. One line per collective.
_REGISTRY = {
    "all_reduce": "gpucoll.bench.colls.all_reduce",
    "broadcast": "gpucoll.bench.colls.broadcast",
    "reduce": "gpucoll.bench.colls.reduce",
    "all_gather": "gpucoll.bench.colls.all_gather",
    "reduce_scatter": "gpucoll.bench.colls.reduce_scatter",
    "all_to_all": "gpucoll.bench.colls.all_to_all",
    "gather": "gpucoll.bench.colls.gather",
    "scatter": "gpucoll.bench.colls.scatter",
    "sendrecv": "gpucoll.bench.colls.sendrecv",
}

OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' order for `-o all`


@dataclass(frozen=True)
class Counts:
    send: int  # elements in this rank's send buffer
    recv: int  # elements in this rank's receive buffer
    param: int  # the count argument of the call (the table's "count" column)
    # In place (nccl-tests' startColl) the input is recvbuf[send_inplace_offset * rank :][:send] and the output
    # recvbuf[recv_inplace_offset * rank :][:recv]; the receive buffer holds max(send, recv) elements.
    send_inplace_offset: int
    recv_inplace_offset: int


@dataclass(frozen=True)
class Expect:
    """`buf` (a NumPy storage view) must equal `pattern` tiled over it, starting at pattern element `offset`."""

    buf: np.ndarray
    pattern: np.ndarray
    offset: int = 0


@dataclass
class DataContext:
    """What init_data and run see of one measurement."""

    rank: int
    nranks: int
    dtype: DType
    op: str
    root: int
    algo: str
    counts: Counts
    in_place: bool
    send: np.ndarray  # host storage views (in place: both inside the receive buffer, see Counts)
    recv: np.ndarray
    # copy(dst, src) between the objects run() is given (NumPy, torch or CuPy views, maybe on a GPU): a plugin
    # that copies inside its timed call (broadcast out of place) uses this, never ctx.send/ctx.recv, which are
    # the host mirrors of a CUDA run.
    copy: Callable[[Any, Any], None] = np.copyto
    compress: str | None = None  # --compress: all_reduce's wire format


@dataclass(frozen=True)
class CollTest:
    name: str
    coll_id: int  # gpucoll's collective numbering (gpucoll._C.coll_names() order); -1: no algorithms (p2p)
    reduces: bool  # False: the redop column reads "none" and -o is ignored
    rooted: bool  # False: the root column reads -1 and -r is ignored
    byte_counts: Callable[[int, int], Counts]
    init_data: Callable[[DataContext], list[Expect]]
    get_bw: Callable[[int, int, float, int], tuple[float, float]]
    run: Callable[[Any, Any, Any, DataContext], Any]
    in_place_checked: bool = True  # False: in place is timed but #wrong reads N/A (nccl-tests' reportErrors 0)
    min_ranks: int = 1

    def counts(self, count: int, nranks: int, itemsize: int) -> Counts:
        """byte_counts, given the element size when the plugin takes it."""
        if len(inspect.signature(self.byte_counts).parameters) >= 3:
            return self.byte_counts(count, nranks, itemsize)
        return self.byte_counts(count, nranks)


def names() -> list[str]:
    return list(_REGISTRY)


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def canonical(name: str) -> str:
    """A collective's registered name from any spelling people use: all_gather, allgather, all-gather, and
    nccl-tests' binary names (all_gather_perf, alltoall_perf). Unknown names come back unchanged."""
    text = name.strip().lower()
    text = text.removesuffix("_perf")
    by_key = {_key(n): n for n in _REGISTRY}
    return by_key.get(_key(text), name)


def get(name: str) -> CollTest:
    return importlib.import_module(_REGISTRY[name]).TEST


# -- dtypes ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DType:
    name: str  # nccl-tests' name, printed in the type column
    gpucoll: str  # gpucoll's dtype name
    storage: str  # NumPy dtype holding the bits (bfloat16: uint16)
    kind: str  # "f" floating, "i" signed, "u" unsigned
    exact: int  # integers of magnitude <= exact are representable, and sums up to it do not wrap

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage).itemsize

    def to_storage(self, values: np.ndarray) -> np.ndarray:
        """int64/float64 values -> this dtype's bits (integers wrap, floats round to nearest even)."""
        if self.name == "bfloat16":
            bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return values.astype(self.storage)

    def round(self, values: np.ndarray) -> np.ndarray:
        """float64 values rounded to this floating dtype (to nearest even), as float64."""
        if self.name == "bfloat16":
            return (self.to_storage(values).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return values.astype(self.storage).astype(np.float64)

    def avg_premul(self, values: np.ndarray, nranks: int) -> np.ndarray:
        """avg's pre-op on a floating dtype, as NCCL computes it (gpucoll's core/dispatch.h): each value times
        1/nranks (in double, then float32, then this dtype), rounded to this dtype. The products of the small
        integers used here are exact in float64 before that one rounding (for double, float64's rounding is the
        dtype's own)."""
        scalar = 1.0 / nranks
        if self.name != "double":
            scalar = float(self.round(np.array([float(np.float32(scalar))]))[0])
        return self.round(np.asarray(values, dtype=np.float64) * scalar)

    def wrap(self, arr: np.ndarray):
        """What the collective is given: the NumPy array, or a zero-copy torch view where NumPy has no such
        dtype (bfloat16)."""
        if self.name != "bfloat16":
            return arr
        import torch

        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)


# nccl-tests' order for `-d all` (it also has uint32/uint64/fp8, which gpucoll does not).
DTYPES = {d.name: d for d in (
    DType("int8", "int8", "int8", "i", 127),
    DType("uint8", "uint8", "uint8", "u", 255),
    DType("int32", "int32", "int32", "i", 2**31 - 1),
    DType("int64", "int64", "int64", "i", 2**63 - 1),
    DType("half", "float16", "float16", "f", 2**11),
    DType("float", "float32", "float32", "f", 2**24),
    DType("double", "float64", "float64", "f", 2**53),
    DType("bfloat16", "bfloat16", "uint16", "f", 2**8),
)}
ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float", "fp32": "float",
           "float64": "double", "fp64": "double", "bf16": "bfloat16", "long": "int64"}


def period(nranks: int) -> int:
    """Pattern length: a prime, smaller for many ranks so that the (nranks x period) matrix stays small."""
    return 65521 if nranks <= 64 else 8191 if nranks <= 512 else 1021


# Products are +-2^j with j <= _MAX_TWOS: exact in every float dtype (half's largest power of two is 2^15) and
# no int64 overflow while computing the expected value.
_MAX_TWOS = 14


@functools.lru_cache(maxsize=2)
def _values(dt: DType, op: str, nranks: int) -> np.ndarray:
    """Every rank's input, one period each, as int64 (nranks x period): small integers chosen per op so that
    the op over all ranks is exact in `dt` in any combining order. Every rank builds the whole matrix (it
    needs all of it for the expected result), so constraints may span ranks."""
    rng = np.random.default_rng([_SEED, nranks, OPS.index(op), list(DTYPES).index(dt.name)])
    shape = (nranks, period(nranks))
    unsigned = dt.kind == "u"
    if op in ("sum", "avg"):
        # Every partial sum stays within +-k*nranks <= dt.exact: exact for floats, no wrap for integers (avg
        # divides the finished sum, so a wrapped sum would change its result).
        k = max(1, min(8, dt.exact // nranks))
        vals = rng.integers(0 if unsigned else -k, k + 1, shape)
        if op == "avg" and dt.kind == "f":
            # avg on floats is a pre-multiplied sum (each input times 1/nranks, rounded): inputs nranks * y whose
            # rounded products are exactly y, so that every partial sum of them is an exact integer (others: 0).
            vals = vals * nranks
            vals[dt.avg_premul(vals, nranks) * nranks != vals] = 0
        return vals
    if op == "prod":
        # Magnitudes 1 or 2, half of them 2, but at most _MAX_TWOS twos per element over all ranks.
        twos = rng.integers(0, 2, shape).astype(bool)
        twos &= np.cumsum(twos, axis=0) <= _MAX_TWOS
        mag = np.where(twos, 2, 1)
        if unsigned:
            return mag
        return np.where(rng.integers(0, 4, shape) == 0, -mag, mag)
    return rng.integers(0 if unsigned else -100, 201 if unsigned else 101, shape)  # max, min


@functools.lru_cache(maxsize=4)
def sequence(dt: DType, nranks: int) -> np.ndarray:
    """The data of the collectives that move without reducing, one period in dt's storage: integers as far
    apart as the dtype represents exactly (about 4,000 distinct values in half, 255 in int8), so that an element
    taken from the wrong place rarely matches. A rank's share of it starts at an offset (rank * count, block
    (i, j) at (i * nranks + j) * count): a block delivered from the wrong rank or to the wrong place carries the
    pattern at another offset, which the prime period makes differ."""
    rng = np.random.default_rng([_SEED, nranks, 1000 + list(DTYPES).index(dt.name)])
    lim = min(dt.exact, 2**15 - 1)
    vals = rng.integers(0 if dt.kind == "u" else -lim, lim + 1, period(nranks))
    out = dt.to_storage(vals.astype(np.float64) if dt.kind == "f" else vals)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=16)
def poison_pattern(dt: DType) -> np.ndarray:
    """One element whose bytes are all POISON: the expected content of an output a call must not touch."""
    out = np.full(dt.itemsize, POISON, np.uint8).view(dt.storage)
    out.flags.writeable = False
    return out


def rank_input(dt: DType, op: str, rank: int, nranks: int) -> np.ndarray:
    """Rank `rank`'s input pattern in dt's storage."""
    return _storage_matrix(dt, op, nranks)[rank]


@functools.lru_cache(maxsize=2)
def _storage_matrix(dt: DType, op: str, nranks: int) -> np.ndarray:
    out = dt.to_storage(_values(dt, op, nranks))
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def reduced_input(dt: DType, op: str, nranks: int) -> np.ndarray:
    """The op over every rank's input, one period, as the result's bits; avg follows gpucoll/NCCL: floats sum
    the inputs pre-multiplied by 1/nranks (their inputs make that exactly the sum divided by nranks), integers
    divide the sum truncating toward zero."""
    vals = _values(dt, op, nranks)
    if op == "sum":
        res = vals.sum(axis=0)
    elif op == "prod":
        res = vals.prod(axis=0)
    elif op == "max":
        res = vals.max(axis=0)
    elif op == "min":
        res = vals.min(axis=0)
    else:
        s = vals.sum(axis=0)
        res = s / nranks if dt.kind == "f" else np.sign(s) * (np.abs(s) // nranks)
    res = res.astype(np.float64) if dt.kind == "f" else res
    out = dt.to_storage(res)
    out.flags.writeable = False
    return out


def _rolled(pattern: np.ndarray, offset: int) -> np.ndarray:
    shift = offset % pattern.size
    return np.roll(pattern, -shift) if shift else pattern


def fill(buf: np.ndarray, pattern: np.ndarray, offset: int = 0) -> None:
    """Tile `pattern` (starting at its element `offset`) over `buf`."""
    pat = _rolled(pattern, offset)
    p = pat.size
    full = buf.size // p
    if full:
        buf[:full * p].reshape(full, p)[...] = pat
    buf[full * p:] = pat[:buf.size - full * p]


def poison(buf: np.ndarray) -> None:
    buf.view(np.uint8).fill(POISON)


def nccl_block(count: int, itemsize: int, nranks: int) -> int:
    """nccl-tests' per-rank block of the blocked collectives: count / nranks rounded down to 16 bytes."""
    return (count // nranks) & ~(max(16 // itemsize, 1) - 1)


def untouched(buf: np.ndarray, dt: DType, keep: tuple[int, int, np.ndarray, int] | None = None) -> list[Expect]:
    """Expects for an output a call must leave as it was: all poison, except `keep` = (first, count, pattern,
    offset), a range that holds the rank's own input (in place, the input lives in the output buffer)."""
    if keep is None:
        return [Expect(buf, poison_pattern(dt))]
    first, count, pattern, offset = keep
    return [Expect(buf[:first], poison_pattern(dt)), Expect(buf[first:first + count], pattern, offset),
            Expect(buf[first + count:], poison_pattern(dt))]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.itemsize}")


def count_wrong(exp: Expect) -> int:
    """Elements of exp.buf whose bits differ from the expected pattern. Compared in blocks of about 4M elements
    so that the temporaries stay small."""
    buf, pat = _bits(exp.buf), _bits(_rolled(exp.pattern, exp.offset))
    p = pat.size
    full = buf.size // p
    wrong = 0
    rows = max(1, (4 << 20) // p)
    for start in range(0, full, rows):
        stop = min(full, start + rows)
        wrong += int(np.count_nonzero(buf[start * p:stop * p].reshape(stop - start, p) != pat))
    tail = buf[full * p:]
    wrong += int(np.count_nonzero(tail != pat[:tail.size]))
    return wrong


def corrupt(buf: np.ndarray, bit: int = 0) -> None:
    """Flip bit `bit` of the middle element (for --inject-error: proves a wrong result fails the run)."""
    if buf.size:
        b = _bits(buf)
        b[buf.size // 2] ^= b.dtype.type(1 << bit)
