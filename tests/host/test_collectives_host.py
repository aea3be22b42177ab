"""Every collective on the host backend, checked bit for bit on every rank against an exact NumPy reference.

The cross product (collective x algorithm x dtype x op x world size x count x root x in/out of place) is far too
big to run whole, so the case table is cut into sections that together cover every value of every axis:

* ``dtype_op``  every dtype x every op on the reducing collectives (all_reduce, reduce_scatter, reduce) at the
  small counts 1, 7, 1003; the algorithm and the root rotate through their values; in place and out of place.
* ``algos``     every collective x every algorithm that implements it at this world size (and "auto"), float32
  and one integer type (which one rotates with the world size), counts 0, 1, 7, 1003, 2-D arrays for some.
* ``roots``     every rooted collective x every algorithm x every root (at every world size), dtype/op rotating.
* ``large``     every collective with "auto" and one rotating algorithm at about 2**18 elements, so that the
  executor cuts the buffer into several pieces with a ragged last one.
* ``hier``      hierarchical (and auto) on a second communicator for every local_size that divides the world
  size (half through ``local_size=``, half through GPUCOLL_LOCAL_SIZE), every dtype and op in rotation.
* ``bad``       bad input: each mistake (made by every rank) raises a typed error naming the argument, and a
  correct all_reduce works after each one.

One gpucoll.spawn per world size (1, 2, 3, 4, 5, 8; a module-scoped fixture) runs all of that; workers return
their failures as text and the tests below only read the reports. Ranks that make different calls are the
subject of tests/failures/test_mismatch.py.

Inputs of the reducing collectives come from tests/support/helpers.py (integer-valued, exact); the copying collectives
move arbitrary bit patterns (NaN payloads, subnormals, negative zero), which a byte copy must keep. bfloat16 (and
some cases of every other dtype) run on CPU torch tensors; without torch those cases are skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import time

import helpers
import numpy as np
import pytest
from helpers import DTYPES, INT_DTYPES, OPS

import gpucoll

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(600)]

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
SPLIT = ("reduce_scatter", "all_to_all", "scatter")  # len(x) = world_size * rows
SMALL_ROWS = (1, 7, 1003)
LARGE = 2**18 + 5
LARGE_DTYPES = ("float64", "float32", "bfloat16", "int64", "float16", "int32", "int8", "uint8")
SECTIONS = ("dtype_op", "algos", "roots", "large", "hier", "bad")
SEED = 4321
SENTINEL = 0xA5  # out buffers start filled with it: an element the library never wrote shows up
TIMEOUT = 60.0  # a rank that hangs turns into a CollectiveTimeout report instead of a stuck test


# -- the case table (built in the parent; also checked for coverage below) ------------------------------------

def algos_for(coll: str, world_size: int, local_size: int = 0) -> list:
    """Registered algorithms that implement `coll` and can run at this world size."""
    from gpucoll import _C

    cid = COLLS.index(coll)
    return [a for a in _C.algorithm_names()
            if _C.algorithm_supports(a, cid) and _C.algorithm_unusable(a, cid, world_size, 0, local_size) is None]


def modes_for(coll: str) -> tuple:
    """'none': out=None (in place for all_reduce/reduce, a new array otherwise); 'out': a separate out array."""
    return ("inplace",) if coll == "broadcast" else ("none", "out")


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _kind(dtype: str, k: int) -> str:
    return "torch" if dtype == "bfloat16" or k % 7 == 3 else "numpy"


def cases_for(W: int) -> list:
    """(section, coll, algo, dtype, op, rows, tail, root, mode, kind), ordered so that the cases sharing inputs
    are adjacent. rows: len(x) along axis 0, or per-rank block rows for the SPLIT collectives."""
    cases = []
    k = 0
    # dtype_op
    for coll in REDUCING:
        algos = ["auto"] + algos_for(coll, W)
        for dtype in DTYPES:
            for op in OPS:
                for rows in SMALL_ROWS:
                    k += 1
                    for mode in modes_for(coll):
                        cases.append(("dtype_op", coll, algos[k % len(algos)], dtype, op, rows, (), k % W, mode,
                                      _kind(dtype, k)))
    # algos
    int_dtype = INT_DTYPES[W % len(INT_DTYPES)]
    for coll in COLLS:
        for algo in ["auto"] + algos_for(coll, W):
            for dtype in ("float32", int_dtype):
                for rows in (0, 1, 7, 1003):
                    k += 1
                    op = OPS[k % len(OPS)] if coll in REDUCING else None
                    tail = (3,) if rows == 7 and dtype == "float32" else ()
                    kind = "numpy" if rows == 0 else _kind(dtype, k)
                    modes = modes_for(coll) + (("alias",) if coll in ("all_reduce", "reduce") and rows == 7 else ())
                    for mode in modes:
                        cases.append(("algos", coll, algo, dtype, op, rows, tail, k % W, mode, kind))
    # roots
    for coll in ROOTED:
        for algo in ["auto"] + algos_for(coll, W):
            for root in range(W):
                k += 1
                dtype = DTYPES[k % len(DTYPES)]
                op = OPS[k % len(OPS)] if coll in REDUCING else None
                for mode in modes_for(coll):
                    cases.append(("roots", coll, algo, dtype, op, (7, 1003)[k % 2], (), root, mode,
                                  _kind(dtype, k)))
    # large
    for ci, coll in enumerate(COLLS):
        algos = algos_for(coll, W)
        for algo in ("auto", algos[(ci + W) % len(algos)]):
            k += 1
            dtype = LARGE_DTYPES[k % len(LARGE_DTYPES)]
            op = OPS[k % len(OPS)] if coll in REDUCING else None
            rows = LARGE if coll in ("all_reduce", "broadcast", "reduce") else LARGE // W + 5
            mode = modes_for(coll)[k % len(modes_for(coll))]
            cases.append(("large", coll, algo, dtype, op, rows, (), W - 1, mode, _kind(dtype, k)))
    cases.append(("large", "all_reduce", "auto", "float16", "avg", LARGE, (), 0, "out", "numpy"))
    cases.append(("large", "reduce_scatter", "auto", "int8", "prod", LARGE // W + 5, (), 0, "none", "torch"))
    return cases


def hier_cases_for(W: int) -> dict:
    """{local_size: cases} for hierarchical (and auto) all_reduce on a communicator with that local_size."""
    out = {}
    k = 0
    for L in divisors(W):
        cases = []
        for algo in ("hierarchical", "auto"):
            for rows in SMALL_ROWS:
                k += 1
                dtype = DTYPES[k % len(DTYPES)]
                for mode in ("none", "out"):
                    cases.append(("hier", "all_reduce", algo, dtype, OPS[k % len(OPS)], rows, (), 0, mode,
                                  _kind(dtype, k)))
        k += 1
        cases.append(("hier", "all_reduce", "hierarchical", "float32", OPS[k % len(OPS)], LARGE, (), 0, "out",
                      "numpy"))
        out[L] = cases
    return out


def bad_local_size(W: int) -> int:
    """A local_size that does not divide W (hierarchical must refuse it)."""
    return next(L for L in (3, 2, W + 1) if W % L != 0)


# -- inputs, references and bit patterns (run in the workers) -------------------------------------------------

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _pattern(dtype: str, n: int, rank: int, salt: int) -> np.ndarray:
    """n arbitrary bit patterns of the dtype's width (a multiplicative hash of the index), as unsigned ints."""
    i = np.arange(n, dtype=np.uint64) + np.uint64((rank + 1) * 1_000_003 + salt * 7919)
    v = i * np.uint64(0x9E3779B97F4A7C15)
    v ^= v >> np.uint64(29)
    return v.astype(_UNSIGNED[_itemsize(dtype)])


