"""gpucoll-bench extras: --csv, the environment in --json, --min-busbw, --plot and `report`, --compare, the
progress bar's TTY rule, and --health-check. Few spawns (each ~1 s), tiny sizes."""

from __future__ import annotations

import io
import json
import re

import helpers
import pytest

from gpucoll.bench import cli, plot, report
from gpucoll.bench.harness import Params

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """One 2-rank all_reduce with --compare gloo, --json, --csv and --plot."""
    d = tmp_path_factory.mktemp("bench")
    helpers.require("torch")
    helpers.require("matplotlib")
    argv = ["all_reduce", "--nranks", "2", "--backend", "host", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2",
            "--compare", "gloo", "--json", str(d / "a.json"), "--csv", str(d / "a.csv"), "--plot", str(d / "a.png")]
    rc = cli.main(argv)
    return rc, d


@pytest.mark.spawns
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


@pytest.mark.spawns  # run2 starts the ranks once for the module
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
    # The call check's switch exists on the host backend and the custom kernels, not on NCCL.
    assert peers.unavailable("unchecked", "all_reduce", "host") is None
    assert peers.unavailable("unchecked", "all_reduce", "custom") is None
    assert "--backend host or --backend custom" in peers.unavailable("unchecked", "all_reduce", "nccl")


@pytest.mark.spawns  # run2 starts the ranks once for the module
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


def _doc(times_us, algo="auto", picks=None, peer=False):
    rows = []
    for i, (size, t) in enumerate(times_us):
        r = {"size": size, "collective": "all_reduce", "algo": algo, "type": "float", "redop": "sum", "backend": "host",
             "out_of_place": {"time": t, "bus_bw": size / t / 1e3}}
        if picks:
            r["algo_resolved"] = picks[i]
        if peer:
            r["peer"] = {"name": "gloo", "time": 2 * t, "bus_bw": size / t / 2e3}
        rows.append(r)
    return {"program": "gpucoll-bench all_reduce", "environment": {"backend": "host", "nranks": 2}, "results": rows}


def test_plot_reads_like_the_benchmark(tmp_path):
    """Sizes in 1K/1M/1G, plain-number y ticks even over less than a decade, the legend naming what auto ran and
    sitting outside both panels (it can cover no data)."""
    helpers.require("matplotlib")
    sizes = [1 << k for k in range(10, 31, 4)]  # 1K .. 1G
    doc = _doc([(s, 50.0 + s / 4e3) for s in sizes], picks=["oneshot"] * 3 + ["twoshot"] * 3, peer=True)
    fig = plot.plot_docs([("", doc)], str(tmp_path / "p.png"))
    fig.canvas.draw()
    ax_bw, ax_t = fig.axes
    xlabels = [t.get_text() for t in ax_bw.get_xticklabels() if t.get_text()]
    assert {"1K", "1M", "1G"} <= set(xlabels) and all(re.fullmatch(r"\d+[KMG]?", x) for x in xlabels), xlabels
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["host:auto→oneshot,twoshot", "gloo"]
    box = legend.get_window_extent()
    for ax in (ax_bw, ax_t):
        assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"
        assert ax.get_legend() is None
    # a run whose times span less than a decade still gets labelled ticks, as plain numbers
    flat = _doc([(s, 100.0 + i) for i, s in enumerate(sizes)], algo="ring")
    fig = plot.plot_docs([("", flat)])
    fig.canvas.draw()
    ylabels = [t.get_text() for t in fig.axes[1].get_yticklabels() if t.get_text()]
    assert len(ylabels) >= 3 and all(re.fullmatch(r"[\d.]+", y) for y in ylabels), ylabels
    assert report.size_label(1536) == "1.5K" and report.size_label(512) == "512"


def _run_doc(coll="all_reduce", backend="host", nranks=2, algos=("auto",), picks=None, bw=(0.01, 1.0),
             argv=None, hostname="box", cpu="AMD EPYC"):
    """A gpucoll-bench document: rows 1K..1M for each algorithm, busbw log-spaced over `bw` (0 at 1 rank, as
    nccl-tests' factor (n-1)/n makes it)."""
    sizes = [1 << k for k in range(10, 21, 2)]
    rows = []
    for i, algo in enumerate(algos):
        for j, size in enumerate(sizes):
            busbw = 0.0 if nranks == 1 else bw[0] * (bw[1] / bw[0]) ** (j / (len(sizes) - 1)) * (1 + 0.02 * i)
            r = {"size": size, "collective": coll, "algo": algo, "type": "float", "redop": "sum", "backend": backend,
                 "backend_label": backend, "out_of_place": {"time": 20.0 + size / 1e3 + i, "bus_bw": busbw}}
            if picks:
                r["algo_resolved"] = picks[j] if isinstance(picks, list) else picks
            rows.append(r)
    return {"program": f"gpucoll-bench {coll}", "results": rows, "devices": [],
            "environment": {"backend": backend, "nranks": nranks, "hostname": hostname, "cpu": cpu,
                            "argv": argv or [coll]}}


