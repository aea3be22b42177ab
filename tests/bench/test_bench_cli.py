"""gpucoll-bench: flag parsing, nccl-tests' exact table format, the check and the exit status.

Spawning ranks costs about 0.5 s each time, so the multi-rank runs are few and each asserts much: the
end-to-end run checks the table and the JSON of one invocation. Single-rank runs go through main() in this
process (one rank runs in-process: no spawn). The reference text below was printed by a C program using
nccl-tests' own format strings (src/util.cu, nccl-tests 2.19.6).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gpucoll import _C
from gpucoll.bench import cli, colls, report
from gpucoll.bench.harness import Params, sizes

pytestmark = pytest.mark.spawns

NCCL_TESTS_HEADER = (
    "#\n"
    "#                                                              out-of-place                       in-place          \n"
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong \n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         \n"
)
NCCL_TESTS_ROWS = (
    "           8             2     float     sum      -1   278.59    0.00    0.00       0   129540    0.26    0.39       3\n"
    "    33554432       8388608  bfloat16     avg      -1  1.2e+07  123457    9.88  1.23457e+06     0.00   1e+09  1234.5    N/A\n"
)
ROW_RE = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)"
                    r"\s+(\S+)$")


def _have_gpu() -> bool:
    from gpucoll import _C

    return int(_C.cuda_probe().get("device_count", 0) or 0) > 0


HAVE_GPU = _have_gpu()


def bench(*args, timeout=120):
    """Run the gpucoll-bench console script (through its module, so no PATH dependence)."""
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                             "SLURM_PROCID")}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)


def rows(text):
    return [m.groups() for m in map(ROW_RE.match, text.splitlines()) if m]


@pytest.fixture
def no_launcher(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(v, raising=False)


# -- format ------------------------------------------------------------------------------------------------
def test_header_is_nccl_tests_header():
    assert "".join(report.header_lines()) == NCCL_TESTS_HEADER


def test_rows_and_footer_match_nccl_tests_printf():
    text = (report.row_preamble(8, 2, "float", "sum", -1) + report.row_body(278.59, 0.0000287, 0.0000287, 0)
            + report.row_body(129540.3, 0.26, 0.39, 3) + "\n"
            + report.row_preamble(33554432, 8388608, "bfloat16", "avg", -1)
            + report.row_body(12345678.9, 123456.7, 9.87654, 1234567) + report.row_body(0.004, 1e9, 1234.5, None)
            + "\n")
    assert text == NCCL_TESTS_ROWS
    foot = report.footer_lines(0, 0.39654, "p") + report.footer_lines(3, 1234567.0, "p")
    assert foot[0] == "# Out of bounds values : 0 OK\n"
    assert foot[1] == "# Avg bus bandwidth    : 0.39654 \n"
    assert foot[4] == "# Out of bounds values : 3 FAILED\n"
    assert foot[5] == "# Avg bus bandwidth    : 1.23457e+06 \n"


# -- parsing (no ranks) ------------------------------------------------------------------------------------
def test_defaults_are_nccl_tests_defaults():
    p = cli.parse_args(["all_reduce"])
    assert (p.minbytes, p.maxbytes, p.stepbytes, p.stepfactor) == (32 << 20, 32 << 20, 1 << 20, 1)
    assert (p.iters, p.warmup_iters, p.check, p.dtypes, p.ops, p.algos) == (20, 1, 1, ["float"], ["sum"], ["auto"])
    assert p.nranks is None and p.backend == "auto" and p.json is None and not p.inject_error


def test_flags_long_and_short():
    p = cli.parse_args(["all_reduce", "-b", "8", "-e", "1M", "-f", "4", "-n", "5", "-w", "2", "-c", "0", "-d",
                        "half,float32", "-o", "max", "-a", "1", "--nranks", "3", "--algo", "ring", "-T", "7.5"])
    assert (p.minbytes, p.maxbytes, p.stepfactor, p.iters, p.warmup_iters, p.check) == (8, 1 << 20, 4, 5, 2, 0)
    assert (p.dtypes, p.ops, p.average, p.nranks, p.algos, p.timeout) == (["half", "float"], ["max"], 1, 3,
                                                                          ["ring"], 7.5)
    q = cli.parse_args(["all_reduce", "--minbytes", "64K", "--maxbytes", "2G", "--stepbytes", "1K",
                        "--iters", "3", "--warmup_iters", "0", "--check", "2", "--datatype", "int8", "--op", "prod"])
    assert (q.minbytes, q.maxbytes, q.stepbytes, q.iters, q.warmup_iters, q.check) == (65536, 2 << 30, 1024, 3, 0, 2)
    assert (q.dtypes, q.ops) == (["int8"], ["prod"])


def test_algo_all_says_which_algorithms_it_skipped_and_why_in_a_sentence():
    notes = cli.parse_args(["all_reduce", "--algo", "all"]).notes
    assert "--algo all: skipped direct, which does not implement all_reduce" in notes, notes


def test_all_expands_in_nccl_tests_order(monkeypatch):
    import importlib.util

    p = cli.parse_args(["all_reduce", "-o", "all"])
    assert p.ops == ["sum", "prod", "max", "min", "avg"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    p = cli.parse_args(["all_reduce", "-d", "all"])
    assert p.dtypes == ["int8", "uint8", "int32", "int64", "half", "float", "double"]
    assert any("bfloat16 skipped" in n for n in p.notes)
    with pytest.raises(SystemExit):
        cli.parse_args(["all_reduce", "-d", "bfloat16"])  # asked for by name without torch: an error


@pytest.mark.parametrize("argv, message", [
    (["-b", "foo"], "invalid size 'foo'"),
    (["-e", "1X"], "invalid size '1X'"),
    (["-b", "2M", "-e", "1M"], "invalid sizes"),
    (["-d", "float128"], "unknown datatype 'float128'"),
    (["-o", "xor"], "unknown op 'xor'"),
    (["-n", "0"], "must be >= 1"),
    (["--algo", "nosuch"], "unknown --algo 'nosuch'"),
    (["--backend", "mpi"], "unknown backend 'mpi'"),
    (["--backend", "host,gloo"], "unknown backend 'gloo'"),
    (["-z", "2"], "invalid choice"),
    (["-G", "-1"], "must be >= 0"),
    (["-f", "1", "-i", "0"], "stepbytes must be above 0"),
])
def test_bad_usage_is_a_clear_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["all_reduce", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_sizes_follow_nccl_tests_loop():
    assert sizes(Params(minbytes=8, maxbytes=1 << 20, stepfactor=4)) == [8 * 4**k for k in range(9)]
    assert sizes(Params(minbytes=1000, maxbytes=3500, stepbytes=1000)) == [1000, 2000, 3000]
    assert sizes(Params(minbytes=0, maxbytes=64, stepfactor=2)) == [0]


def test_exit_status_uses_local_counts_too():
    assert cli.exit_status([{"errors": 0, "errors_local": 0, "wrong_local": 0}]) == 0
    assert cli.exit_status([{"errors": 2}]) == 1
    # The cross-rank sum itself may be garbled by a broken collective: a rank's own count still fails the run.
    assert cli.exit_status([{"errors": 0}, {"errors": 0, "errors_local": 1, "wrong_local": 5}]) == 1


def test_patterns_are_exact_and_not_trivial():
    import numpy as np

    for n in (1, 2, 3, 8):
        for dt in colls.DTYPES.values():
            for op in colls.OPS:
                exp = colls.reduced_input(dt, op, n)
                ins = [colls.rank_input(dt, op, r, n) for r in range(n)]
                assert exp.dtype == np.dtype(dt.storage) and exp.size == colls.period(n)
                if n > 1 and op in ("sum", "avg"):
                    assert all(not np.array_equal(exp, x) for x in ins), (dt.name, op)
    buf = np.empty(3 * colls.period(2) + 17, np.float32)
    e = colls.Expect(buf, colls.reduced_input(colls.DTYPES["float"], "sum", 2), offset=5)
    colls.fill(buf, e.pattern, offset=5)
    assert colls.count_wrong(e) == 0
    colls.corrupt(buf)
    assert colls.count_wrong(e) == 1


# -- runs --------------------------------------------------------------------------------------------------
def test_two_ranks_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    res = bench("all_reduce", "--nranks", "2", "--backend", "host", "-b", "8", "-e", "1M", "-f", "4", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert NCCL_TESTS_HEADER in res.stdout
    got = rows(res.stdout)
    assert [int(r[0]) for r in got] == [8 * 4**k for k in range(9)]
    for r in got:
        assert r[2:5] == ("float", "sum", "-1") and int(r[1]) == int(r[0]) // 4
        assert r[8] == "0" and r[12] == "0"  # #wrong out of place, in place
        assert float(r[5]) > 0 and float(r[9]) > 0
    assert "# Out of bounds values : 0 OK\n" in res.stdout
    assert re.search(r"^# Avg bus bandwidth    : [0-9.e+-]+ $", res.stdout, re.MULTILINE)
    assert res.stdout.count("#  Rank ") == 2
    # What the ranks are (nccl-tests' "nGpus 1" said CPU ranks had a GPU each), and what auto ran at each size.
    assert "\n# nThread 1 nRanks 2 devices cpu minBytes 8 maxBytes 1048576 " in res.stdout
    picks = [_C.select_algorithm(0, 2, int(r[0]), 0, "auto") for r in got]
    runs = [(a, [int(r[0]) for r, p in zip(got, picks) if p == a]) for a in dict.fromkeys(picks)]
    assert len(runs) >= 2, runs  # the sweep crosses one of auto's size thresholds
    want = ", ".join([f"{runs[0][0]} up to {report.size_label(max(runs[0][1]))}"]
                     + [f"{a} at {report.size_label(min(s))}-{report.size_label(max(s))}" for a, s in runs[1:-1]]
                     + [f"{runs[-1][0]} from {report.size_label(min(runs[-1][1]))}"])
    assert f"# Algorithm: auto (picks {want})\n" in res.stdout, res.stdout

    doc = json.loads(out.read_text())
    assert doc["environment"]["nranks"] == 2 and doc["environment"]["backend"] == "host"
    assert (doc["config"]["ngpus"], doc["config"]["nranks"], doc["config"]["device_kind"]) == (0, 2, "cpu")
    assert doc["environment"]["gpucoll_version"] and doc["environment"]["hostname"]
    assert doc["config"]["minimum_bytes"] == 8 and doc["config"]["maximum_bytes"] == 1 << 20
    assert doc["out_of_bounds"] == {"count": 0, "okay": True}
    assert len(doc["results"]) == 9
    for row, text in zip(doc["results"], got):
        assert (row["size"], row["count"], row["type"], row["redop"], row["root"]) == (
            int(text[0]), int(text[1]), "float", "sum", -1)
        for place in ("out_of_place", "in_place"):
            assert set(row[place]) == {"time", "alg_bw", "bus_bw", "nwrong"}
            assert row[place]["nwrong"] == 0 and row[place]["time"] > 0
        assert abs(row["out_of_place"]["bus_bw"] - row["out_of_place"]["alg_bw"]) < 1e-12  # 2(n-1)/n = 1
        assert row["emulated"] is False  # every row says where it ran (True on gpucoll's emulated CUDA device)


@pytest.mark.slow
def test_every_dtype_and_op_is_exact():
    res = bench("all_reduce", "--nranks", "3", "-b", "8", "-e", "100K", "-f", "160", "-d", "all", "-o", "all",
                "-n", "1", "-w", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    got = rows(res.stdout)
    want_types = [t for t in colls.DTYPES if t != "bfloat16" or "bfloat16 skipped" not in res.stdout]
    assert {(r[2], r[3]) for r in got} == {(t, o) for t in want_types for o in colls.OPS}
    assert all(r[8] == "0" and r[12] == "0" for r in got)
    # 100K, -f 160 -> 8 and 1280 bytes; 1280 bytes = 320 floats, 1280 int8: more than a chunk per rank for 3 ranks
    assert {int(r[0]) for r in got} == {8, 1280}


@pytest.mark.skipif(HAVE_GPU, reason="checks the message shown on machines without a GPU")
@pytest.mark.parametrize("backend", ["nccl", "custom"])
def test_gpu_backend_without_gpu_is_refused(backend):
    res = bench("all_reduce", "--backend", backend, "-b", "8", "-e", "8")
    assert res.returncode != 0
    assert "--backend host" in res.stderr and backend in res.stderr


def test_bad_size_from_the_command_line():
    res = bench("all_reduce", "-b", "foo")
    assert res.returncode == 2
    assert "invalid size 'foo'" in res.stderr and "-b/--minbytes" in res.stderr


def test_wrong_result_fails_the_run(no_launcher, capsys):
    # One rank, in this process: --inject-error flips a bit of the result after each checked call, so the
    # checker, the cross-rank sum, the table and the exit status all see a real wrong element.
    rc = cli.main(["all_reduce", "-b", "8", "-e", "64", "-f", "8", "-d", "float,int8", "-n", "1", "--inject-error"])
    out = capsys.readouterr().out
    assert rc == 1
    got = rows(out)
    assert len(got) == 4 and all(r[8] == "1" and r[12] == "1" for r in got)
    assert "# Out of bounds values : 8 FAILED\n" in out


def test_single_rank_in_process_and_no_check(no_launcher, capsys):
    rc = cli.main(["all_reduce", "--backend", "host", "-b", "1K", "-e", "4K", "-f", "2", "-c", "0", "-n", "2", "--algo",
                   "ring"])
    out = capsys.readouterr().out
    assert rc == 0
    got = rows(out)
    assert [int(r[0]) for r in got] == [1024, 2048, 4096]
    assert all(r[8] == "N/A" and r[12] == "N/A" for r in got)
    assert "# Algorithm: ring\n" in out


def test_launcher_mode_uses_init_from_environment(monkeypatch, capsys):
    from gpucoll._spawn import free_port

    for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    rc = cli.main(["all_reduce", "-b", "8", "-e", "8", "-n", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and len(rows(out)) == 1 and "#  Rank  0 " in out


def test_python_dash_m_entry_point():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                             "SLURM_PROCID")}
    res = subprocess.run([sys.executable, "-m", "gpucoll.bench", "all_reduce", "-b", "8", "-e", "8", "-n", "1"],
                         check=False, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert len(rows(res.stdout)) == 1 and "# Collective test concluded" in res.stdout


# -- flags honoured, not only parsed ------------------------------------------------------------------------
class _OtherRank:
    """A 2-rank communicator whose other rank measured 3.0 s: what each -a mode makes of rank 0's 1.0 s."""

    backend = "host"

    def host_all_reduce(self, arr, op="sum"):
        import numpy as np

        other = np.full_like(arr, 3.0)
        arr[...] = {"sum": arr + other, "min": np.minimum(arr, other), "max": np.maximum(arr, other)}[op]
        return arr


