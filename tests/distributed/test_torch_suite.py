"""torch's own DistributedTest suite on gpucoll (CPU, world size 2): every test gloo passes here must pass on gpucoll.

The tests are the ones tests/distributed/torch_suite_gloo_passes.txt lists (written by ``python tests/torch_suite.py
--write``, which runs the whole suite on gloo and on gpucoll and prints the comparison and every skip with its
reason). They run on long-lived ranks (tests/torch_suite.py): two processes for the whole list, not two per test as
upstream's runner spawns. A test gated to gloo by name inside the suite runs anyway (gpucoll stands in for gloo).

What gpucoll does not pass yet is marked xfail with the reason (strict where it fails every time, so that a fix shows
up as an unexpected pass).
"""

from __future__ import annotations

import helpers
import pytest
import torch_suite

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's test suite imports expecttest (pip install expecttest)")

pytestmark = helpers.timeout_mark(900)

LISTED = torch_suite.read_passes()
NAMES = LISTED.get(2, [])

# Tests gloo passes and gpucoll does not, and why.
GAPS = {
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier refuses every backend but gloo by name",
    "test_monitored_barrier_gloo_rank_0_timeout": "torch's dist.monitored_barrier refuses every backend but gloo by "
                                                  "name",
    "test_monitored_barrier_gloo_subgroup": "torch's dist.monitored_barrier refuses every backend but gloo by name",
    "test_barrier_timeout_full_group": "the suite matches gloo's wording (' Timed out ', ' closed ', ' timeout ') in "
                                       "the error; gpucoll's timeout error says 'timed out after 1 s waiting for ...'",
    "test_accumulate_gradients_no_sync_allreduce_hook": "gradients differ from the local model's after no_sync with "
                                                        "a DDP comm hook: not diagnosed yet",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "as test_accumulate_gradients_no_sync_allreduce_hook",
}
# Of those, the ones that fail in some runs and pass in others (seen here: with_then_hook failed in the full run
# and passed alone): not strict, so CI does not hinge on the order of threads, until they are understood.
INTERMITTENT = {"test_accumulate_gradients_no_sync_allreduce_hook",
                "test_accumulate_gradients_no_sync_allreduce_with_then_hook"}


CATALOG: dict = {}


@pytest.fixture(scope="module")
def results():
    return torch_suite.run("gpucoll", 2, NAMES, force=set(NAMES), catalog=CATALOG)


def test_list_is_the_suites(results):
    """Every listed test exists in this torch's suite (the list is checked, not trusted)."""
    missing = [n for n in NAMES if n not in CATALOG]
    assert NAMES and not missing, missing
    assert set(GAPS) <= set(NAMES), sorted(set(GAPS) - set(NAMES))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=n not in INTERMITTENT, reason=GAPS[n]))
                                  if n in GAPS else n for n in NAMES])
def test_passes_on_gpucoll(results, name):
    status, detail = results[name]
    assert status == torch_suite.PASS, f"{status}: {detail[-3000:]}"
