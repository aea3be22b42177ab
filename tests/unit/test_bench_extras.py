"""gpucoll-bench extras: --csv, the environment in --json, --min-busbw, --plot and `report`, --compare, the
progress bar's TTY rule, and --check. Few spawns (each ~1 s), tiny sizes."""

from __future__ import annotations

import io
import json

import pytest

from gpucoll.bench import cli, plot, report
from gpucoll.bench.harness import Params

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """One 2-rank all_reduce with --compare gloo, --json, --csv and --plot."""
    d = tmp_path_factory.mktemp("bench")
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    argv = ["all_reduce", "--nranks", "2", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "--compare", "gloo",
            "--json", str(d / "a.json"), "--csv", str(d / "a.csv"), "--plot", str(d / "a.png")]
    rc = cli.main(argv)
    return rc, d


def test_json_csv_environment(run2, capsys):
    rc, d = run2
    assert rc == 0
    doc = json.loads((d / "a.json").read_text())
    assert {"gpucoll", "python", "build"} <= set(doc["environment"]["info"])
    assert len(doc["results"]) == 3
    rows = report.read_csv_rows(str(d / "a.csv"))
    assert len(rows) == 3
    assert set(rows[0]) == set(report.flat_row(doc["results"][0]))
    assert int(rows[0]["size"]) == doc["results"][0]["size"]
    head = (d / "a.csv").read_text().splitlines()
    assert any(line.startswith("# environment.info:") for line in head)


def test_compare_gloo_ratio(run2):
    _, d = run2
    doc = json.loads((d / "a.json").read_text())
    for r in doc["results"]:
        peer = r["peer"]
        assert peer["name"] == "gloo" and peer["time"] > 0
        assert peer["ratio"] == pytest.approx(peer["time"] / r["out_of_place"]["time"])


def test_peer_header_keeps_nccl_tests_columns():
    base, ext = report.header_lines(), report.header_lines_peer("gloo")
    for b, e in zip(base[2:], ext[2:]):
        assert e.startswith(b.rstrip("\n"))
    assert ext[2].split()[-2:] == ["gloo", "ratio"]


def test_compare_peers_say_what_they_mean(capsys):
    # nccl compares gpucoll's own kernels with NCCL: on a host run it says what to use instead.
    assert cli.main(["all_reduce", "-b", "1K", "-e", "1K", "--compare", "nccl"]) == cli.EXIT_USAGE
    assert "--backend custom" in capsys.readouterr().err
    # torch on a host run is torch's gloo, said in a note; on a GPU run it is torch.distributed with NCCL.
    from gpucoll.bench import peers

    peer, note = peers.resolve("torch", "host")
    assert peer == "gloo" and "gloo" in note
    assert peers.resolve("torch", "nccl") == ("torch", None)
    assert "all_to_all" in peers.unavailable("gloo", "all_to_all", "host")
    assert "--compare torch" in peers.unavailable("gloo", "all_reduce", "nccl")


def test_plot_png_and_lines(run2, tmp_path):
    _, d = run2
    assert (d / "a.png").read_bytes()[:8] == PNG
    doc = json.loads((d / "a.json").read_text())
    fig = plot.plot_docs([("", doc)])
    ax_bw, ax_t = fig.axes
    assert len(ax_bw.lines) == 2 and len(ax_t.lines) == 2  # one block + its peer
    assert [ln.get_linestyle() for ln in ax_bw.lines] == ["-", "--"]
    assert ax_bw.get_xscale() == "log" and ax_bw.get_yscale() == "log"
    out = tmp_path / "cmp.png"
    assert cli.main(["report", str(d / "a.json"), str(d / "a.json"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG


def test_min_busbw_exit_status(capsys):
    argv = ["all_reduce", "-b", "1K", "-e", "1K", "-n", "1"]
    assert cli.main(argv + ["--min-busbw", "1e9"]) == cli.EXIT_WRONG
    cap = capsys.readouterr()
    assert "below --min-busbw" in cap.err and "Avg bus bandwidth    : 0 FAILED" in cap.out
    assert cli.main(argv + ["--min-busbw", "0"]) == cli.EXIT_OK


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_tty():
    pytest.importorskip("tqdm")
    p = Params(minbytes=8, maxbytes=1 << 20, stepfactor=2)
    assert cli.want_progress(p, _Tty()) is True
    assert cli.want_progress(p, io.StringIO()) is False
    assert cli.want_progress(Params(minbytes=8, maxbytes=16, stepfactor=2), _Tty()) is False


def test_check(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["--check", "--colls", "all_reduce,sendrecv", "--json", str(tmp_path / "c.json"),
            "--plot", str(tmp_path / "c.png")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "check host   all_reduce      OK" in out and "check host   sendrecv        OK" in out
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG
    assert cli.main(["--check", "--colls", "all_reduce", "--min-busbw", "1e9"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli.main(["--check", "--colls", "all_reduce", "--inject-error"]) == 1