@pytest.mark.parametrize("average, shown", [(0, 1.0), (1, 2.0), (2, 1.0), (3, 3.0)])
def test_average_mode_is_nccl_tests_allreduce_of_the_time(average, shown):
    from types import SimpleNamespace

    from gpucoll.bench import devmem, harness

    rank = SimpleNamespace(p=Params(average=average), n=2, mem=devmem.HostMem(), comm=_OtherRank())
    assert harness._Rank._time(rank, 1.0) == shown  # 0: this rank's own, 1: mean, 2: min, 3: max


def test_warmup_iters_and_check_counts_are_the_calls_made(no_launcher):
    import gpucoll
    from gpucoll._spawn import free_port
    from gpucoll.bench import harness

    calls = []

    class Counting:
        def __init__(self, comm):
            self._comm = comm

        def __getattr__(self, name):
            return getattr(self._comm, name)

        def all_reduce(self, x, *args, **kwargs):
            if x.size == 256:  # the row's buffers (1 KiB of float); the bookkeeping arrays are smaller
                calls.append(x.size)
            return self._comm.all_reduce(x, *args, **kwargs)

    comm = gpucoll.init(0, 1, backend="host", address="127.0.0.1", port=free_port(), timeout=60)
    try:
        res = harness.run_rank(Counting(comm), Params(minbytes=1024, maxbytes=1024, iters=7, warmup_iters=3, check=2,
                                                      quiet=True))
    finally:
        comm.close()
    assert len(calls) == 2 * (3 + 7 + 2)  # out of place, then in place: -w warmup + -n timed + -c checked calls
    assert res["rows"][0]["actual_iterations"] == 7 and res["rows"][0]["in_place"]["nwrong"] == 0


