"""The modern torch.distributed stack on gpucoll (CPU ranks), compared with gloo in the same test.

Each world size (2 and 4) and each default backend ("gpucoll", "cpu:gpucoll,cuda:gpucoll", "cpu:gloo,cuda:gpucoll",
and gloo as the reference) is one spawn that runs every case of tests/torch_backend/torch_modern_cases.py: functional
collectives eager and under torch.compile (inductor), DeviceMesh 1-D and 2-D, DTensor redistribution, FSDP2 (per
layer and root, reshard_after_forward both ways, bf16 parameters with f32 reduction), a tensor-parallel MLP, 2-D
FSDP2 + TP, a DCP save/load round trip, DDP variants, point-to-point and object collectives, and groups (new_group,
new_subgroups, destroy_process_group of subgroups). Each test compares one case of one gpucoll variant with the
gloo run.

Exactness: the collectives and DTensor cases use integer values, so they match bit for bit. Training runs match
exactly at 2 ranks (a sum of two floats has one order); at 4 ranks gpucoll and gloo may add in different orders, so
losses and parameters are compared with a tolerance of 1e-5 (relative to 1), bfloat16 runs with 2e-2.
"""

from __future__ import annotations

import shutil
import tempfile

import helpers
import pytest
import torch_modern_cases
import torch_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(900)]

VARIANTS = [("gpucoll", 2), ("cpu:gpucoll,cuda:gpucoll", 2), ("cpu:gloo,cuda:gpucoll", 2), ("gpucoll", 4)]
CASES = list(torch_modern_cases.CASES)
_RESULTS: dict = {}
# Made by _run (not at import: spawned ranks import this module for _timeout_worker): inductor's cache, shared by
# the spawns of this module so that a compiled graph's C++ is built once, and the ranks' working directories.
_WORKDIRS: list = []
# What differs by backend by design, so it is checked on its own rather than compared with gloo.
_OWN = {"mesh": ("backend",), "groups": ("default_backend", "new_group_backend", "subgroup_names"),
        "compiled": ("gpucoll_calls",)}


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    """The inductor cache and the checkpoints go when the module is done."""
    yield
    for path in _WORKDIRS:
        shutil.rmtree(path, ignore_errors=True)


