"""gpucoll-bench on a real GPU (every test is @pytest.mark.gpu: skipped with the reason where none is usable).

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

import pytest

pytestmark = pytest.mark.gpu

SMALL = ["-b", "8", "-e", "1M", "-f", "16", "-n", "5", "-w", "2", "-c", "1"]
COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def bench(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                             "SLURM_PROCID")}
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", *args]
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
    from gpucoll._nccl_backend import spawn_plan
    from gpucoll.errors import Unsupported

    try:
        spawn_plan(2, "nccl")
    except Unsupported as e:
        return str(e)
    return None


def custom_reason() -> str | None:
    from gpucoll.bench import virtual

    return virtual.problem("all_reduce")


@pytest.mark.parametrize("coll", COLLS)
def test_nccl_world_size_1(coll):
    res = bench(coll, "--backend", "nccl", *SMALL, "-d", "float,bfloat16,int8")
    got = assert_clean(res, nrows=3 * 3)
    assert "[nccl]" in res.stdout and "cuda:0" in res.stdout
    assert all(float(r[5]) > 0 for r in got)


def test_nccl_two_ranks(tmp_path):
    why = two_ranks_reason()
    if why:
        pytest.skip(why)
    out = tmp_path / "n2.json"
    res = bench("all_reduce", "--backend", "nccl", "--nranks", "2", *SMALL, "-o", "all", "--json", str(out))
    assert_clean(res, nrows=5 * 3)
    doc = json.loads(out.read_text())
    assert doc["environment"]["nranks"] == 2 and {r["backend"] for r in doc["results"]} == {"nccl"}


def test_cuda_graph_mode():
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "-G", "10")
    assert_clean(res, nrows=3)
    assert "graph: 10" in res.stdout


def test_blocking_mode():
    assert_clean(bench("all_gather", "--backend", "nccl", *SMALL, "-z", "1"), nrows=3)


def test_compare_torch_nccl():
    pytest.importorskip("torch")
    res = bench("all_reduce", "--backend", "nccl", *SMALL, "--compare", "torch")
    got = assert_clean(res, nrows=3)
    assert all(len(r) == 15 and r[13] != "N/A" for r in got)  # torch's time and the ratio after nccl-tests' columns


def test_backend_sweep_auto_and_host():
    res = bench("all_reduce", "--backend", "auto,host", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2")
    assert_clean(res, nrows=4)
    assert "backend: auto(nccl)" in res.stdout and "backend: host" in res.stdout


def test_custom_every_algorithm_two_virtual_ranks():
    why = custom_reason()
    if why:
        pytest.skip(why)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", "--algo", "oneshot,twoshot,ring,tree", *SMALL,
                "-d", "float,half,bfloat16")
    assert_clean(res, nrows=4 * 3 * 3)
    assert res.stdout.count("# Algorithm: ") == 4


def test_custom_compare_nccl():
    why = custom_reason() or two_ranks_reason()
    if why:
        pytest.skip(why)
    res = bench("all_reduce", "--backend", "custom", "--nranks", "2", *SMALL, "--compare", "nccl")
    got = assert_clean(res, nrows=3)
    assert all(r[13] != "N/A" for r in got)


def test_check_on_the_gpu(tmp_path):
    res = bench("--check", "--json", str(tmp_path / "c.json"), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check nccl" in res.stdout and "check: OK" in res.stdout
