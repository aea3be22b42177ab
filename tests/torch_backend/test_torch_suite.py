"""torch's own DistributedTest suite on gpucoll (CPU, world size 2, and 4 for the tests that need it): every test gloo
passes here must pass on gpucoll.

The tests are the ones tests/torch_backend/torch_suite_gloo_passes.txt lists (written by ``python tests/torch_backend/torch_suite.py
--write``, which runs the whole suite on gloo and on gpucoll and prints the comparison and every skip with its
reason). They run on long-lived ranks (tests/torch_backend/torch_suite.py): two processes for the whole list, not two per test as
upstream's runner spawns. A test gated to gloo by name inside the suite runs anyway (gpucoll stands in for gloo).

What gpucoll does not pass yet is marked xfail(strict) with the reason, so that a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import helpers
import pytest
import torch_suite

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's test suite imports expecttest (pip install expecttest)")

pytestmark = [pytest.mark.slow, pytest.mark.spawns, *helpers.timeout_mark(900)]

LISTED = torch_suite.read_passes()  # {world size: [test, ...]}
NAMES = LISTED.get(2, [])

# Tests gloo passes and gpucoll does not, and why.
GAPS = {
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier refuses every backend but gloo by name",
    "test_monitored_barrier_gloo_rank_0_timeout": "torch's dist.monitored_barrier refuses every backend but gloo by "
                                                  "name",
    "test_monitored_barrier_gloo_subgroup": "torch's dist.monitored_barrier refuses every backend but gloo by name",
    "test_barrier_timeout_full_group": "the suite matches gloo's wording (' Timed out ', ' closed ', ' timeout ') in "
                                       "the error; gpucoll's timeout error says 'timed out after 1 s waiting for ...'",
}
CATALOG: dict = {}  # the suite's tests, filled when the ranks start


@pytest.fixture(scope="module")
def results():
    """{(world size, test): (status, detail)}: one pool of ranks per world size."""
    out = {}
    for ws, names in sorted(LISTED.items()):
        for name, res in torch_suite.run("gpucoll", ws, names, force=set(names), catalog=CATALOG).items():
            out[ws, name] = res
    return out


def test_list_is_the_suites(results):
    """Every listed test exists in this torch's suite (the list is checked, not trusted)."""
    missing = [n for names in LISTED.values() for n in names if n not in CATALOG]
    assert NAMES and not missing, missing
    assert set(GAPS) <= set(NAMES), sorted(set(GAPS) - set(NAMES))


@pytest.mark.parametrize("ws,name", [pytest.param(ws, n, marks=pytest.mark.xfail(strict=True, reason=GAPS[n]))
                                     if n in GAPS else (ws, n) for ws, names in sorted(LISTED.items()) for n in names])
def test_passes_on_gpucoll(results, ws, name):
    status, detail = results[ws, name]
    assert status == torch_suite.PASS, f"{status}: {detail[-3000:]}"