def _run(backend: str, n: int):
    key = (backend, n)
    if key not in _RESULTS:
        if not _WORKDIRS:
            _WORKDIRS.append(tempfile.mkdtemp(prefix="gpucoll-inductor-"))
        workdir = tempfile.mkdtemp(prefix="gpucoll-modern-")
        _WORKDIRS.append(workdir)
        env = {"TORCHINDUCTOR_CACHE_DIR": _WORKDIRS[0], "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
        try:
            res = torch_ranks.run(torch_modern_cases.run_cases, n, backend, CASES, workdir, backend=backend,
                                  timeout=1200.0, env=env)
        except AssertionError as e:  # a rank died or hung: every case of this spawn fails with it
            res = e
        _RESULTS[key] = res
    res = _RESULTS[key]
    if isinstance(res, AssertionError):
        raise res
    return res


def _tolerance(case: str, n: int, path: str) -> float:
    if case not in ("fsdp2", "tp", "fsdp2_tp", "ddp", "dcp") or n == 2:
        return 0.0
    return 2e-2 if "bf16" in path else 1e-5


def _compare(got, want, path, atol, diffs):
    """Raises AssertionError at the first difference; records the largest float difference in `diffs`."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _compare(got[k], want[k], f"{path}.{k}", atol, diffs)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (a, b) in enumerate(zip(got, want)):
            _compare(a, b, f"{path}[{i}]", atol, diffs)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, \
            f"{path}: {got!r} vs {want!r}"
        if got.numel():
            d = (got.double() - want.double()).abs().max().item()
            diffs.append(d)
            assert (d == 0.0) if atol == 0 else (d <= atol), f"{path}: differs by up to {d:.3g} (allowed {atol})"
    elif isinstance(want, float):
        d = abs(got - want)
        diffs.append(d)
        assert (d == 0.0) if atol == 0 else (d <= atol), f"{path}: {got!r} vs gloo {want!r} (allowed {atol})"
    else:
        assert got == want, f"{path}: {got!r} vs gloo {want!r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend,n", VARIANTS, ids=[f"{b}-world{n}" for b, n in VARIANTS])
def test_matches_gloo(backend, n, case):
    ours, ref = _run(backend, n), _run("gloo", n)
    diffs = []
    for rank in range(n):
        got, want = ours[rank]["results"][case], ref[rank]["results"][case]
        for r in (got, want):
            assert not (isinstance(r, str) and r.startswith("ERROR")), f"rank {rank}:\n{r}"
        own = _OWN.get(case, ())
        if isinstance(want, dict):
            got = {k: v for k, v in got.items() if k not in own}
            want = {k: v for k, v in want.items() if k not in own}
        _compare(got, want, f"rank {rank} {case}", _tolerance(case, n, case), diffs)
    # calls that reached gpucoll's process groups in this case: none on gloo, some on every gpucoll variant
    assert all(ref[r]["gpucoll_calls"][case] == 0 for r in range(n))
    if case != "fsdp2_tp" or n == 4:
        assert all(ours[r]["gpucoll_calls"][case] > 0 for r in range(n)), [o["gpucoll_calls"] for o in ours]


@pytest.mark.parametrize("backend,n", VARIANTS, ids=[f"{b}-world{n}" for b, n in VARIANTS])
def test_backend_specific(backend, n):
    """What is gpucoll's own: the groups torch made are gpucoll's, with names; the compiled graph's collectives ran
    on gpucoll (counted where torch enters gpucoll's process group: 3 collectives x 2 calls of the compiled
    function); training losses went down."""
    ours = _run(backend, n)
    for rank in range(n):
        res = ours[rank]["results"]
        assert res["mesh"]["backend"] == ["ProcessGroupGpucoll"], res["mesh"]
        assert res["groups"]["default_backend"] == backend and res["groups"]["new_group_backend"] == backend
        assert res["groups"]["new_group_resolves"] is True and res["groups"]["destroyed_unregistered"] is True
        assert res["compiled"]["gpucoll_calls"] == 6, res["compiled"]
        assert all(x is True for x in res["dcp"]["changed"]), "the loaded model kept its own parameters"
        for losses in [run["losses"] for run in res["fsdp2"].values()] + [res["tp"]["losses"]]:
            assert sum(losses[-2:]) < sum(losses[:2]), losses  # each rank cycles through two batches


def test_torch_version_recorded():
    """Which torch ran these (printed for the record; the GPU machines run 2.11)."""
    versions = {o["torch"] for key in _RESULTS for o in (_RESULTS[key] if isinstance(_RESULTS[key], list) else [])}
    print(f"torch {sorted(versions) or torch.__version__}")
    assert torch.__version__


def _timeout_worker(rank, n, backend):
    import datetime
    import time

    import torch
    import torch.distributed as dist

    import gpucoll.torch  # noqa: F401

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=2))
    x = torch.ones(4)
    dist.all_reduce(x)  # both ranks: the group works
    if rank == 1:
        time.sleep(8)  # never joins the next all_reduce: rank 0 must give up after its 2 s timeout
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        return ("no error", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, time.monotonic() - t0, str(e)[:300])


@pytest.mark.parametrize("backend", ["gpucoll", "gloo"])
def test_init_timeout_honoured(backend):
    """init_process_group(timeout=2 s): a peer that stops taking part makes the collective raise within the timeout,
    not after torch's default 30 minutes (checked against the 8 s the peer stays away). gloo alongside, as the
    reference."""
    err = torch_ranks.run(_timeout_worker, 2, backend, backend=None, timeout=120.0)[0]
    assert err is not None and err[0] != "no error", err
    assert err[1] < 7.0, err
    print(f"{backend}: {err[0]} after {err[1]:.1f} s")
