"""gpucoll.spawn refuses, in the parent and before any rank starts, what multiprocessing's "spawn" children cannot
run, with one error that says what to do: a call from a main script's top level without a main guard, a lambda or
nested function, a function typed into an interactive session (here: stdin), and arguments that cannot be pickled.
Scripts run in a subprocess, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import gpucoll
from gpucoll.errors import InvalidArgument

WORK = """
import numpy as np
import gpucoll

def work(comm):
    x = np.full(4, comm.rank + 1, dtype=np.float32)
    comm.all_reduce(x)
    return float(x[0])
"""


def _python(tmp_path, body: str, stdin: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "GPUCOLL_"))}
    code = textwrap.dedent(body)
    if stdin:
        return subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120,
                              env=env, cwd=tmp_path, check=False)
    script = tmp_path / "job.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path, check=False)


def _one_clear_error(res, *phrases):
    err = res.stderr
    assert res.returncode != 0, res.stdout + err
    assert err.count("Traceback (most recent call last)") == 1, err  # one error, from the parent
    assert "bootstrapping phase" not in err and "RemoteError" not in err, err
    for phrase in phrases:
        assert phrase in err, err


@pytest.mark.spawns
def test_top_level_spawn_without_a_main_guard_is_one_clear_error(tmp_path):
    res = _python(tmp_path, WORK + "print(gpucoll.spawn(work, 2, backend='host', timeout=30))\n")
    _one_clear_error(res, "InvalidUsage", "without a main guard", 'if __name__ == "__main__":', "job.py (line 9)")


@pytest.mark.spawns
def test_spawn_in_a_function_called_from_the_top_level_is_refused_too(tmp_path):
    body = WORK + "def main():\n    return gpucoll.spawn(work, 2, backend='host', timeout=30)\n\nprint(main())\n"
    _one_clear_error(_python(tmp_path, body), "InvalidUsage", "without a main guard", "(line 12)")


@pytest.mark.spawns
def test_the_same_script_with_a_main_guard_runs(tmp_path):
    body = WORK + "if __name__ == '__main__':\n    print(gpucoll.spawn(work, 2, backend='host', timeout=30))\n"
    res = _python(tmp_path, body)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[3.0, 3.0]"


@pytest.mark.spawns
def test_a_program_read_from_stdin_is_refused_before_any_rank_starts(tmp_path):
    res = _python(tmp_path, WORK + "print(gpucoll.spawn(work, 2, backend='host', timeout=30))\n", stdin=True)
    _one_clear_error(res, "InvalidUsage", "read from <stdin>", "Save the program as a .py file")


@pytest.mark.spawns
def test_a_function_typed_into_an_interactive_session_is_refused_before_any_rank_starts(tmp_path):
    """python -c runs its code as __main__ without a file, as the interactive interpreter does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "GPUCOLL_"))}
    code = WORK + "print(gpucoll.spawn(work, 2, backend='host', timeout=30))\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path, check=False)
    _one_clear_error(res, "InvalidArgument", "interactive session", "Put fn in a .py file")


def _rank_of(comm, *args):
    return comm.rank


def _nested():
    def inner(comm):
        return comm.rank

    return inner


@pytest.mark.parametrize("fn, what", [(lambda comm: comm.rank, "lambda"), (_nested(), "inside another function")])
def test_lambdas_and_nested_functions_are_refused_before_any_rank_starts(fn, what):
    before = threading.active_count()
    with pytest.raises(InvalidArgument, match=f"{what}.*Define it with `def` at the top level of a module"):
        gpucoll.spawn(fn, 2, backend="host", timeout=30)
    assert threading.active_count() == before  # no queue feeder thread: nothing was started


def test_unpicklable_arguments_are_refused_before_any_rank_starts():
    with pytest.raises(InvalidArgument, match="args cannot be sent to the spawned ranks"):
        gpucoll.spawn(_rank_of, 2, args=(threading.Lock(),), backend="host", timeout=30)