def _health_check_docs():
    """A health check of three backends as gpucoll-bench --health-check writes it (NCCL on 1 rank)."""
    from gpucoll.bench import colls

    hc = ["--health-check"]
    docs = [("host", _run_doc(c, "host", 2, picks="ring", argv=hc)) for c in colls.names()]
    docs += [("nccl", _run_doc(c, "nccl", 1, picks="nccl", argv=hc)) for c in colls.names()]
    return docs + [("custom", _run_doc("all_reduce", "custom", 2, picks="custom:oneshot", argv=hc))]


def _drawn(fig, tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    fig.savefig(tmp_path / "p.png", dpi=100)  # lays the figure out as the PNG has it
    return canvas.get_renderer()


def _words(text):
    return [w for w in re.split(r"[\s:→,()]+", text) if w]


@pytest.fixture(scope="module")
def plots(tmp_path_factory):
    """Every kind of plot the tools draw: {what: figure}."""
    helpers.require("matplotlib")
    tmp_path = tmp_path_factory.mktemp("plots")
    a4, a2 = tmp_path / "runs" / "a4.json", tmp_path / "runs" / "a2.json"
    a4.parent.mkdir()
    a4.write_text(json.dumps(_run_doc(nranks=4, picks=["oneshot"] * 3 + ["twoshot"] * 3)))
    a2.write_text(json.dumps(_run_doc(nranks=2, picks=["oneshot"] * 4 + ["twoshot"] * 2)))
    algos = ("ring", "tree", "halving_doubling", "hierarchical", "dbt", "oneshot", "twoshot")
    figs = {"--health-check --plot": plot.plot_docs(_health_check_docs()),
            "--algo all": plot.plot_docs([("", _run_doc(algos=algos, bw=(0.45, 1.2)))])}
    shown = []
    real = plot.plot_docs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plot, "plot_docs", lambda *a, **k: shown.append(real(*a, **k)) or shown[-1])
        assert plot.report_main([str(a4), str(a2), "-o", str(tmp_path / "cmp.png")]) == 0
        figs["report a4.json a2.json"] = shown[0]
        long = tmp_path / ("all_reduce_on_the_new_cluster_" * 7 + ".json")  # a 200-character file name
        long.write_text(json.dumps(_run_doc()))
        assert plot.report_main([str(long), str(a2), "-o", str(tmp_path / "long.png")]) == 0
        figs["report LONG.json a2.json"] = shown[1]
    return figs


def test_every_plot_has_its_legend_inside_the_figure_and_no_repeated_words(plots, tmp_path):
    """The health check's legend ran off both edges of the figure, and its entries repeated words ("host
    all_reduce all_reduce host:auto→oneshot", "nccl:auto→nccl")."""
    for what, fig in plots.items():
        renderer = _drawn(fig, tmp_path)
        page = fig.bbox
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (what, box, page)
        for ax in fig.axes:  # the legend left the panels room
            assert ax.get_window_extent(renderer).height > 0.4 * page.height, what
    for what, fig in plots.items():
        for text in (t.get_text() for t in fig.legends[0].get_texts()):
            words = _words(text)
            assert len(words) == len(set(words)), (what, text)
    texts = [t.get_text() for t in plots["--health-check --plot"].legends[0].get_texts()]
    assert "nccl all_reduce auto (1 rank)" in texts and "custom all_reduce auto→oneshot (2 ranks)" in texts


def test_plots_of_runs_of_different_rank_counts_say_which_is_which(plots):
    fig = plots["report a4.json a2.json"]
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["a4.json host:auto→oneshot,twoshot (4 ranks)", "a2.json host:auto→oneshot,twoshot (2 ranks)"]
    assert "4 and 2 ranks" in fig._suptitle.get_text()
    # Lines of one algorithm keep their color across runs; the runs differ in line style.
    a, b = fig.axes[0].lines
    assert a.get_color() == b.get_color() and a.get_linestyle() != b.get_linestyle()
    title = plot.plot_docs(_health_check_docs())._suptitle.get_text()
    assert title.startswith("gpucoll-bench --health-check - 2 and 1 ranks"), title


def test_value_axes_have_several_meaningful_tick_labels(plots, tmp_path):
    """The --algo all plot's busbw axis (0.45 to 1.2 GB/s) was labelled "0.5" and "1" only."""
    for what, fig in plots.items():
        _drawn(fig, tmp_path)
        for ax, unit in zip(fig.axes, ("busbw (GB/s)", "time (us)")):
            assert ax.get_ylabel() == unit
            data = [v for ln in ax.lines for v in ln.get_ydata() if v > 0]  # NaN (no busbw at 1 rank) is not
            lo, hi = min(data), max(data)
            ticks = [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() if t.get_text()]
            ticks = [(v, text) for v, text in ticks if lo / 1.5 <= v <= hi * 1.5]
            assert len(ticks) >= 4, (what, unit, ticks)
            assert all(float(text) == pytest.approx(v) for v, text in ticks), (what, ticks)
            # labels at both ends of the data, not only in one part of it
            assert min(v for v, _ in ticks) <= lo * 1.5 and max(v for v, _ in ticks) >= hi / 1.5, (what, unit, ticks)
    assert plot.value_ticks(0.45, 1.2) == [0.6, 0.8, 1.0, 1.2]
    assert plot.value_ticks(0.005, 0.5) == [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]


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
    helpers.require("tqdm")
    p = Params(minbytes=8, maxbytes=1 << 20, stepfactor=2)
    assert cli.want_progress(p, _Tty()) is True
    assert cli.want_progress(p, io.StringIO()) is False
    assert cli.want_progress(Params(minbytes=8, maxbytes=16, stepfactor=2), _Tty()) is False


