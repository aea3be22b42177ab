"""The worker thread of gpucoll.torch (gpucoll/torch/_worker.py) is stopped at interpreter exit, after the job it
is running, instead of being killed by finalization mid-job: DDP's hook left it completing a future while the main
thread exited, and the process aborted ("terminate called without an active exception") in about a third of the
README's DDP runs."""

from __future__ import annotations

import subprocess
import sys

import helpers
import pytest

SCRIPT = """
import threading, time, sys
import torch
from gpucoll.torch._worker import Worker

started = threading.Event()

def job():
    started.set()
    time.sleep(0.5)                      # still running when the main thread leaves
    open(sys.argv[1], "w").write("finished")

worker = Worker("gpucoll-exit-test")
fut = worker.submit(job, [torch.ones(4)]).get_future()
fut.then(lambda f: f.value()[0] + 1)
started.wait(10)
"""


@pytest.mark.spawns
def test_exit_waits_for_the_job_the_worker_is_running(tmp_path):
    helpers.require("torch", "the worker serves gpucoll.torch")
    script, mark = tmp_path / "exit_race.py", tmp_path / "mark"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(mark)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mark.read_text() == "finished", "the interpreter ended the worker thread in the middle of its job"
