"""gpucoll-bench on a CUDA device (every test is @pytest.mark.gpu: skipped with the reason where none is usable).
On gpucoll's emulated device (a GPUCOLL_CUDA=emulate build) the --backend custom runs and --check run, with buffers
from gpucoll itself (devmem.GpucollMem); --backend nccl runs on its NCCL stand-in.

--backend nccl at world size 1 (every collective, checked) and 2 ranks (two GPUs, or one GPU shared through NCCL's
multi-rank mode where the loaded NCCL allows it), -G (CUDA graph launches), -z, --compare torch, --backend custom
with virtual ranks and every algorithm, --compare nccl, --check. Each run goes through the command line in a fresh
process, so no CUDA state leaks between tests; sizes are small and every row is checked bit for bit (#wrong 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gpu_arrays
import pytest

from gpucoll.bench import report

pytestmark = [pytest.mark.spawns, pytest.mark.gpu]


def _nccl_problem():
    try:
        return gpu_arrays.nccl_problem()
    except ImportError as e:  # no gpucoll._C: the gpu marker skips everything anyway
        return str(e)


NCCL_WHY = _nccl_problem()
needs_nccl = pytest.mark.skipif(NCCL_WHY is not None, reason=f"needs NCCL: {NCCL_WHY}")

SMALL = ["-b", "8", "-e", "1M", "-f", "16", "-n", "5", "-w", "2", "-c", "1"]
NSIZES = 5  # 8, 128, 2K, 32K, 512K
COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def bench(*args, timeout=300, lib=None):
    """The command line in a fresh process; lib="cupy" makes devmem allocate with CuPy even where torch could."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                             "SLURM_PROCID")}
    force = f"from gpucoll.bench import devmem; devmem.cuda_lib = lambda: {lib!r}; " if lib else ""
    cmd = [sys.executable, "-c", f"import sys; {force}from gpucoll.bench.cli import main; sys.exit(main())", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)


def table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def assert_clean(res, nrows: int | None = None):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = table_rows(res.stdout)
    assert got, res.stdout
    for r in got:
        assert r[8] in ("0", "N/A") and r[12] in ("0", "N/A"), r  # #wrong out of place, in place
    if nrows is not None:
        assert len(got) == nrows
    return got


def two_ranks_reason() -> str | None:
    from gpucoll.backends.nccl import spawn_plan
    from gpucoll.errors import Unsupported

    try:
        spawn_plan(2, "nccl")
    except Unsupported as e:
        return str(e)
    return None


def custom_reason() -> str | None:
    from gpucoll.bench import virtual

    return virtual.problem("all_reduce")


@needs_nccl
@pytest.mark.parametrize("coll", COLLS)
def test_nccl_world_size_1(coll):
    res = bench(coll, "--backend", "nccl", *SMALL, "-d", "float,bfloat16,int8")
    got = assert_clean(res, nrows=3 * NSIZES)
    assert "[nccl]" in res.stdout and "cuda:0" in res.stdout
    # Rows of 0 elements (8 B split in 16-byte blocks) may time as nothing; every other row took some time and
    # was checked (not N/A) out of place.
    assert all(float(r[5]) > 0 and r[8] == "0" for r in got if r[1] != "0")


@needs_nccl
def test_nccl_two_ranks(tmp_path):
    why = two_ranks_reason()
    if why:
        pytest.skip(why)
    out = tmp_path / "n2.json"
    res = bench("all_reduce", "--backend", "nccl", "--nranks", "2", *SMALL, "-o", "all", "--json", str(out))
    got = assert_clean(res, nrows=5 * NSIZES)
    assert all(r[8] == "0" and r[12] == "0" for r in got)  # all_reduce: both placements checked
    doc = json.loads(out.read_text())
    assert doc["environment"]["nranks"] == 2 and {r["backend"] for r in doc["results"]} == {"nccl"}


@needs_nccl
def test_cuda_graph_mode():
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "-G", "10")
    got = assert_clean(res, nrows=NSIZES)
    assert "graph: 10" in res.stdout and all(r[8] == "0" and r[12] == "0" for r in got)


@needs_nccl
@pytest.mark.parametrize("coll", ["broadcast", "all_gather", "reduce_scatter"])
def test_cuda_graph_mode_two_ranks(coll):
    """Captured NCCL calls of several ranks (broadcast out of place captures its copy too), checked through a graph."""
    why = two_ranks_reason()
    if why:
        pytest.skip(why)
    got = assert_clean(bench(coll, "--backend", "nccl", "--nranks", "2", *SMALL, "-G", "3"), nrows=NSIZES)
    assert all(r[8] == "0" for r in got if r[1] != "0")