def _np_bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(_UNSIGNED[a.itemsize])


def _value_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """Bits of make_input/reference values (bf16 values live in float32)."""
    return helpers.bf16_bits(values) if dtype == "bfloat16" else _np_bits(values)


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def _from_bits(bits: np.ndarray, dtype: str, kind: str, shape: tuple):
    """A fresh array/tensor of `dtype` and `shape` holding these bit patterns."""
    if kind == "numpy":
        return bits.view(np.dtype(dtype)).reshape(shape).copy()
    import torch

    signed = bits.view(_SIGNED[bits.itemsize]).copy()
    return torch.from_numpy(signed).view(_torch_dtype(dtype)).reshape(shape)


def _bits_of(obj) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return _np_bits(obj).copy()
    import torch

    size = obj.element_size()
    if obj.numel() == 0:
        return np.empty(0, _UNSIGNED[size])
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return obj.contiguous().reshape(-1).view(signed).numpy().view(_UNSIGNED[size]).copy()


def _sentinel(dtype: str, kind: str, shape: tuple):
    n = int(np.prod(shape, dtype=np.int64))
    unsigned = _UNSIGNED[_itemsize(dtype)]
    fill = int.from_bytes(bytes([SENTINEL]) * np.dtype(unsigned).itemsize, "little")
    return _from_bits(np.full(n, fill, dtype=unsigned), dtype, kind, shape)


