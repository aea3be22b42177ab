"""Bad input: each mistake raises a typed error, on the rank that made it, naming the argument and what was
expected. Every rank makes the same mistake, so no rank is left waiting in a collective; after the mistakes the
communicator must still work (they are caught before any rank enters a collective).

Communicator-level cases run in one 2-rank gpucoll.spawn; init/spawn argument checks run in-process.
"""

from __future__ import annotations

import math

import helpers
import numpy as np
import pytest

import gpucoll
from gpucoll.errors import InvalidArgument, InvalidUsage, Unsupported

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZE = 2


# -- cases: (label, thunk(comm), expected class, fragments the message must contain) ---------------------------

def _numpy_cases():
    f32 = np.float32

    def ro(a):
        a.flags.writeable = False
        return a

    shared = np.zeros(20, f32)
    return [
        ("strided x", lambda c: c.all_reduce(np.arange(20, dtype=f32)[::2]), InvalidArgument,
         ["x", "contiguous"]),
        ("Fortran-order x", lambda c: c.all_reduce(np.asfortranarray(np.ones((3, 4), f32))), InvalidArgument,
         ["x", "contiguous"]),
        ("strided out", lambda c: c.all_reduce(np.ones(10, f32), out=np.empty(20, f32)[::2]), InvalidArgument,
         ["out", "contiguous"]),
        ("complex64 x", lambda c: c.all_reduce(np.ones(4, np.complex64)), Unsupported,
         ["x", "complex64", "float32"]),
        ("complex128 x", lambda c: c.all_reduce(np.ones(4, np.complex128)), Unsupported, ["x", "complex128"]),
        ("object x", lambda c: c.all_reduce(np.array([1, "a", None], dtype=object)), Unsupported, ["x", "object"]),
        ("bool x", lambda c: c.all_reduce(np.ones(4, np.bool_)), Unsupported, ["x", "bool"]),
        ("int16 x", lambda c: c.all_reduce(np.ones(4, np.int16)), Unsupported, ["x", "int16"]),
        ("uint64 x", lambda c: c.all_reduce(np.ones(4, np.uint64)), Unsupported, ["x", "uint64"]),
        ("longdouble x", lambda c: c.all_reduce(np.ones(4, np.longdouble)), Unsupported,
         ["x", np.dtype(np.longdouble).name]),
        ("str x", lambda c: c.all_reduce(np.array(["a", "b"])), Unsupported, ["x"]),
        ("list x", lambda c: c.all_reduce([1.0, 2.0]), InvalidArgument, ["x", "NumPy", "list"]),
        ("float x", lambda c: c.all_reduce(3.0), InvalidArgument, ["x", "float"]),
        ("None x", lambda c: c.all_reduce(None), InvalidArgument, ["x"]),
        ("out too small", lambda c: c.all_reduce(np.ones(10, f32), out=np.empty(9, f32)), InvalidArgument,
         ["out", "10", "9"]),
        ("out too large", lambda c: c.all_reduce(np.ones(10, f32), out=np.empty((3, 4), f32)), InvalidArgument,
         ["out", "10", "12"]),
        ("out of another dtype", lambda c: c.all_reduce(np.ones(10, f32), out=np.empty(10, np.float64)),
         InvalidArgument, ["out", "float32", "float64"]),
        ("out int32 for float32 x", lambda c: c.all_reduce(np.ones(10, f32), out=np.empty(10, np.int32)),
         InvalidArgument, ["out", "float32", "int32"]),
        ("out of an unsupported dtype", lambda c: c.all_reduce(np.ones(4, f32), out=np.empty(4, np.complex64)),
         Unsupported, ["out", "complex64"]),
        ("out a list", lambda c: c.all_reduce(np.ones(2, f32), out=[0.0, 0.0]), InvalidArgument, ["out", "list"]),
        ("read-only out", lambda c: c.all_reduce(np.ones(10, f32), out=ro(np.empty(10, f32))), InvalidArgument,
         ["out", "writable"]),
        ("out partially overlapping x", lambda c: c.all_reduce(shared[:10], out=shared[5:15]), InvalidArgument,
         ["out", "overlap"]),
        ("unknown op", lambda c: c.all_reduce(np.ones(4, f32), op="mean"), InvalidArgument, ["op", "mean", "sum"]),
        ("op None", lambda c: c.all_reduce(np.ones(4, f32), op=None), InvalidArgument, ["op", "None"]),
        ("op an int", lambda c: c.all_reduce(np.ones(4, f32), op=1), InvalidArgument, ["op"]),
        ("unknown algo", lambda c: c.all_reduce(np.ones(4, f32), algo="bogus"), InvalidArgument,
         ["algo", "bogus"]),
        ("algo an int", lambda c: c.all_reduce(np.ones(4, f32), algo=3), InvalidArgument, ["algo"]),
    ]


