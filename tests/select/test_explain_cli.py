"""`python -m gpucoll explain ...`: the table of algorithms for one call, run as a user would (subprocess).

The numbers it prints are checked against gpucoll._C (the selector and the model), so the CLI cannot drift from
what algo="auto" does.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

from gpucoll import _C

pytestmark = pytest.mark.spawns

COLLS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
ROW = re.compile(r"^\s*(\w+)\s+(\d+|-)\s")


def explain(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "gpucoll.algo", "explain", *args], capture_output=True, text=True,
                          timeout=60, env=_env(), check=False)
    if check:
        assert proc.returncode == 0, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def _env():
    import os

    env = dict(os.environ)
    for var in ("GPUCOLL_ALGO", "GPUCOLL_LOCAL_SIZE", "GPUCOLL_TUNING_FILE"):
        env.pop(var, None)
    return env


def rows(stdout: str) -> dict:
    """{algorithm: (steps or None, the whole line)} for the table rows."""
    names = set(_C.algorithm_names())
    out = {}
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m and m.group(1) in names:
            out[m.group(1)] = (None if m.group(2) == "-" else int(m.group(2)), line)
    return out


def implementing(coll):
    return [a for a in _C.algorithm_names() if _C.algorithm_supports(a, COLLS.index(coll))]


@pytest.fixture(scope="module")
def all_reduce_8_1m():
    return explain("all_reduce", "--nranks", "8", "--bytes", "1M").stdout


def test_lists_every_all_reduce_algorithm_with_steps(all_reduce_8_1m):
    table = rows(all_reduce_8_1m)
    assert set(table) == set(implementing("all_reduce")), all_reduce_8_1m
    assert "direct" not in table  # does not implement all_reduce: not listed at all
    assert table["ring"][0] == 14, table["ring"]
    for name, (steps, _) in table.items():
        assert steps == _C.predict(name, 0, 8, 1 << 20, 0)["steps"], (name, steps)
    assert "8 ranks" in all_reduce_8_1m and "1.00 MiB" in all_reduce_8_1m


def test_exactly_one_auto_marker_on_the_selected_algorithm(all_reduce_8_1m):
    marked = [name for name, (_, line) in rows(all_reduce_8_1m).items() if line.rstrip().endswith("<- auto")]
    assert all_reduce_8_1m.count("<- auto") == 1, all_reduce_8_1m
    assert marked == [_C.select_algorithm(0, 8, 1 << 20, 0, "auto")], all_reduce_8_1m


def test_steps_prints_every_schedule_step():
    out = explain("all_reduce", "--nranks", "4", "--bytes", "1K", "--steps").stdout
    table = rows(out)
    for name, (steps, _) in table.items():
        header = re.search(rf"^## {name}: (\d+) steps?,", out, re.MULTILINE)
        assert header and int(header.group(1)) == steps, (name, out)
        section = out[header.end():].split("\n## ")[0]
        assert len(re.findall(r"^\s+step \d+:", section, re.MULTILINE)) == steps, (name, section)
    assert "step 0: r3->r0: chunk 2 reduce" in out  # ring: rank 0 reduces from its left neighbour first


def test_local_size_that_does_not_divide_shows_why_hierarchical_cannot_run():
    out = explain("all_reduce", "--nranks", "8", "--bytes", "1M", "--local-size", "3").stdout
    steps, line = rows(out)["hierarchical"]
    assert steps is None and "cannot run" in line and "local_size=3 does not divide world size 8" in line, out
    assert out.count("<- auto") == 1 and "<- auto" not in line
    assert "local_size 3" in out


def test_local_size_that_divides_makes_hierarchical_two_level():
    out = explain("all_reduce", "--nranks", "8", "--bytes", "1M", "--local-size", "2").stdout
    assert rows(out)["hierarchical"][0] == 2 * (2 - 1) + 2 * (4 - 1), out


@pytest.mark.parametrize("coll", ["broadcast", "gather", "all_to_all", "reduce_scatter"])
def test_other_collectives(coll):
    out = explain(coll, "--nranks", "4", "--bytes", "64K", "--root", "3").stdout
    table = rows(out)
    assert set(table) == set(implementing(coll)), out
    assert out.count("<- auto") == 1
    if coll in ("broadcast", "gather"):
        assert "root 3" in out


def test_explain_function_returns_the_table():
    from gpucoll.cli.explain import explain as explain_fn

    buf = io.StringIO()
    d = explain_fn("all_reduce", 8, 1 << 20, out=buf)
    assert d["auto"] == _C.select_algorithm(0, 8, 1 << 20, 0, "auto")
    assert d["algorithms"]["ring"]["steps"] == 14
    assert "<- auto" in buf.getvalue()


@pytest.mark.parametrize("args, fragment", [
    (["nosuch_coll"], "invalid choice"),
    (["all_gather", "--nranks", "3", "--bytes", "1000"], "not a multiple of 3 (try 999 or 1002)"),
    (["reduce_scatter", "--nranks", "4", "--bytes", "2"], "not a multiple of 4"),
    (["all_reduce", "--nranks", "0"], "--nranks"),
    (["all_reduce", "--nranks", "-3"], "--nranks"),
    (["all_reduce", "--nranks", "eight"], "--nranks"),
    (["all_reduce", "--bytes", "1Q"], "1Q"),
    (["all_reduce", "--bytes", "-5"], "-5"),
    (["all_reduce", "--no-such-flag"], "--no-such-flag"),
    ([], "collective"),
])
def test_bad_arguments_exit_non_zero(args, fragment):
    proc = explain(*args, check=False)
    assert proc.returncode != 0, (args, proc.stdout)
    assert fragment in proc.stderr, (args, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_no_subcommand_exits_non_zero():
    proc = subprocess.run([sys.executable, "-m", "gpucoll.algo"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["broadcast", "--nranks", "4", "--root", "9"], "--root"),
    (["reduce", "--nranks", "4", "--root", "-1"], "--root"),
    (["gather", "--nranks", "4", "--root", "4", "--steps"], "--root"),
    (["all_reduce", "--nranks", "8", "--local-size", "-1"], "--local-size"),
])
def test_out_of_range_root_or_local_size_exits_non_zero(args, fragment):
    """Rejected before any table is printed (these were once accepted: a table for 'root 9', exit 0)."""
    proc = explain(*args, check=False)
    assert proc.returncode != 0, (args, proc.stdout)
    assert fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "<- auto" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("spelling", ["allreduce", "all-reduce", "AllReduce", "all_reduce_perf"])
def test_collective_names_as_gpucoll_bench_takes_them(spelling):
    out = explain(spelling, "--nranks", "4", "--bytes", "64K").stdout
    assert out.startswith("# all_reduce: 4 ranks, 64.00 KiB")


def test_every_name_gpucoll_bench_takes_is_explained():
    """explain refused sendrecv, though it takes gpucoll-bench's names: the point-to-point ones say that they have no
    algorithm to choose."""
    from gpucoll.bench import colls
    from gpucoll.cli.explain import explain as explain_fn

    for name in colls.names():
        buf = io.StringIO()
        d = explain_fn(name, 2, 64 << 10, out=buf)
        assert d["collective"] == name and buf.getvalue().startswith(f"# {name}"), name
    proc = explain("sendrecv_perf", "--nranks", "2")
    assert proc.stdout.startswith("# sendrecv: point-to-point") and "no algorithm to choose" in proc.stdout
    assert "<- auto" not in proc.stdout


def test_tuning_file_that_makes_another_algorithm_cheapest_says_there_why_auto_keeps_its_pick(tmp_path):
    """With a fit that prices tree far below the rest, the table showed tree cheapest and auto on twoshot, with no
    word on that row: it says so there, why, and how good the fit is."""
    fit = {"a_s": 1e-6, "b_s_per_byte": 1e-11, "source": "test", "r2": 0.39, "max_rel_error": 0.88, "poor": True}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": "gpucoll-tuning", "version": 1, "fits": {"host:tree@SHM": fit}}))
    proc = subprocess.run([sys.executable, "-m", "gpucoll.algo", "explain", "all_reduce", "--nranks", "4", "--bytes",
                           "1M"], capture_output=True, text=True, timeout=60, check=True,
                          env=dict(_env(), GPUCOLL_TUNING_FILE=str(path)))
    table = rows(proc.stdout)
    auto = _C.select_algorithm(0, 4, 1 << 20, 0, "auto")
    assert auto != "tree" and table[auto][1].endswith("<- auto")
    assert table["tree"][1].endswith("tuned (poor fit: R^2 0.39, max err 88%); cheapest with the tuning file, not "
                                     "auto's pick (see below)"), table["tree"][1]
    assert (f"# tree is cheapest by the tuning file's fits, yet auto picks {auto}: auto on the host backend prices "
            f"the algorithms by the host cost model in the header, never by GPUCOLL_TUNING_FILE") in proc.stdout


def test_one_step_is_singular_and_the_columns_are_explained():
    out = explain("all_reduce", "--nranks", "2", "--bytes", "4K", "--steps").stdout
    assert "## oneshot: 1 step, buffer in 1 chunk, result in" in out, out
    assert "1 steps" not in out and "1 chunks" not in out
    assert "# steps: synchronised steps of the schedule per piece; sent/rank, recv/rank: bytes the busiest rank" in out


def test_help_explains_every_option_with_its_default():
    out = subprocess.run([sys.executable, "-m", "gpucoll.algo", "explain", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    options = out.split("\noptions:", 1)[1]
    for option, default in (("--nranks", "8"), ("--bytes", "1M"), ("--local-size", "0"), ("--root", "0")):
        block = options.split(f"\n  {option}", 1)[1].split("\n  -", 1)[0]
        assert f"(default: {default})" in block, (option, block)
    assert "allreduce" in out and "`" not in out


def test_a_closed_pipe_ends_quietly():
    """`explain ... | head -1`: the reader leaves after one line; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "gpucoll.algo", "explain", "all_reduce", "--nranks", "64", "--bytes",
                             "64M", "--steps"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout.readline().startswith(b"# all_reduce")
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 1


