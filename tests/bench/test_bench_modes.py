"""gpucoll-bench's GPU-side modes, checked on a CPU: the flags (-G, -z, -a, --backend lists), the clear refusals on
a machine without a GPU (exit 2), the backend sweep, the host-mirror staging that CUDA runs use, the virtual-rank
adapter of --backend custom (driven by a NumPy stand-in for gpucoll.testing.virtual_ranks), and --check's
thresholds from a tuning file. Runs are one rank in this process unless a test says otherwise; sizes are tiny."""

from __future__ import annotations

import json
from typing import ClassVar

import helpers
import numpy as np
import pytest
from test_bench_cli import HAVE_GPU, rows

from gpucoll import _C
from gpucoll.bench import check, cli, devmem, harness, plot, virtual

NO_GPU = pytest.mark.skipif(HAVE_GPU, reason="checks the messages shown on machines without a GPU")
TINY = ["-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "1"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "GPUCOLL_TUNING_FILE"):
        monkeypatch.delenv(v, raising=False)


# -- flags ---------------------------------------------------------------------------------------------------------
def test_new_flags_parse():
    p = cli.parse_args(["all_reduce", "-G", "10", "-z", "1", "-a", "3", "--backend", "host,nccl,host"])
    assert (p.graph, p.blocking, p.average, p.backends, p.backend) == (10, 1, 3, ["host", "nccl"], "host")
    q = cli.parse_args(["all_reduce", "--cudagraph", "0", "--blocking", "0"])
    assert (q.graph, q.blocking, q.average, q.backends) == (0, 0, 1, ["auto"])  # -a 1: nccl-tests' default


@NO_GPU
@pytest.mark.parametrize("argv, words", [
    (["--backend", "nccl"], ["--backend nccl", "GPU", "--backend host"]),
    (["--backend", "custom"], ["--backend custom", "GPU", "--backend host"]),
    (["--backend", "host,nccl"], ["--backend nccl", "--backend host"]),  # nothing runs: refused before the sweep
    (["-G", "5"], ["-G/--cudagraph", "auto (resolved to host)", "--backend nccl"]),
    (["--backend", "host", "-G", "5"], ["-G/--cudagraph", "CPU"]),
])
def test_gpu_requests_without_gpu_are_usage_errors(argv, words, capsys):
    assert cli.main(["all_reduce", *TINY, *argv]) == cli.EXIT_USAGE
    cap = capsys.readouterr()
    assert cap.out == ""
    for w in words:
        assert w in cap.err


def test_blocking_on_host_is_a_note(capsys):
    assert cli.main(["all_reduce", *TINY, "--backend", "host", "-z", "1"]) == 0
    out = capsys.readouterr().out
    assert "every call blocks already" in out and len(rows(out)) == 2


def test_average_modes_run(capsys):
    for a in ("0", "1", "2", "3"):
        assert cli.main(["all_reduce", *TINY, "-a", a]) == 0
    assert len(rows(capsys.readouterr().out)) == 8


# -- backend sweeps ------------------------------------------------------------------------------------------------
def test_backend_sweep_blocks_json_and_plot(tmp_path, capsys):
    helpers.require("matplotlib")
    from gpucoll.backends import resolve

    if resolve("auto") != "host":
        pytest.skip("a sweep where auto resolves to host: a machine without a usable GPU (CI's first suite)")
    out = tmp_path / "s.json"
    rc = cli.main(["all_reduce", *TINY, "--backend", "host,auto", "--algo", "ring,auto", "--json", str(out),
                   "--csv", str(tmp_path / "s.csv")])
    text = capsys.readouterr().out
    assert rc == 0
    assert "backend: host algo: ring,auto" in text and "backend: auto(host) algo: ring,auto" in text
    assert text.count("# Algorithm: ring\n") == 2 and len(rows(text)) == 8
    doc = json.loads(out.read_text())
    assert doc["environment"]["backends"] == ["host", "host"] and len(doc["environments"]) == 2
    assert len(doc["results"]) == 8 and {r["backend"] for r in doc["results"]} == {"host"}
    # The same backend twice (auto resolved to host) stays two runs: labels keep them apart everywhere.
    assert doc["environment"]["backend_labels"] == ["host", "auto(host)"]
    assert [r["backend_label"] for r in doc["results"]] == ["host"] * 4 + ["auto(host)"] * 4
    per = doc["average_bus_bandwidth"]["per_algo"]
    assert set(per) == {"host:ring", "host:auto", "auto(host):ring", "auto(host):auto"}
    assert set(doc["average_bus_bandwidth"]["per_backend"]) == {"host", "auto(host)"}
    assert doc["out_of_bounds"] == {"count": 0, "okay": True}
    lines = plot.plot_docs([("", doc)]).axes[0].lines
    picked = doc["results"][-1]["algo_resolved"]  # what auto ran at the one size (the legend names it)
    assert sorted(ln.get_label() for ln in lines) == [f"auto(host):auto→{picked}", "auto(host):ring",
                                                      f"host:auto→{picked}", "host:ring"]
    assert all(len(ln.get_xdata()) == 2 for ln in lines)  # each line one run's 2 sizes, not two runs interleaved


def test_sweep_plumbing_with_a_fake_gpu_backend(monkeypatch, capsys, tmp_path):
    """A stand-in "nccl" backend that runs on the host communicator with staged buffers (a separate device twin):
    each swept backend is its own run with its own label, rows, exit status and plot line."""
    real = cli.resolve_backend
    monkeypatch.setattr(cli, "resolve_backend", lambda b, coll=None: "host" if b == "nccl" else real(b, coll))
    seen = []
    real_for_comm = devmem.for_comm

    def for_comm(comm, staged=False):
        seen.append(staged)
        return real_for_comm(comm, staged=len(seen) > 1)  # the second run (fake nccl) stages through a twin

    monkeypatch.setattr(devmem, "for_comm", for_comm)
    out = tmp_path / "f.json"
    assert cli.main(["broadcast", *TINY, "--backend", "host,nccl", "-c", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("# Collective test concluded") == 2 and len(rows(text)) == 4
    assert all(r[8] == "0" and r[12] == "0" for r in rows(text))
    doc = json.loads(out.read_text())
    assert [d["device"].split()[0] for d in doc["devices"]] == ["cpu", "cpu"]
    assert [d["backend"] for d in doc["devices"]] == ["host", "host"]


# -- staging (the CUDA path's upload/download, on the CPU) ------------------------------------------------------------
class _NoUpload(devmem.StagedHostMem):
    def upload(self, host, dev, first, stop):
        pass


@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                  "all_to_all", "gather", "scatter"])
def test_staged_buffers_are_checked_exactly(coll, capsys):
    assert cli.main([coll, *TINY, "-d", "float,int8", "-c", "1"]) == 0  # the host path, for the row count
    want = len(rows(capsys.readouterr().out))
    p = cli.parse_args([coll, *TINY, "-d", "float,int8", "-c", "1"])
    p.backend, p.staged, p.quiet = "host", True, True
    (res,) = harness.run_local(harness.run_rank, p, 1, (p,))
    assert res["errors"] == 0 and res["wrong_local"] == 0 and len(res["rows"]) == want


def test_staging_is_what_the_check_sees(monkeypatch):
    """Without the upload the collective runs on the twin's stale zeros: the check must count wrong elements."""
    monkeypatch.setattr(devmem, "for_comm", lambda comm, staged=False: _NoUpload())
    p = cli.parse_args(["all_reduce", *TINY])
    p.backend, p.quiet = "host", True
    (res,) = harness.run_local(harness.run_rank, p, 1, (p,))
    assert res["errors"] > 0 and res["wrong_local"] > 0


# -- --backend custom: the virtual-rank adapter ------------------------------------------------------------------------
class FakeVirtualRanks:
    """gpucoll.testing.virtual_ranks' expected shape, on NumPy: one call issues the collective on all ranks."""

    instances: ClassVar[list] = []

    def __init__(self, nranks, device=0, timeout=60.0):
        self.n, self.device, self.timeout, self.calls, self.closed, self.synced = nranks, device, timeout, [], False, 0
        FakeVirtualRanks.instances.append(self)

    def synchronize(self):
        self.synced += 1

    def all_reduce(self, xs, outs=None, op="sum", algo="auto"):
        self.calls.append(("all_reduce", algo))
        if hasattr(xs[0], "copy_"):  # bfloat16 comes as torch views: reduce in float32 (exact for these inputs)
            import torch

            st = torch.stack([x.float() for x in xs])
            red = {"sum": st.sum(0), "max": st.amax(0), "min": st.amin(0), "avg": st.sum(0) / len(xs)}[op]
            for o in (outs or xs):
                o.copy_(red)
            return outs or xs
        st = np.stack([np.array(x) for x in xs])
        if op == "avg":  # as gpucoll/NCCL: floats divide the sum, integers truncate toward zero
            s = st.sum(axis=0)
            red = s / len(xs) if st.dtype.kind == "f" else np.sign(s) * (np.abs(s) // len(xs))
        else:
            red = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op].reduce(st)
        for o in (outs or xs):
            o[...] = red
        return outs or xs

    def broadcast(self, xs, root=0, algo="auto"):
        self.calls.append(("broadcast", algo))
        src = np.array(xs[root])
        for x in xs:
            x[...] = src
        return xs

    def close(self):
        self.closed = True


def test_fake_matches_the_real_virtual_ranks():
    """The adapter calls what gpucoll.testing.VirtualRanks really takes (the fake below stands in for it on CPU)."""
    import inspect

    from gpucoll import testing

    real = inspect.signature(testing.VirtualRanks.all_reduce).parameters
    fake = inspect.signature(FakeVirtualRanks.all_reduce).parameters
    assert list(fake) == [n for n in real if n in fake] and {"xs", "outs", "op", "algo"} <= set(real)
    assert virtual.runs("all_reduce") and not virtual.runs("broadcast")


@pytest.fixture
def fake_vr(monkeypatch):
    FakeVirtualRanks.instances = []
    monkeypatch.setattr(virtual, "_factory", lambda: FakeVirtualRanks)
    monkeypatch.setattr(virtual, "runs", lambda coll: hasattr(FakeVirtualRanks, coll))
    monkeypatch.setattr(devmem, "for_comm", lambda comm, staged=False: devmem.StagedHostMem())
    return FakeVirtualRanks


@pytest.mark.parametrize("coll, ops, algo", [("all_reduce", "sum,max", "ring"), ("broadcast", "sum", "auto")])
def test_virtual_ranks_adapter(fake_vr, coll, ops, algo):
    p = cli.parse_args([coll, *TINY, "-d", "float,int32", "-o", ops, "--algo", algo, "-a", "1"])
    p.backend, p.quiet = "custom", True
    res = virtual.run(harness.run_rank, 3, (p,), timeout=30)
    assert [r["rank"] for r in res] == [0, 1, 2] and all(r["errors"] == 0 for r in res)
    assert len(res[0]["rows"]) == 2 * len(ops.split(",")) * 2 and res[1]["rows"] is None
    (vr,) = fake_vr.instances
    assert vr.closed and vr.n == 3 and set(vr.calls) == {(coll, algo)}
    assert vr.timeout == 30 and vr.synced == 1  # -T reaches the kernels; a kernel's timeout flag is looked at


def test_virtual_rank_failure_is_raised_with_its_rank(fake_vr, monkeypatch):
    def broken(self, xs, outs=None, op="sum", algo="auto"):
        raise ValueError("kernel said no")

    monkeypatch.setattr(FakeVirtualRanks, "all_reduce", broken)
    p = cli.parse_args(["all_reduce", *TINY])
    p.backend, p.quiet = "custom", True
    with pytest.raises(ValueError, match="kernel said no") as info:
        virtual.run(harness.run_rank, 2, (p,), timeout=30)
    assert info.value.rank in (0, 1)


def test_custom_through_the_cli(fake_vr, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(virtual, "problem", lambda coll=None: None)
    assert cli.main(["all_reduce", *TINY, "--backend", "custom", "--nranks", "2", "--algo", "oneshot,ring"]) == 0
    text = capsys.readouterr().out
    assert "backend: custom" in text and len(rows(text)) == 4 and text.count("[custom]") == 2
    # What auto runs on virtual ranks: the kernels' own size rule, in the block's heading and in every JSON row.
    assert cli.main(["all_reduce", *TINY, "--backend", "custom", "--nranks", "2", "--json", str(tmp_path / "c.json")]) == 0
    text = capsys.readouterr().out
    picks = [r["algo_resolved"] for r in json.loads((tmp_path / "c.json").read_text())["results"]]
    kernels = [_C.custom_choose_algo(int(r[0]), 2) for r in rows(text)]
    assert picks == [f"custom:{k}" for k in kernels] and len(set(kernels)) == 1, (picks, kernels)
    assert f"# Algorithm: auto (picks {kernels[0]} at every size)\n" in text, text
    assert cli.main(["all_reduce", *TINY, "--backend", "custom", "-G", "2"]) == cli.EXIT_USAGE
    assert "virtual ranks" in capsys.readouterr().err


@NO_GPU
def test_custom_problem_names_the_gpu_first():
    assert "CUDA GPU" in virtual.problem() and "--backend host" in virtual.problem()


# -- --check thresholds --------------------------------------------------------------------------------------------
def test_threshold_lookup_most_specific_first(tmp_path):
    table = {"default": 1.0, "all_reduce": 2.0, "host": 3.0, "host:all_reduce": 4.0, "host:all_reduce@2": 5.0}
    assert check.threshold(table, "host", "all_reduce", 2) == 5.0
    assert check.threshold(table, "host", "all_reduce", 4) == 4.0
    assert check.threshold(table, "host", "gather", 4) == 3.0
    assert check.threshold(table, "nccl", "all_reduce", 4) == 2.0
    assert check.threshold(table, "nccl", "gather", 4) == 1.0
    assert check.threshold({}, "nccl", "gather", 4) is None
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"format": "gpucoll-tuning", "version": 1, "fits": {}}))
    assert check.load_thresholds(str(f)) == {}  # gpucoll-tune's files without the section: no thresholds
    f.write_text(json.dumps({"fits": {}, "min_busbw": {"host": "fast"}}))
    with pytest.raises(ValueError, match="GB/s numbers"):
        check.load_thresholds(str(f))