@pytest.mark.spawns
def test_check(tmp_path, capsys):
    helpers.require("matplotlib")
    # The host backend's rows (on a GPU machine --check alone checks the GPU backends).
    argv = ["--health-check", "--backend", "host", "--colls", "all_reduce,sendrecv", "--json", str(tmp_path / "c.json"),
            "--plot", str(tmp_path / "c.png")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "check host   all_reduce      OK" in out and "check host   sendrecv        OK" in out
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG
    assert cli.main(["--health-check", "--backend", "host", "--colls", "all_reduce", "--min-busbw", "1e9"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli.main(["--health-check", "--backend", "host", "--colls", "all_reduce", "--inject-error"]) == 1


class _Bar:
    def __init__(self, events):
        self.events = events

    def clear(self):
        self.events.append("clear")

    def refresh(self):
        self.events.append("refresh")


def test_rows_are_written_whole_around_the_progress_bar():
    """A row goes out in one piece, with the bar cleared before and redrawn after: written in pieces next to a bar
    on the same terminal, the row would land on the bar's line."""
    events, out = [], io.StringIO()
    printer = report.Printer(True, out)
    printer.bar = _Bar(events)
    printer.write(report.row_preamble(8, 2, "float", "sum", -1))
    printer.write(report.row_body(1.0, 0.0, 0.0, 0))
    assert out.getvalue() == "" and events == []
    printer.write(report.row_body(1.0, 0.0, 0.0, 0) + "\n")
    assert out.getvalue().count("\n") == 1 and events == ["clear", "refresh"]
    printer.lines(["# a\n", "# b\n"])
    assert out.getvalue().endswith("# a\n# b\n") and events == ["clear", "refresh"] * 2


def test_progress_bar_starts_only_after_a_few_seconds(monkeypatch, capsys):
    import sys
    import types

    from gpucoll.bench import harness

    made = []

    class FakeTqdm(_Bar):
        def __init__(self, total, initial, **kwargs):
            super().__init__([])
            made.append(self)
            self.total, self.n = total, initial

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    argv = ["all_reduce", "-b", "8", "-e", "64", "-f", "2", "-n", "1", "-w", "0"]
    monkeypatch.setattr(cli, "want_progress", lambda p, stream=None: True)
    assert cli.main(argv) == 0
    assert made == []  # a sweep shorter than PROGRESS_AFTER_S: no bar at all
    monkeypatch.setattr(harness, "PROGRESS_AFTER_S", 0.0)
    assert cli.main(argv) == 0
    assert len(made) == 1 and made[0].total == 4 and made[0].n == 4 and made[0].closed
    assert len(made[0].events) >= 3  # the rows after the bar started were written around it
    capsys.readouterr()


@pytest.mark.spawns
def test_check_without_a_gpu_says_what_it_checked(capsys):
    from gpucoll import _C

    if int(_C.cuda_probe().get("device_count") or 0):
        pytest.skip("checks what --check says on a machine without a GPU")
    assert cli.main(["--health-check", "--colls", "all_reduce"]) == 0
    out = capsys.readouterr().out
    assert "no GPU backend can run here" in out and "no usable CUDA GPU" in out
    assert out.rstrip().endswith("backends: host only: no GPU checked)")
    # A GPU runner whose GPU went missing must fail, not pass as a host-only check.
    assert cli.main(["--health-check", "--require-gpu", "--colls", "all_reduce"]) == cli.EXIT_USAGE
    cap = capsys.readouterr()
    assert cap.out == "" and "--require-gpu: no usable CUDA GPU" in cap.err


def test_compare_that_does_not_fit_a_later_backend_is_refused_before_any_run(monkeypatch, capsys):
    helpers.require("torch", "--compare gloo needs torch for the host block, which is checked first")
    monkeypatch.setattr(cli, "resolve_backend", lambda b, coll=None: b if b != "auto" else "host")
    argv = ["all_reduce", "-b", "8", "-e", "8", "-n", "1", "--backend", "host,nccl", "--compare", "gloo"]
    assert cli.main(argv) == cli.EXIT_USAGE
    cap = capsys.readouterr()
    assert cap.out == "" and "--compare gloo compares with gpucoll's host backend only" in cap.err