def test_tuning_file_prices_the_algorithms_it_fits(tmp_path):
    """GPUCOLL_TUNING_FILE (gpucoll-tune's output) changes the prediction of each algorithm it fits on the host
    backend (host:<algorithm>@SHM: steps x a + bytes x b, the topology model's terms), and says so."""
    fits = {"host:ring@SHM": {"a_s": 1e-3, "b_s_per_byte": 1e-9, "source": "test"},
            "host:twoshot@SHM": {"a_s": 2e-6, "b_s_per_byte": 2e-11, "source": "test"}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": "gpucoll-tuning", "version": 1, "fits": fits}))
    args = ("all_reduce", "--nranks", "4", "--bytes", "1M")
    default = rows(explain(*args).stdout)
    env = dict(_env(), GPUCOLL_TUNING_FILE=str(path))
    proc = subprocess.run([sys.executable, "-m", "gpucoll.algo", "explain", *args], capture_output=True, text=True,
                          timeout=60, env=env, check=True)
    tuned = rows(proc.stdout)
    assert f"GPUCOLL_TUNING_FILE={path}" in proc.stdout
    for name, fit in fits.items():
        algo = name[5:-4]
        steps, per_byte = _C.topo_model_terms("custom", algo, "all_reduce", 4, 4)
        want = (steps * fit["a_s"] + per_byte * (1 << 20) * fit["b_s_per_byte"]) * 1e6
        got = float(re.search(r"([\d.]+) us", tuned[algo][1]).group(1))
        assert abs(got - want) < 0.1 and "tuned" in tuned[algo][1], (algo, tuned[algo][1], want)
        assert tuned[algo][1] != default[algo][1]
    assert tuned["tree"][1] == default["tree"][1]  # not in the file: the default model
    path.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "gpucoll.algo", "explain", *args], capture_output=True, text=True,
                          timeout=60, env=env, check=False)
    assert proc.returncode == 2 and "GPUCOLL_TUNING_FILE" in proc.stderr and "Traceback" not in proc.stderr