def _shape_of(obj) -> tuple:
    return tuple(obj.shape)


def _prepare(case, W: int):
    """(inputs: one bit array per rank, want: callable rank -> expected bits of the result)."""
    _, coll, _, dtype, op, rows, tail, root, _, _ = case
    per = rows * int(np.prod(tail, dtype=np.int64))  # elements per rank (x) or per block (SPLIT)
    total = per * W if coll in SPLIT else per
    if coll in REDUCING:
        values = [helpers.make_input(dtype, op, total, q, W, SEED) for q in range(W)]
        inputs = [_value_bits(v, dtype) for v in values]
        ref = _value_bits(helpers.reference(values, dtype, op), dtype)
        if coll == "reduce_scatter":
            return inputs, lambda r: ref[r * per:(r + 1) * per]
        return inputs, lambda r: ref
    salt = COLLS.index(coll) * 131 + rows
    inputs = [_pattern(dtype, total, q, salt) for q in range(W)]
    if coll == "broadcast":
        return inputs, lambda r: inputs[root]
    if coll in ("all_gather", "gather"):
        cat = np.concatenate(inputs)
        return inputs, lambda r: cat
    if coll == "all_to_all":
        return inputs, lambda r: np.concatenate([inputs[i][r * per:(r + 1) * per] for i in range(W)])
    return inputs, lambda r: inputs[root][r * per:(r + 1) * per]  # scatter


def _call(comm, case, x, out):
    _, coll, algo, _, op, _, _, root, mode, _ = case
    kw = {} if mode == "inplace" else {"out": out}
    if coll in REDUCING:
        kw["op"] = op
    if coll in ROOTED:
        kw["root"] = root
    return getattr(comm, coll)(x, algo=algo, **kw)


def run_case(comm, case, prepared, notes=None) -> str:
    """Runs one case on this rank; returns '' when it passed, else what went wrong. A non-root reduce given an
    `out` that returns something other than x is noted in `notes` (a known bug, kept apart) and checked on."""
    _, coll, _, dtype, _, rows, tail, root, mode, kind = case
    W, r = comm.world_size, comm.rank
    inputs, want_of = prepared
    rows_in = rows * W if coll in SPLIT else rows
    x = _from_bits(inputs[r], dtype, kind, (rows_in,) + tail)
    x_bits = _bits_of(x)
    is_root = r == root
    gets = coll not in ("reduce", "gather") or is_root  # does this rank receive a result?
    if coll in ("all_gather", "gather"):
        out_shape = (rows * W,) + tail
    elif coll in ("reduce_scatter", "scatter"):
        out_shape = (rows,) + tail
    else:
        out_shape = (rows_in,) + tail
    out = None
    if mode == "out":
        out = _sentinel(dtype, kind, out_shape)
    elif mode == "alias":
        out = x
    out_bits = None if out is None else _bits_of(out)

    res = _call(comm, case, x, out)

    # Which object must come back: x (in place; non-roots of reduce), out, None (non-roots of gather) or a new
    # array like x (out=None on the collectives whose result has another size or must not alias x).
    x_is_dest = gets and (mode in ("inplace", "alias") or (mode == "none" and coll in ("all_reduce", "reduce")))
    if not gets and coll == "gather":
        if res is not None:
            return f"returned {type(res).__name__} on a non-root rank, expected None"
    elif x_is_dest or not gets:
        if res is not x:
            msg = f"returned {type(res).__name__} id {id(res)}{' (out)' if res is out else ''}, not x itself"
            if gets or mode != "out" or notes is None:
                return msg
            notes.append(msg)
    elif mode == "out":
        if res is not out:
            return f"returned {type(res).__name__} id {id(res)}, not out itself"
    elif res is None or res is x or type(res) is not type(x):
        return f"returned {'x itself' if res is x else type(res).__name__}, expected a new {type(x).__name__}"
    # Inputs must be left as they were wherever they are not the destination.
    if not x_is_dest:
        err = helpers.mismatch(_bits_of(x), x_bits)
        if err:
            return f"modified its input x: {err}"
    if not gets:
        if out is not None and mode == "out":
            err = helpers.mismatch(_bits_of(out), out_bits)
            if err:
                return f"wrote into out on a non-root rank: {err}"
        return ""
    result = res
    if _shape_of(result) != out_shape:
        return f"result shape {_shape_of(result)}, expected {out_shape}"
    err = helpers.mismatch(_bits_of(result), want_of(r))
    return f"result: {err}" if err else ""