def test_check_thresholds_from_a_tuning_file(tmp_path, monkeypatch, capsys):
    f = tmp_path / "tuning.json"
    f.write_text(json.dumps({"fits": {}, "min_busbw": {"host:all_reduce": 1e9, "default": 0.0}}))
    argv = ["--health-check", "--backend", "host", "--colls", "all_reduce,broadcast", "--nranks", "1"]
    assert cli.main([*argv, "--tuning", str(f)]) == cli.EXIT_WRONG
    out = capsys.readouterr().out
    assert "all_reduce      FAIL" in out and "busbw < 1e+09" in out and "broadcast       OK" in out
    monkeypatch.setenv("GPUCOLL_TUNING_FILE", str(f))  # the same file through the environment
    assert cli.main(argv) == cli.EXIT_WRONG
    capsys.readouterr()
    assert cli.main([*argv, "--min-busbw", "0"]) == cli.EXIT_OK  # --min-busbw wins over the file
    f.write_text("{not json")
    assert cli.main([*argv, "--tuning", str(f)]) == cli.EXIT_USAGE
    assert "cannot be read" in capsys.readouterr().err


@NO_GPU
def test_check_backend_gpu_without_gpu_is_usage_error(capsys):
    assert cli.main(["--health-check", "--backend", "nccl"]) == cli.EXIT_USAGE
    assert "--backend host" in capsys.readouterr().err


# -- under launchers: one process per rank, rank 0 prints ------------------------------------------------------------
@pytest.mark.spawns
@pytest.mark.slow
def test_torchrun_sweep_rank0_prints(tmp_path):
    """torchrun's agent serves the store on MASTER_PORT: the bench meets through it, once for every swept backend."""
    import os
    import subprocess
    import sys

    from gpucoll._spawn import free_port

    helpers.require("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                             "SLURM_PROCID")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "gpucoll.bench", "all_reduce", *TINY, "--backend", "host,auto", "-a", "2",
           "--json", str(tmp_path / "t.json")]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("# Collective test concluded") == 2 and res.stdout.count("#  Rank  1 ") == 2
    assert len(rows(res.stdout)) == 4 and all(r[8] == "0" for r in rows(res.stdout))
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["environment"]["launch"] == "torchrun" and doc["config"]["average"] == "min"
