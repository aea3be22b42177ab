"""World sizes that test_collectives_host's sweep (1-5 and 8) leaves to the schedule checker alone
(tests/algo/test_schedules.py proves every schedule symbolically for 1..64 ranks): at 6 (even, not a power of two)
and 7 (an odd prime above 5) every algorithm of every collective and every root also executes on the host backend
and is compared bit for bit, with test_collectives_host's case table and worker. The dtype x op, large, hierarchical
and bad-input sections are left out: they do not depend on the world size's shape."""

from __future__ import annotations

import time

import helpers
import pytest
import test_collectives_host as sweep

import gpucoll

pytestmark = [pytest.mark.slow, pytest.mark.spawns, *helpers.timeout_mark(600)]

WORLD_SIZES = (6, 7)
SECTIONS = ("algos", "roots")


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def reports(request):
    W = request.param
    cases = [c for c in sweep.cases_for(W) if c[0] in SECTIONS]
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        sweep._clean_env(mp)
        per_rank = gpucoll.spawn(sweep._collectives_worker, W, args=(cases, {}), backend="host",
                                 timeout=sweep.TIMEOUT)
    print(f"\nworld size {W} ({', '.join(SECTIONS)}): {time.monotonic() - t0:.1f} s")
    return W, per_rank, cases


def test_every_algorithm_and_root_executes_at_world_sizes_6_and_7(reports):
    W, per_rank, cases = reports
    for section in SECTIONS:
        sweep._check_section(W, per_rank, section, sweep._expected([c for c in cases if c[0] == section], per_rank))
    assert not [f for rep in per_rank for f in rep["failures"]], per_rank[0]["failures"][:5]
