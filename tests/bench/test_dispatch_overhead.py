"""bench/dispatch_overhead.py runs end to end (tiny: 1 round of 300 calls): every variant, the torch backend's
included, is timed, every result checked exact, MPICH measured in the same run. Its figures are for docs/benchmark.md,
not for a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import helpers
import pytest

pytestmark = pytest.mark.spawns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_variant_runs_and_is_exact(tmp_path):
    helpers.require("torch")
    helpers.require("mpi4py")
    out = tmp_path / "d.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dispatch_overhead.py"), "--rounds", "1",
                        "--calls", "300", "--torch", "--json", str(out)], capture_output=True, text=True,
                       timeout=240, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert set(report["us_per_call"]) == {"public", "general", "native", "torch", "mpich"}, report["us_per_call"]
    assert all(v > 0 for rows in report["us_per_call"].values() for v in rows)
    assert report["torch_over_mpich"] > 0 and report["mpich"] == "measured"
    assert "torch / MPICH" in p.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "custom"])
def test_the_gpu_variants_run_and_are_exact(tmp_path, backend):
    """--backend nccl or custom on CUDA memory (a GPU, or the emulated device and its NCCL stand-in)."""
    import gpu_arrays

    if backend == "nccl":
        gpu_arrays.require_nccl_ranks(2)
    out = tmp_path / "d.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dispatch_overhead.py"), "--backend", backend,
                        "--rounds", "1", "--calls", "50", "--json", str(out)], capture_output=True, text=True,
                       timeout=240, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["clock"] == "thread CPU" and report["backend"] == backend
    assert set(report["us_per_call"]) == {"public", "general", "native"}, report["us_per_call"]
    assert all(v > 0 for rows in report["us_per_call"].values() for v in rows)
    assert report["public_over_native"] > 0