def _readonly_inplace_case():
    """In place writes the result into x, so x must be writable (as broadcast already requires)."""
    x = np.ones(10, np.float32)
    x.flags.writeable = False
    return ("read-only x in place", lambda c: c.all_reduce(x), InvalidArgument, ["x", "writable"])


def _torch_cases():
    import torch

    return [
        ("transposed tensor x", lambda c: c.all_reduce(torch.ones(4, 3).t()), InvalidArgument, ["x", "contiguous"]),
        ("complex tensor x", lambda c: c.all_reduce(torch.ones(4, dtype=torch.complex64)), Unsupported,
         ["x", "complex64"]),
        ("bool tensor x", lambda c: c.all_reduce(torch.ones(4, dtype=torch.bool)), Unsupported, ["x", "bool"]),
        ("int16 tensor x", lambda c: c.all_reduce(torch.ones(4, dtype=torch.int16)), Unsupported, ["x", "int16"]),
        ("NumPy out for a tensor x", lambda c: c.all_reduce(torch.ones(4), out=np.empty(4, np.float32)),
         InvalidArgument, ["out"]),
        ("tensor out for a NumPy x", lambda c: c.all_reduce(np.ones(4, np.float32), out=torch.empty(4)),
         InvalidArgument, ["out"]),
        ("tensor out of another dtype", lambda c: c.all_reduce(torch.ones(4), out=torch.empty(4, dtype=torch.int32)),
         InvalidArgument, ["out", "float32", "int32"]),
        ("tensor out too small", lambda c: c.all_reduce(torch.ones(4), out=torch.empty(3)), InvalidArgument,
         ["out", "4", "3"]),
    ]


def _run_cases(comm, cases):
    failures = []
    for label, thunk, cls, fragments in cases:
        try:
            thunk(comm)
        except Exception as exc:  # noqa: BLE001 - compared below
            if type(exc) is not cls:
                failures.append(f"{label}: raised {type(exc).__name__} ({exc}), expected {cls.__name__}")
                continue
            text = str(exc)
            missing = [f for f in fragments if f.lower() not in text.lower()]
            if missing:
                failures.append(f"{label}: {cls.__name__} message {text!r} does not mention {missing}")
        else:
            failures.append(f"{label}: no error, expected {cls.__name__}")
    return failures


def _still_works(comm, tag):
    """A correct collective after the mistakes: nobody entered a collective during them, so ranks are in step."""
    W = comm.world_size
    x = np.full(5, comm.rank + 1, np.int64)
    try:
        comm.all_reduce(x)
    except Exception as exc:  # noqa: BLE001
        return [f"{tag}: a valid all_reduce raised {type(exc).__name__}: {exc}"]
    want = W * (W + 1) // 2
    return [] if np.all(x == want) else [f"{tag}: a valid all_reduce gave {x.tolist()}, expected {want}"]


def _bad_input_worker(comm, with_torch):
    report = {"numpy": [], "readonly": [], "torch": [], "valid": [], "closed": []}
    report["numpy"] = _run_cases(comm, _numpy_cases())
    report["valid"] += _still_works(comm, "after the NumPy mistakes")

    # Accepted variants that look close to the mistakes above.
    f32 = np.float32
    try:
        x = np.full(6, comm.rank + 1, f32)
        ro = x.copy()
        ro.flags.writeable = False
        out = np.empty(6, f32)
        comm.all_reduce(ro, out=out)  # a read-only x is fine out of place
        same = np.full(6, comm.rank + 1, f32)
        comm.all_reduce(same, out=same)  # out=x is in place
        reshaped = np.empty((2, 3), f32)
        comm.all_reduce(x, out=reshaped)  # out needs x's size, not its shape
        total = comm.world_size * (comm.world_size + 1) / 2
        for name, arr in (("read-only x, separate out", out), ("out=x", same), ("out of another shape", reshaped)):
            if not np.all(arr == total):
                report["valid"].append(f"{name}: got {arr.tolist()}, expected {total}")
        if not np.all(ro == comm.rank + 1):
            report["valid"].append(f"read-only x was modified: {ro.tolist()}")
    except Exception as exc:  # noqa: BLE001
        report["valid"].append(f"a valid variant raised {type(exc).__name__}: {exc}")

    report["readonly"] = _run_cases(comm, [_readonly_inplace_case()])
    if report["readonly"]:
        # The library accepted it and ran a collective: every rank did, so they are still in step.
        report["valid"] += _still_works(comm, "after the read-only x case")

    if with_torch:
        report["torch"] = _run_cases(comm, _torch_cases())
        report["valid"] += _still_works(comm, "after the torch mistakes")

    comm.barrier()
    comm.close()
    report["closed"] = _run_cases(comm, [
        ("all_reduce after close", lambda c: c.all_reduce(np.ones(4, f32)), InvalidUsage, ["closed"]),
        ("barrier after close", lambda c: c.barrier(), InvalidUsage, ["closed"]),
    ])
    try:
        comm.close()  # idempotent; gpucoll.spawn calls it once more after this function returns
        if not comm.closed:
            report["closed"].append("comm.closed is False after close()")
    except Exception as exc:  # noqa: BLE001
        report["closed"].append(f"a second close() raised {type(exc).__name__}: {exc}")
    return report