@needs_nccl
def test_cupy_buffers_graph_and_bfloat16_refusal():
    """The CuPy side of devmem (its events, stream capture and copies), as on a machine without a CUDA torch."""
    pytest.importorskip("cupy")
    got = assert_clean(bench("broadcast", "--backend", "nccl", *SMALL, "-G", "2", lib="cupy"), nrows=NSIZES)
    assert all(r[8] == "0" and r[12] == "0" for r in got)
    assert_clean(bench("all_reduce", "--backend", "nccl", *SMALL, "-o", "max", lib="cupy"), nrows=NSIZES)
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "-d", "bfloat16", lib="cupy")
    assert res.returncode == 2 and "CuPy has no bfloat16" in res.stderr


@needs_nccl
def test_wrong_results_fail_the_run():
    """The check is live on the CUDA path: one corrupted element makes #wrong > 0 and exit status 1."""
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "--inject-error")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert any(r[8] not in ("0", "N/A") for r in table_rows(res.stdout))


@needs_nccl
def test_blocking_mode():
    assert_clean(bench("all_gather", "--backend", "nccl", *SMALL, "-z", "1"), nrows=NSIZES)


@needs_nccl
def test_compare_torch_nccl():
    from gpucoll import _C

    if _C.build_info().get("cuda_emulated"):
        pytest.skip("torch's NCCL backend needs a real GPU: this is gpucoll's emulated CUDA device")
    pytest.importorskip("torch")
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "--compare", "torch")
    got = assert_clean(res, nrows=NSIZES)
    assert all(len(r) == 15 and r[13] != "N/A" for r in got)  # torch's time and the ratio after nccl-tests' columns


def test_backend_sweep_auto_and_host():
    res = bench("all_reduce", "--backend", "auto,host", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2")
    assert_clean(res, nrows=4)
    auto = "host" if NCCL_WHY else "nccl"  # auto means NCCL on a GPU; the host backend where NCCL cannot run
    assert f"backend: auto({auto})" in res.stdout and "backend: host" in res.stdout


def test_custom_every_algorithm_two_virtual_ranks(tmp_path):
    why = custom_reason()
    if why:
        pytest.skip(why)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", "--algo", "oneshot,twoshot,ring,tree", *SMALL,
                "-d", "float,half,bfloat16", "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"))
    got = assert_clean(res, nrows=4 * 3 * NSIZES)
    assert res.stdout.count("# Algorithm: ") == 4 and all(r[8] == "0" and r[12] == "0" for r in got)
    # The header says when the device is gpucoll's emulation, whose timings are not GPU timings, and so does every
    # row of the JSON and the CSV (a row copied out of its file keeps it).
    assert ("these timings are not GPU timings" in res.stdout) == gpu_arrays.emulated()
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(rows) == 4 * 3 * NSIZES and {r["emulated"] for r in rows} == {gpu_arrays.emulated()}
    csv_rows = report.read_csv_rows(str(tmp_path / "r.csv"))
    assert len(csv_rows) == len(rows) and {r["emulated"] for r in csv_rows} == {str(gpu_arrays.emulated())}


def test_custom_all_datatypes_and_ops_skip_what_has_no_kernel():
    why = custom_reason()
    if why:
        pytest.skip(why)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", *SMALL, "-d", "all", "-o", "all")
    got = assert_clean(res, nrows=5 * 4 * NSIZES)  # 5 dtypes with kernels x sum, max, min, avg
    assert "skipped int8, uint8, int64" in res.stdout and "skipped prod" in res.stdout
    assert all(r[8] == "0" and r[12] == "0" for r in got)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", *SMALL, "--inject-error")
    assert res.returncode == 1


@needs_nccl
def test_custom_compare_nccl():
    why = custom_reason() or two_ranks_reason()
    if why:
        pytest.skip(why)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", *SMALL, "--compare", "nccl")
    got = assert_clean(res, nrows=NSIZES)
    assert all(r[13] != "N/A" for r in got)


def test_check_on_the_gpu(tmp_path):
    res = bench("--health-check", "--json", str(tmp_path / "c.json"), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check: OK" in res.stdout
    assert ("check nccl" in res.stdout) == (NCCL_WHY is None)  # NCCL is checked where it can run
    assert "FAIL" not in res.stdout
    if custom_reason() is None:  # virtual ranks run all_reduce and skip the rest, never fail the backend
        assert "check custom all_reduce      OK" in res.stdout and "check custom broadcast       SKIP" in res.stdout
    docs = json.loads((tmp_path / "c.json").read_text())
    assert docs and all(d["out_of_bounds"]["count"] == 0 for d in docs)
