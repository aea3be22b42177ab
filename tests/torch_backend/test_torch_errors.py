"""Errors of the torch.distributed backend "gpucoll" as a torch user meets them.

* Types: what leaves the group (a method torch calls, a Work's ``wait()``) is torch's ``DistBackendError`` (a
  ``RuntimeError``, as gloo's and NCCL's errors are) and gpucoll's own class at once, with gpucoll's message; it
  pickles as itself.
* A rank that never enters the group's first collective: the others' timeout names the collective, its number and
  the missing rank, as it does for any later collective, and not the store key that the communicator's set-up
  waited for.
"""

from __future__ import annotations

import pickle

import helpers
import pytest
import torch_ranks

torch = helpers.require("torch")
dist = helpers.require("torch.distributed")

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]


def _never_enters_worker(rank, n, late):
    import datetime
    import pickle
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gpucoll", timeout=datetime.timedelta(seconds=2))
    if rank == late:
        time.sleep(3)  # alive, but never enters the group's first collective
        return None
    try:
        dist.all_reduce(torch.ones(4))
        return None
    except Exception as e:  # noqa: BLE001 - described for the parent
        back = pickle.loads(pickle.dumps(e))
        return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                "ranks": getattr(e, "ranks", None), "dist": isinstance(e, dist.DistBackendError),
                "gpucoll": [c.__name__ for c in type(e).__mro__ if c.__module__ == "gpucoll.errors"],
                "pickled": (type(back) is type(e), str(back), back.ranks)}


def test_a_rank_that_never_enters_the_first_collective_is_named():
    """The others timed out with "timed out after 2 s waiting for key 'gpucoll/host/0/hostname/2' in
    torch.distributed's store", an OSError that `except RuntimeError` (gloo's, NCCL's type) missed. Rank 0 waits
    for the late rank itself, rank 1 for rank 0's verdict: both must name rank 2."""
    res = torch_ranks.run(_never_enters_worker, 3, 2, backend=None)
    for rank in (0, 1):
        err = res[rank]
        assert err is not None, f"rank {rank}: the collective completed without rank 2"
        want = (f"all_reduce #1 on rank {rank} timed out after 2 s waiting for rank 2, which had not entered it "
                f"(this group's first operation on cpu tensors, where gpucoll sets up its cpu communicator)")
        assert err["message"].startswith(want), err["message"]
        assert "store" not in err["message"] and "key" not in err["message"], err["message"]
        assert err["type"] == "gpucoll.torch.errors.CollectiveTimeout" and err["ranks"] == (2,), err
        assert err["dist"] and err["gpucoll"] == ["CollectiveTimeout", "GpucollError"], err
        assert err["pickled"] == (True, err["message"], (2,)), err


def test_errors_from_the_group_and_its_works_are_torchs_and_gpucolls():
    """The group's own checks and a failed Work raise DistBackendError subclasses that stay gpucoll's classes; a
    timeout is still a TimeoutError, as gpucoll's CollectiveTimeout is outside torch."""
    from gpucoll.errors import CollectiveTimeout, GpucollError, InvalidArgument
    from gpucoll.torch.process_group import ProcessGroupGpucoll
    from gpucoll.torch.work import Work

    pg = ProcessGroupGpucoll(dist.HashStore(), 0, 1, timeout=10.0)
    try:
        try:
            pg.allgather([[torch.zeros(2), torch.zeros(2)]], [torch.ones(2)])  # needs world_size (1) outputs
        except RuntimeError as e:
            raised = e
        else:
            raise AssertionError("allgather with 2 outputs on a group of 1 did not raise")
        assert isinstance(raised, dist.DistBackendError) and isinstance(raised, InvalidArgument), type(raised).__mro__
        assert str(raised).startswith("all_gather: tensor_list needs world_size (1) tensors; got 2"), str(raised)
        back = pickle.loads(pickle.dumps(raised))
        assert type(back) is type(raised) and str(back) == str(raised)
    finally:
        pg.shutdown()

    work = Work([])
    work._settled(CollectiveTimeout("all_reduce #3 on rank 0 timed out after 2 s waiting for rank 1", ranks=(1,)))
    for call in (work.wait, work.is_completed):
        try:
            call()
        except dist.DistBackendError as e:
            assert isinstance(e, CollectiveTimeout) and isinstance(e, TimeoutError) and e.ranks == (1,), repr(e)
            assert str(e) == "all_reduce #3 on rank 0 timed out after 2 s waiting for rank 1"
        else:
            raise AssertionError(f"{call.__name__} did not raise")
    assert isinstance(work.exception(), dist.DistBackendError)
    plain = GpucollError("outside torch")
    assert not isinstance(plain, RuntimeError)  # gpucoll's own classes are untouched