@pytest.fixture(scope="module")
def reports():
    return gpucoll.spawn(_bad_input_worker, WORLD_SIZE, args=(helpers.HAVE_TORCH,), backend="host", timeout=60.0)


def _assert_clean(reports, key):
    failures = helpers.merge_rank_failures(reports, key)
    assert not failures, helpers.format_failures(failures)


def test_numpy_mistakes_raise_typed_errors_naming_the_argument(reports):
    _assert_clean(reports, "numpy")


def test_communicator_still_works_after_mistakes(reports):
    _assert_clean(reports, "valid")


def test_readonly_x_in_place_is_rejected(reports):
    _assert_clean(reports, "readonly")


def test_torch_mistakes_raise_typed_errors(reports):
    helpers.require("torch")
    _assert_clean(reports, "torch")


def test_use_after_close_raises_invalid_usage(reports):
    _assert_clean(reports, "closed")


# -- init / spawn argument checks (in-process: they fail before any rendezvous) ---------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    for name in ("GPUCOLL_BACKEND", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _init(**kwargs):
    from gpucoll._spawn import free_port

    args = {"rank": 0, "world_size": 1, "address": "127.0.0.1", "port": free_port(), "timeout": 5.0}
    args.update(kwargs)
    comm = gpucoll.init(**args)
    comm.close()  # only reached when a case is wrongly accepted
    return comm


@pytest.mark.parametrize("world_size", [0, -1, -8])
def test_init_world_size_below_one(clean_env, world_size):
    with pytest.raises(InvalidArgument, match="world_size") as info:
        _init(world_size=world_size)
    assert str(world_size) in str(info.value)


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (5, 1), (1, 1)])
def test_init_rank_out_of_range(clean_env, rank, world_size):
    with pytest.raises(InvalidArgument, match="rank") as info:
        _init(rank=rank, world_size=world_size)
    assert str(rank) in str(info.value) and str(world_size) in str(info.value)


@pytest.mark.parametrize("rank", ["0", 1.5, True, [0]])
def test_init_rank_not_an_integer(clean_env, rank):
    with pytest.raises(InvalidArgument, match="rank"):
        _init(rank=rank, world_size=2)


@pytest.mark.parametrize("timeout", [0, 0.0, -1, -0.5, math.nan, -math.inf, "5", None])
def test_init_timeout_not_positive(clean_env, timeout):
    with pytest.raises(InvalidArgument, match="timeout"):
        _init(timeout=timeout)


def test_init_unknown_backend(clean_env):
    with pytest.raises(InvalidArgument, match="backend") as info:
        _init(backend="bogus")
    assert "bogus" in str(info.value) and "host" in str(info.value)


def test_spawn_argument_checks():
    with pytest.raises(InvalidArgument, match="nranks"):
        gpucoll.spawn(_bad_input_worker, 0)
    with pytest.raises(InvalidArgument, match="nranks"):
        gpucoll.spawn(_bad_input_worker, 1.5)
    with pytest.raises(InvalidArgument, match="fn"):
        gpucoll.spawn("not callable", 1)


def _never_called(comm):
    raise AssertionError("init should have failed before fn was called")


def test_spawn_timeout_not_positive_refused_at_the_call():
    """spawn checks the timeout as init would, before any worker starts (not as one refusal per worker)."""
    with pytest.raises(InvalidArgument, match=r"timeout must be a positive number of seconds; got -1\.0") as info:
        gpucoll.spawn(_never_called, 2, timeout=-1.0, backend="host")
    assert not hasattr(info.value, "rank")  # no worker ran