def _label(case) -> str:
    section, coll, algo, dtype, op, rows, tail, root, mode, kind = case
    parts = [section, coll, f"algo={algo}", dtype, kind, f"rows={rows}"]
    if tail:
        parts.append(f"tail={tail}")
    if op:
        parts.append(f"op={op}")
    if coll in ROOTED:
        parts.append(f"root={root}")
    parts.append(mode)
    return " ".join(parts)


_FATAL = (gpucoll.errors.InvalidUsage, gpucoll.errors.CollectiveTimeout, gpucoll.errors.RemoteError)


def run_cases(comm, cases, report) -> bool:
    """Runs cases, adding failures to report; False when the communicator broke (later cases would only echo)."""
    cache_key, prepared = None, None
    for case in cases:
        section = case[0]
        key = case[1:8]  # everything but mode and kind
        try:
            if key != cache_key:
                cache_key, prepared = key, None
                prepared = _prepare(case, comm.world_size)
            notes = []
            err = run_case(comm, case, prepared, notes)
            for note in notes:
                report["failures"].append(("nonroot_return", f"{_label(case)}: {note}"))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as text
            err = f"raised {type(exc).__name__}: {exc}"
            if isinstance(exc, _FATAL):
                report["failures"].append((section, f"{_label(case)}: {err} (stopping)"))
                return False
        report["checked"][section] = report["checked"].get(section, 0) + 1
        report["bf16"] = report.get("bf16", 0) + (case[3] == "bfloat16")
        if err:
            report["failures"].append((section, f"{_label(case)}: {err}"))
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sub_comm(comm, *, local_size=None, env=None, timeout=TIMEOUT):
    """A second communicator over the same ranks: rank 0 picks a port and broadcasts it on `comm`. `env` is set
    (in every rank's os.environ) while it is created."""
    port = np.zeros(1, np.int64)
    if comm.rank == 0:
        port[0] = _free_port()
    comm.broadcast(port, root=0)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        kw = {} if local_size is None else {"local_size": local_size}
        return gpucoll.init(comm.rank, comm.world_size, backend="host", address="127.0.0.1", port=int(port[0]),
                            timeout=timeout, **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- bad input ----------------------------------------------------------------------------------------------------

def _expect(report, label, thunk, exc_type, fragments, check_comm):
    """thunk() must raise exc_type with every fragment in its message; then check_comm must still work."""
    try:
        thunk()
        report["failures"].append(("bad", f"{label}: did not raise (expected {exc_type.__name__})"))
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if not isinstance(exc, exc_type):
            why = f"{label}: raised {type(exc).__name__}: {msg}, expected {exc_type.__name__}"
            report["failures"].append(("bad", why))
            if isinstance(exc, _FATAL):
                return False
        else:
            missing = [f for f in fragments if f not in msg]
            if missing:
                report["failures"].append(("bad", f"{label}: message {msg!r} lacks {missing}"))
    report["checked"]["bad"] = report["checked"].get("bad", 0) + 1
    err = helpers.still_works(check_comm)
    if err:
        report["failures"].append(("bad", f"after {label}: {err}"))
        return False
    return True


def bad_cases(comm) -> list:
    """(label, thunk, exception type, message fragments). Every rank makes the same mistake."""
    from gpucoll.errors import InvalidArgument

    W = comm.world_size
    f32 = np.float32
    n = 2 * W
    cases = []
    for coll in ROOTED:
        for bad in (-1, W, W + 3):
            cases.append((f"{coll} root={bad}", lambda c=coll, b=bad: getattr(comm, c)(np.ones(n, f32), root=b),
                          InvalidArgument, ["root", str(bad), str(W)]))
    for bad in (True, "0", 0.0, None):
        cases.append((f"broadcast root={bad!r}", lambda b=bad: comm.broadcast(np.ones(n, f32), root=b),
                      InvalidArgument, ["root", repr(bad)]))
    if W > 1:
        for coll in SPLIT:
            cases.append((f"{coll} len {n + 1} not divisible by {W}",
                          lambda c=coll: getattr(comm, c)(np.ones(n + 1, f32)),
                          InvalidArgument, [coll, "len(x)", "divisible", str(W), str(n + 1)]))
            cases.append((f"{coll} 2-D, {n + 1} rows not divisible by {W}",
                          lambda c=coll: getattr(comm, c)(np.ones((n + 1, 2), f32)),
                          InvalidArgument, [coll, "len(x)", "divisible", str(n + 1)]))
    want_out = {"all_reduce": n, "reduce": n, "all_gather": W * n, "reduce_scatter": n // W, "all_to_all": n,
                "gather": W * n, "scatter": n // W}
    for coll, count in want_out.items():
        for size in (count - 1, count + 1):
            cases.append((f"{coll} out of {size} elements (needs {count})",
                          lambda c=coll, s=size: getattr(comm, c)(np.ones(n, f32), out=np.empty(s, f32)),
                          InvalidArgument, ["out", str(count), str(size)]))
        cases.append((f"{coll} out float64 for float32 x",
                      lambda c=coll, s=count: getattr(comm, c)(np.ones(n, f32), out=np.empty(s, np.float64)),
                      InvalidArgument, ["out", "float32", "float64"]))
        cases.append((f"{coll} out int32 for float32 x",
                      lambda c=coll, s=count: getattr(comm, c)(np.ones(n, f32), out=np.empty(s, np.int32)),
                      InvalidArgument, ["out", "float32", "int32"]))
    # Algorithms that cannot serve the call.
    for coll, algo in (("broadcast", "ring"), ("all_reduce", "direct"), ("all_to_all", "tree"),
                       ("reduce", "ring"), ("gather", "oneshot"), ("scatter", "halving_doubling"),
                       ("all_gather", "dbt"), ("reduce_scatter", "hierarchical")):
        cases.append((f"{coll} algo={algo}", lambda c=coll, a=algo: getattr(comm, c)(np.ones(n, f32), algo=a),
                      InvalidArgument, [algo, coll, "does not implement"]))
    if W & (W - 1):
        for coll in ("all_gather", "reduce_scatter"):
            cases.append((f"{coll} algo=halving_doubling at world size {W}",
                          lambda c=coll: getattr(comm, c)(np.ones(n, f32), algo="halving_doubling"),
                          InvalidArgument, ["halving_doubling", coll, "power-of-two"]))
    for algo in ("nosuch", "Ring2", "ring,tree"):
        cases.append((f"all_reduce algo={algo!r}", lambda a=algo: comm.all_reduce(np.ones(n, f32), algo=a),
                      InvalidArgument, [algo.lower(), "ring", "auto"]))
    for algo in (3, b"ring", ["ring"]):
        cases.append((f"all_reduce algo={algo!r}", lambda a=algo: comm.all_reduce(np.ones(n, f32), algo=a),
                      InvalidArgument, ["algo", repr(algo)]))
    for op in ("mean", "", None, 7):
        cases.append((f"all_reduce op={op!r}", lambda o=op: comm.all_reduce(np.ones(n, f32), op=o),
                      InvalidArgument, ["op", repr(op)]))
    return cases


def _with_env(env, fn):
    def thunk():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return thunk


def run_bad_input(comm, report) -> None:
    from gpucoll.errors import InvalidArgument

    W = comm.world_size
    f32 = np.float32
    for label, thunk, exc_type, fragments in bad_cases(comm):
        if not _expect(report, label, thunk, exc_type, fragments, comm):
            return
    # GPUCOLL_ALGO naming an algorithm that cannot serve the call (read at every call, so setting it here in
    # every rank is enough); an explicit algo= wins over it.
    for spec, coll, fragments in (("allreduce:direct", "all_reduce", ["direct", "does not implement"]),
                                  ("broadcast:ring", "broadcast", ["ring", "does not implement"]),
                                  ("allreduce:nosuch", "all_reduce", ["nosuch", "ring"]),
                                  ("nosuch", "all_gather", ["nosuch"]),
                                  ("all_reduce:ring,gather:twoshot", "gather", ["twoshot", "does not implement"]),
                                  ("bogus:ring", "all_reduce", ["bogus", "unknown collective"])):
        call = (lambda c=coll: getattr(comm, c)(np.ones(2 * W, f32)))
        if not _expect(report, f"GPUCOLL_ALGO={spec} {coll}", _with_env({"GPUCOLL_ALGO": spec}, call),
                       InvalidArgument, ["GPUCOLL_ALGO"] + fragments, comm):
            return
    checks = [("GPUCOLL_ALGO=allreduce:direct, algo='ring' (explicit wins)", {"GPUCOLL_ALGO": "allreduce:direct"},
               lambda: comm.all_reduce(np.full(3, 1 + comm.rank, f32), algo="ring"),
               np.full(3, W * (W + 1) // 2, f32)),
              ("GPUCOLL_ALGO=allreduce:direct leaves broadcast alone", {"GPUCOLL_ALGO": "allreduce:direct"},
               lambda: comm.broadcast(np.full(3, 1 + comm.rank, f32), root=W - 1), np.full(3, W, f32))]
    for label, env, fn, want in checks:
        try:
            got = _with_env(env, fn)()
            if not np.array_equal(got, want):
                report["failures"].append(("bad", f"{label}: got {got.tolist()}, expected {want.tolist()}"))
        except Exception as exc:  # noqa: BLE001
            report["failures"].append(("bad", f"{label}: raised {type(exc).__name__}: {exc}"))
            return
        report["checked"]["bad"] = report["checked"].get("bad", 0) + 1
    # hierarchical on a communicator whose local_size does not divide the world size: the message says why.
    L = bad_local_size(W)
    try:
        sub = sub_comm(comm, local_size=L)
    except Exception as exc:  # noqa: BLE001
        why = f"creating a communicator with local_size={L}: {type(exc).__name__}: {exc}"
        report["failures"].append(("bad", why))
        return
    try:
        why = f"local_size={L} does not divide world size {W}"
        ok = _expect(report, f"hierarchical with local_size={L}",
                     lambda: sub.all_reduce(np.ones(4, f32), algo="hierarchical"), InvalidArgument,
                     ["hierarchical", "all_reduce", why], sub)
        if ok:
            _expect(report, f"GPUCOLL_ALGO=allreduce:hierarchical with local_size={L}",
                    _with_env({"GPUCOLL_ALGO": "allreduce:hierarchical"}, lambda: sub.all_reduce(np.ones(4, f32))),
                    InvalidArgument, ["GPUCOLL_ALGO", "hierarchical", why], sub)
    finally:
        sub.close()


# -- the worker -----------------------------------------------------------------------------------------------

def _without_torch(cases):
    return [c for c in cases if c[9] != "torch"]


def _collectives_worker(comm, cases, hier):
    report = {"failures": [], "checked": {}, "elapsed": {}, "bf16": 0}
    report["torch"] = helpers.torch_import_error()
    if report["torch"] is not None:
        cases = _without_torch(cases)
        hier = {L: _without_torch(cs) for L, cs in hier.items()}
    t0 = time.monotonic()
    if not run_cases(comm, cases, report):
        return report
    report["elapsed"]["main"] = time.monotonic() - t0
    t0 = time.monotonic()
    for i, (L, hcases) in enumerate(hier.items()):
        try:
            sub = (sub_comm(comm, local_size=L) if i % 2 == 0
                   else sub_comm(comm, env={"GPUCOLL_LOCAL_SIZE": str(L)}))
        except Exception as exc:  # noqa: BLE001
            why = f"creating a communicator with local_size={L}: {type(exc).__name__}: {exc}"
            report["failures"].append(("hier", why))
            return report
        try:
            before = len(report["failures"])
            ok = run_cases(sub, hcases, report)
            for j in range(before, len(report["failures"])):
                sec, text = report["failures"][j]
                report["failures"][j] = (sec, f"local_size={L} {text}")
        finally:
            sub.close()
        if not ok:
            return report
    report["elapsed"]["hier"] = time.monotonic() - t0
    t0 = time.monotonic()
    run_bad_input(comm, report)
    report["elapsed"]["bad"] = time.monotonic() - t0
    comm.barrier()
    return report


def _clean_env(mp):
    for var in ("GPUCOLL_ALGO", "GPUCOLL_LOCAL_SIZE", "GPUCOLL_DEBUG_CHECKS", "GPUCOLL_HOST_BUFFER_BYTES",
                "GPUCOLL_HOST_SEGMENT_BYTES"):
        mp.delenv(var, raising=False)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def reports(request):
    W = request.param
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp)
        per_rank = gpucoll.spawn(_collectives_worker, W, args=(cases_for(W), hier_cases_for(W)),
                                 backend="host", timeout=TIMEOUT)
    print(f"\nworld size {W}: {time.monotonic() - t0:.1f} s; rank 0: {per_rank[0]['elapsed']}")
    return W, per_rank


def _check_section(W, per_rank, section, expected):
    failures = [f"rank {r}: {text}" for r, rep in enumerate(per_rank) for sec, text in rep["failures"]
                if sec == section]
    assert not failures, helpers.format_failures(failures)
    for r, rep in enumerate(per_rank):
        got = rep["checked"].get(section, 0)
        assert got == expected, f"rank {r} ran {got} {section} cases, expected {expected} (a case stopped early?)"


def _expected(cases, per_rank):
    return len(cases if per_rank[0]["torch"] is None else _without_torch(cases))


@pytest.mark.slow
def test_every_dtype_and_op_on_reducing_collectives(reports):
    W, per_rank = reports
    _check_section(W, per_rank, "dtype_op", _expected([c for c in cases_for(W) if c[0] == "dtype_op"], per_rank))


def test_every_algorithm_of_every_collective(reports):
    W, per_rank = reports
    _check_section(W, per_rank, "algos", _expected([c for c in cases_for(W) if c[0] == "algos"], per_rank))


def test_every_root(reports):
    W, per_rank = reports
    _check_section(W, per_rank, "roots", _expected([c for c in cases_for(W) if c[0] == "roots"], per_rank))


def test_large_counts(reports):
    W, per_rank = reports
    _check_section(W, per_rank, "large", _expected([c for c in cases_for(W) if c[0] == "large"], per_rank))


def test_hierarchical_every_local_size(reports):
    W, per_rank = reports
    _check_section(W, per_rank, "hier", _expected([c for cs in hier_cases_for(W).values() for c in cs], per_rank))


def test_reduce_returns_x_on_non_roots_given_out(reports):
    W, per_rank = reports
    if W == 1:
        pytest.skip("world size 1 has no non-root rank")
    failures = [f"rank {r}: {text}" for r, rep in enumerate(per_rank) for sec, text in rep["failures"]
                if sec == "nonroot_return"]
    assert not failures, helpers.format_failures(failures)


def test_bad_input_typed_errors_and_still_usable(reports):
    W, per_rank = reports
    from types import SimpleNamespace

    n_bad = len(bad_cases(SimpleNamespace(world_size=W))) + 6 + 2 + 2
    _check_section(W, per_rank, "bad", n_bad)


def test_bfloat16_ran(reports):
    """bf16 (and the torch-tensor cases) run only where torch imports in the workers; say so when it does not."""
    W, per_rank = reports
    if per_rank[0]["torch"] is not None:
        pytest.skip(f"{per_rank[0]['torch']}; bfloat16 cases need torch (NumPy has no bfloat16)")
    want = sum(1 for c in cases_for(W) if c[3] == "bfloat16")
    want += sum(1 for cs in hier_cases_for(W).values() for c in cs if c[3] == "bfloat16")
    assert want > 0
    assert [rep["bf16"] for rep in per_rank] == [want] * W


def _pieces(case, W: int) -> int:
    """How many pieces the host executor cuts this call into (mirrors run_pieces in host_comm.cc)."""
    from gpucoll import _C

    _, coll, algo, dtype, _, rows, tail, root, _, _ = case
    cid = COLLS.index(coll)
    es = _itemsize(dtype)
    cp = _C.cost_params()
    seg, cap = max(cp["segment_bytes"] // es, 1), cp["buffer_bytes"] // 2 // es  # a work-buffer half
    n = rows * int(np.prod(tail, dtype=np.int64))
    blocked = coll not in ("all_reduce", "broadcast", "reduce")
    if blocked:
        piece = max(min(seg, cap // W), 1)
    else:
        name = _C.select_algorithm(cid, W, n * es, 0, algo)
        nchunks = _C.check_schedule(name, cid, W, root if coll in ROOTED else 0)["nchunks"]
        piece = max(min(seg * nchunks, cap), nchunks)
    return -(-n // piece)


def test_case_table_covers_every_axis():
    """Every dtype, op, algorithm (for every collective it implements), collective and world size appears; every
    root of every rooted collective with every algorithm; every dtype x op on every reducing collective; every
    local_size that divides the world size; in place and out of place for every collective that has both."""
    from gpucoll import _C

    for W in WORLD_SIZES:
        cases = cases_for(W)
        for coll in REDUCING:
            pairs = {(c[3], c[4]) for c in cases if c[0] == "dtype_op" and c[1] == coll}
            assert pairs == {(d, o) for d in DTYPES for o in OPS}, (W, coll)
        for coll in COLLS:
            algos = {c[2] for c in cases if c[1] == coll}
            assert algos == {"auto", *algos_for(coll, W)}, (W, coll, algos)
            assert {c[8] for c in cases if c[1] == coll} >= set(modes_for(coll)), (W, coll)
            assert any(c[0] == "large" and c[1] == coll for c in cases), (W, coll)
        for coll in ROOTED:
            for algo in ["auto"] + algos_for(coll, W):
                roots = {c[7] for c in cases if c[0] == "roots" and c[1] == coll and c[2] == algo}
                assert roots == set(range(W)), (W, coll, algo, roots)
        assert set(hier_cases_for(W)) == set(divisors(W))
        assert {c[3] for c in cases if c[0] == "large"} >= {"float64", "bfloat16"}
    # The large section is there to make the executor cut the buffer into several pieces.
    for W in WORLD_SIZES:
        multi = [c for c in cases_for(W) if c[0] == "large" and _pieces(c, W) > 1]
        assert len(multi) >= 3, (W, [_label(c) for c in multi])
        assert any(c[1] in SPLIT for c in multi) and any(c[1] not in SPLIT for c in multi), W
    every = {(c[1], c[2]) for W in WORLD_SIZES for c in cases_for(W)}
    for cid, coll in enumerate(COLLS):
        for algo in _C.algorithm_names():
            if _C.algorithm_supports(algo, cid):
                assert (coll, algo) in every, (coll, algo)
    assert {c[3] for W in WORLD_SIZES for cs in hier_cases_for(W).values() for c in cs} == set(DTYPES)


# -- reduce/gather: a bad `out` must stop non-roots too ------------------------------------------------------------

def _root_only_out_worker(comm, coll):
    """Every rank passes the same too-small out; every rank must raise, and a correct all_reduce must work after.
    (Before fe6863e only the root checked `out`: non-roots ran the collective alone and the ranks silently fell
    out of step, the root's next all_reduce returning wrong data.)"""
    res = {}
    f32 = np.float32
    bad_out = np.empty(3, f32)
    try:
        getattr(comm, coll)(np.ones(4, f32), out=bad_out, root=0)
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = type(exc).__name__
    res["after"] = helpers.still_works(comm)
    return res


@pytest.mark.parametrize("coll", ["reduce", "gather"])
def test_reduce_gather_bad_out_raises_on_every_rank(coll):
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp)
        per_rank = gpucoll.spawn(_root_only_out_worker, 2, args=(coll,), backend="host", timeout=5.0)
    assert [r["error"] for r in per_rank] == ["InvalidArgument"] * 2, per_rank
    assert [r["after"] for r in per_rank] == ["", ""], per_rank