def test_a_size_the_collective_cannot_move_is_rounded_with_a_note(capfd):
    """-b 7 of float runs 4 bytes (nccl-tests rounds silently): the table says so in a note."""
    from gpucoll.bench import cli

    assert cli.main(["all_reduce", "-b", "7", "-e", "7", "-n", "1", "-w", "0"]) == 0
    out = capfd.readouterr().out
    assert "# sizes rounded down to whole elements, as nccl-tests does (bytes asked -> run): 7 -> 4 (float)" in out
    assert cli.main(["all_gather", "--nranks", "3", "-b", "100", "-e", "100", "-n", "1", "-w", "0"]) == 0
    assert "in nranks blocks of whole 16-byte units, as nccl-tests does (bytes asked -> run): 100 -> 96 (float)" \
        in capfd.readouterr().out
    assert cli.main(["all_reduce", "-b", "8", "-e", "64", "-f", "2", "-n", "1", "-w", "0"]) == 0
    assert "rounded" not in capfd.readouterr().out


def test_compress_checks_the_bound_and_compares_with_uncompressed(tmp_path):
    """--compress int8 --compare none: every checked element within the error bound (#wrong 0), a maxerr column, and
    the uncompressed time with the ratio uncompressed / compressed; the JSON rows say so. Misuse is exit status 2."""
    out = tmp_path / "c.json"
    res = bench("all_reduce", "--nranks", "2", "--backend", "host", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2",
                "--compress", "int8", "--compare", "none", "-d", "float,half", "-o", "sum,avg", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "maxerr" in res.stdout and "none" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["results"], doc
    for row in doc["results"]:
        assert row["compress"] == "int8" and row["algo_resolved"] == "compressed:int8", row
        assert row["out_of_place"]["nwrong"] == 0 and row["in_place"]["nwrong"] == 0, row
        assert row["max_error"] is not None and row["max_error"] >= 0
        assert row["peer"]["name"] == "none" and row["peer"]["ratio"] > 0
    # a corrupted element is outside the bound: counted, exit status 1
    hurt = bench("all_reduce", "--nranks", "2", "--backend", "host", "-b", "4K", "-e", "4K", "-n", "1", "--compress",
                 "int8", "--inject-error")
    assert hurt.returncode == 1 and "Out of bounds values : 0" not in hurt.stdout, hurt.stdout[-600:]
    for bad in (("broadcast", "--compress", "int8"), ("all_reduce", "--compare", "none"),
                ("all_reduce", "--compress", "int8", "-d", "int32"), ("all_reduce", "--compress", "int8", "-o", "max"),
                ("all_reduce", "--compress", "int8", "--algo", "ring")):
        r = bench(*bad, "--nranks", "2", "--backend", "host", "-b", "1K", "-e", "1K")
        assert r.returncode == 2 and "compress" in r.stderr, (bad, r.stderr[-300:])
