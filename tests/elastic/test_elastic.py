"""gpucoll.elastic.run through the runnable example bench/elastic_train.py: ranks train a linear model, one is
SIGKILLed while the others wait for it inside a step's all_reduce, the survivors shrink, take rank 0's parameters,
re-shard the data and finish every step; where --join-at is given a new process joins at that step boundary,
receives the parameters and trains with them to the end. Every rank ends with exactly the same parameters, close to
the model's truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "bench" / "elastic_train.py"


@pytest.mark.parametrize("ranks,kill,at,join,steps", [(4, 2, 40, 80, 120), (5, 3, 0, 0, 60), (3, 1, 59, 0, 60),
                                                      (3, 1, 5, 10, 30)])
def test_survivors_train_to_the_end(tmp_path, ranks, kill, at, join, steps):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--ranks", str(ranks), "--kill", str(kill), "--at", str(at),
                           "--join-at", str(join), "--steps", str(steps), "--json", str(out)], check=False,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    survivors = [r for r in range(ranks) if r != kill]
    assert doc["survivors"] == survivors
    results = [doc["results"][r] for r in survivors]
    final = ranks if join else ranks - 1
    for res in results:
        kinds = [e["kind"] for e in res["events"]]
        assert kinds == ["failure", "recovered"] + (["grown"] if join else []), res["events"]
        rec = res["events"][1]
        assert rec["world_size"] == ranks - 1 and rec["old_size"] == ranks and rec["step"] == at
        if join:
            grown = res["events"][2]
            assert grown["old_size"] == ranks - 1 and grown["world_size"] == ranks and grown["step"] == join
        steps_done = [i for i, _, _ in res["losses"]]
        assert steps_done == list(range(steps)), steps_done  # every step once, the failed one redone
        sizes = [size for i, size, _ in res["losses"]]
        middle = (join or steps) - at
        assert sizes == [ranks] * at + [ranks - 1] * middle + [final] * (steps - at - middle)
        assert res["w"] == results[0]["w"]
    newcomer = doc["newcomer"]
    if join:
        assert [e["kind"] for e in newcomer["events"]] == ["joined"]
        assert newcomer["events"][0]["rank"] == ranks - 1 and newcomer["events"][0]["step"] == join
        assert [i for i, _, _ in newcomer["losses"]] == list(range(join, steps))
        assert newcomer["w"] == results[0]["w"]
        # The newcomer's losses are the same numbers the others computed: one job, one model.
        assert newcomer["losses"] == results[0]["losses"][join:]
    else:
        assert newcomer is None
    w_true = np.arange(1, 17) / 16
    if steps >= 60:
        assert np.abs(np.array(results[0]["w"]) - w_true).max() < 0.05
    assert "recovered on" in proc.stdout and "same final parameters on every rank: True" in proc.stdout
