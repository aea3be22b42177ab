"""bench/trace_overhead.py runs end to end (tiny: 3 rounds of 200 calls): the three communicators are built as it
says (two recording, one not) and every one is timed. Its figures are for docs/benchmark.md, not for a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spawns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_recorder_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_overhead.py"), "--rounds", "3", "--calls",
                        "200", "--json", str(out)], capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert set(r["us"]) == {"on", "control", "off"} and all(len(v) == 3 and min(v) > 0 for v in r["us"].values())
    # The "on" communicator recorded its warm-up and timed calls: 20 + 3 x 200, and its split's barrier.
    assert r["recorded"] >= 620, r
    assert r["median_on_off"] > 0 and "(the overhead)" in p.stdout
