"""Topology-aware selection (csrc/select/cost.cc), gpucoll-topo and gpucoll-tune."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from gpucoll import topology as T
from gpucoll.errors import InvalidArgument

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "topo"
SIZES = [8 << k for k in range(0, 28, 2)]  # 8 B .. 512 MiB
P2P_KERNELS = {"oneshot", "twoshot", "ring", "tree"}


def load(name):
    return T.load(str(FIX / name))


pytestmark = pytest.mark.usefixtures("no_selection_env")


def table(t, **kw):
    return {s: T.select(t, "all_reduce", s, **kw) for s in SIZES + [1 << 30]}


@pytest.mark.parametrize("name", ["h100_8x_nvsmi.txt", "a100_8x_nvsmi.txt", "a100_8x_nccl.xml"])
def test_nvlink_full_mesh_small_custom_large_nccl(name):
    tab = table(load(name))
    for s in (8, 2 << 10, 32 << 10):
        assert (tab[s]["backend"], tab[s]["algorithm"]) == ("custom", "oneshot"), (s, tab[s])
    assert (tab[512 << 10]["backend"], tab[512 << 10]["algorithm"]) == ("custom", "twoshot")
    assert tab[1 << 30]["backend"] == "nccl"
    # Monotone: once NCCL wins, it keeps winning.
    backends = [tab[s]["backend"] for s in sorted(tab)]
    assert backends == sorted(backends, key=lambda b: b == "nccl")


def test_h100_ring_busbw_matches_published_figure():
    c = T.select(load("h100_8x_nvsmi.txt"), "all_reduce", 8 << 30, algo="nccl:ring")
    assert c["protocol"] == "Simple"
    assert abs(c["busbw"] / 1e9 - 370) / 370 < 0.15, c
    nvls = T.select(load("h100_8x_nvsmi.txt"), "all_reduce", 8 << 30)
    assert nvls["algorithm"] == "nvls" and abs(nvls["busbw"] / 1e9 - 484) / 484 < 0.15


@pytest.mark.parametrize("name", ["pcie_2x_nvsmi.txt", "pcie_4x_nvsmi.txt", "pcie_4x_nccl.xml", "dgx1_v100_nvsmi.txt"])
def test_no_p2p_kernels_without_p2p_everywhere(name):
    t = load(name)
    for s, c in table(t).items():
        assert not (c["backend"] == "custom" and c["algorithm"] != "ring"), (s, c)
        if c["backend"] == "custom":  # a ring is allowed only over working P2P hops
            assert T.ring(t, range(t.num_gpus), require_p2p=True)
    if name != "dgx1_v100_nvsmi.txt":
        assert all(c["backend"] != "custom" for c in table(t).values())


def test_p2p_reported_but_failing():
    t = load("h100_8x_nvsmi.txt")
    t.set_p2p(2, 5, "failed")
    ring = T.ring(t, range(8), require_p2p=True)
    hops = {frozenset((ring[i], ring[(i + 1) % 8])) for i in range(8)}
    assert frozenset((2, 5)) not in hops
    for s, c in table(t).items():
        # Kernels that touch every pair are out; a ring may run, around the failed pair.
        assert c["backend"] != "custom" or c["algorithm"] == "ring", (s, c)
    with pytest.raises(InvalidArgument, match=r"oneshot.*GPU 2 and GPU 5: P2P is reported but failed"):
        T.select(t, "all_reduce", 1024, algo="oneshot")


def test_subset_of_gpus_on_pcie_box_can_use_p2p():
    # Ranks only on GPU0/GPU1 (PIX): P2P kernels become possible.
    c = T.select(load("pcie_4x_nvsmi.txt"), "all_reduce", 8, nranks_per_node=2)
    assert c["backend"] == "custom"


def test_across_nodes_hierarchical():
    t = load("h100_2node_16x.json")
    picked = set()
    for s, c in table(t).items():
        # Across nodes: our two-level algorithm or what NCCL's tuner picks, whichever the model prices faster.
        cands = [x for x in T.candidates(t, "all_reduce", s) if x["usable"]]
        contenders = [x for x in cands if x["algorithm"] == "hierarchical" or x["nccl_auto"]]
        assert {x["backend"] for x in cands} <= {"custom+nccl", "nccl"}, s
        assert c["seconds"] == min(x["seconds"] for x in contenders), (s, c)
        picked.add(c["algorithm"])
    assert "hierarchical" in picked and picked - {"hierarchical"}, picked
    rep = T.replicate(load("pcie_4x_nvsmi.txt"), 2)
    assert T.select(rep, "all_reduce", 1 << 20, nranks_per_node=2)["algorithm"] == "hierarchical"
    # Without P2P inside the nodes our kernels cannot take the intra-node phases: NCCL runs the whole call.
    h = next(x for x in T.candidates(T.replicate(load("pcie_2x_nvsmi.txt"), 2), "all_reduce", 1 << 20)
         if x["algorithm"] == "hierarchical")
    assert not h["usable"] and "NCCL's own algorithms are two-level" in h["reason"]
    with pytest.raises(InvalidArgument, match="inside one node"):
        T.select(t, "all_reduce", 1 << 20, algo="twoshot")


def test_explicit_algo_and_env_win(monkeypatch):
    t = load("h100_8x_nvsmi.txt")
    assert T.select(t, "all_reduce", 8, algo="nccl")["backend"] == "nccl"
    assert T.select(t, "all_reduce", 1 << 30, algo="custom:ring")["algorithm"] == "ring"
    assert T.select(t, "all_reduce", 1 << 30, algo="host")["backend"] == "host"
    monkeypatch.setenv("GPUCOLL_ALGO", "allreduce:nccl:ring")
    c = T.select(t, "all_reduce", 8)
    assert (c["backend"], c["algorithm"]) == ("nccl", "ring")
    assert T.select(t, "all_reduce", 8, algo="oneshot")["algorithm"] == "oneshot"  # algo= beats the variable
    with pytest.raises(InvalidArgument, match="names no backend or algorithm"):
        T.select(t, "all_reduce", 8, algo="warp_drive")
    with pytest.raises(InvalidArgument, match="NVLS needs NVSwitch"):
        T.select(load("pcie_2x_nvsmi.txt"), "all_reduce", 8, algo="nccl:nvls")


def test_backends_unavailable_and_dtype():
    t = load("h100_8x_nvsmi.txt")
    assert T.select(t, "all_reduce", 8, custom=False)["backend"] == "nccl"
    assert T.select(t, "all_reduce", 8, custom=False, nccl=False)["backend"] == "host"
    with pytest.raises(InvalidArgument, match="whole number"):
        T.select(t, "all_reduce", 6, dtype="float32")
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        T.select(t, "all_reduce", 8, dtype="complex256")
    assert T.select(t, "all_gather", 1 << 20)["usable"]


@pytest.mark.spawns
def test_tuning_file_overrides(tmp_path):
    t = load("h100_8x_nvsmi.txt")
    tuning = json.dumps({"fits": {"nccl:ring@NVL": {"a_s": 1e-9, "b_s_per_byte": 1e-13, "source": "test"}}})
    c = T.select(t, "all_reduce", 1 << 20, tuning=tuning)
    assert (c["backend"], c["algorithm"]) == ("nccl", "ring") and "tuned" in c["model"]
    path = tmp_path / "t.json"
    path.write_text(tuning)
    code = ("from gpucoll import topology as T; "
            f"print(T.select(T.load({str(FIX / 'h100_8x_nvsmi.txt')!r}), 'all_reduce', 1<<20)['model'])")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GPUCOLL_TUNING_FILE": str(path)},
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "tuned nccl:ring@NVL" in r.stdout, r.stderr


def test_one_gpu_node_prices_every_candidate():
    # A one-GPU machine (ranks sharing it): the custom kernels' pair bandwidth used to read the node's second GPU,
    # which does not exist (an out-of-bounds read that made every selection raise "GPU index out of range").
    one = T.from_nvidia_smi("        GPU0    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
                                   "GPU0     X      0-31            0               N/A\n")
    assert one.num_gpus == 1
    for size in (1 << 10, 1 << 20, 1 << 30):
        cands = T.candidates(one, "all_reduce", size, "float32")
        assert any(c["backend"] == "custom" and c["algorithm"] == "oneshot" and c["usable"] for c in cands)
        assert T.select(one, "all_reduce", size, "float32")["usable"]


def test_topo_cli(capsys):
    from gpucoll.cli import topo as topo_cli

    assert topo_cli.main(["--from-nvidia-smi", str(FIX / "h100_8x_nvsmi.txt")]) == 0
    out = capsys.readouterr().out
    assert "NV18/450" in out and "oneshot" in out and "1 GiB" in out and "ring" in out
    assert topo_cli.main(["--from-nccl-xml", str(FIX / "a100_8x_nccl.xml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0]["size"] == 8 and doc["rows"][-1]["size"] == 1 << 30
    assert topo_cli.main(["--from-json", str(FIX / "h100_8x_nvsmi.txt")]) == 2  # wrong format: clear error
    assert "topology JSON" in capsys.readouterr().err
    assert topo_cli.main(["--from-nvidia-smi", str(FIX / "pcie_4x_nvsmi.txt"), "--nodes", "2",
                          "--nranks-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "NCCL model here: extrapolated: multi-node" in out and "unknown speed" in out
    assert topo_cli.main([]) == 0  # detection here


@pytest.mark.spawns
def test_bare_topo_without_gpus_names_examples_that_ship(monkeypatch, capsys, tmp_path):
    """Bare gpucoll-topo on a machine without GPUs said only "no GPUs": it names examples to try, one command each,
    and those files are in the package (a wheel holds them: setup.py's package_data)."""
    import shutil

    from gpucoll.cli import topo as topo_cli

    doc = json.loads((FIX / "h100_2node_16x.json").read_text())
    doc = {k: ([] if k in ("gpus", "nics", "links") else v) for k, v in doc.items()}  # no GPU: what detect finds
    monkeypatch.setattr(T, "detect", lambda: T.from_json(json.dumps(doc)))
    assert topo_cli.main([]) == 0
    out = capsys.readouterr().out
    tries = re.findall(r"^#   gpucoll-topo (--from-[\w-]+) (\S+)", out, re.MULTILINE)
    assert "--from-nvidia-smi" in {flag for flag, _ in tries} and "--from-nvidia-smi FILE" in out, out
    package = pathlib.Path(topo_cli.__file__).resolve().parent.parent  # gpucoll/, which ships topo_examples/
    for flag, path in tries:
        path = pathlib.Path(path)
        assert path.parent == package / "topo_examples", path
        assert path.read_bytes() == (FIX / path.name).read_bytes()  # the tests' copy: one machine, one file
        assert topo_cli.main([flag, str(path)]) == 0, path
        assert "# topology: " in capsys.readouterr().out
    # What a wheel would hold: setup.py's build_py on a copy of the sources (no compiler, no extension).
    root = package.parent
    src = tmp_path / "src"
    shutil.copytree(package, src / "gpucoll", ignore=shutil.ignore_patterns("*.so", "_emu", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", "out"], cwd=src, check=True,
                   capture_output=True, timeout=120)
    assert {pathlib.Path(p).name for _, p in tries} <= {p.name for p in (src / "out/gpucoll/topo_examples").iterdir()}


def test_tune_fits_host_bench_json(tmp_path):
    from gpucoll import _C
    from gpucoll.cli import tune

    # Synthetic gpucoll-bench document generated from known a and b: the fit must recover them.
    a, b = 10e-6, 0.2e-9
    rows = []
    for size in [4096 << k for k in range(10)]:
        steps, per_byte = _C.topo_model_terms("custom", "ring", "all_reduce", 4, 0)
        rows.append({"size": size, "count": size // 4, "type": "float32", "redop": "sum", "root": 0,
                     "collective": "all_reduce", "algo": "ring", "actual_iterations": 5,
                     "out_of_place": {"time": (steps * a + size * per_byte * b) * 1e6, "alg_bw": 0, "bus_bw": 0,
                                      "nwrong": 0.0}})
    doc = {"config": {"collective": "all_reduce"}, "environment": {"backend": "host", "nranks": 4}, "results": rows}
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "tuning.json"
    assert tune.main([str(src), "-o", str(out)]) == 0
    fit = json.loads(out.read_text())["fits"]["host:ring@SHM"]
    assert fit["a_s"] == pytest.approx(a, rel=1e-3) and fit["b_s_per_byte"] == pytest.approx(b, rel=1e-3)
    assert fit["r2"] > 0.999
    assert _C.topo_check_tuning(out.read_text()) == 1


def _bench_doc(backend, algo, coll, nranks, a, b, model_backend=None):
    """A gpucoll-bench --json document whose times follow steps * a + bytes * b exactly."""
    from gpucoll import _C

    steps, per_byte = _C.topo_model_terms(model_backend or backend, algo if algo != "auto" else "ring", coll, nranks, 0)
    rows = [{"size": size, "count": size // 4, "type": "float32", "redop": "sum", "root": 0, "collective": coll,
             "algo": algo, "actual_iterations": 5,
             "out_of_place": {"time": (steps * a + size * per_byte * b) * 1e6, "alg_bw": 0, "bus_bw": 0, "nwrong": 0.0}}
            for size in [4096 << k for k in range(10)]]
    return {"config": {"collective": coll}, "environment": {"backend": backend, "nranks": nranks}, "results": rows}


def test_tune_nccl_auto_rows_and_fit_table(tmp_path, capsys):
    from gpucoll.cli import tune

    # NCCL runs are benchmarked as algo=auto: they are fitted as the ring the model prices NCCL with.
    src = tmp_path / "nccl.json"
    src.write_text(json.dumps(_bench_doc("nccl", "auto", "all_reduce", 8, 5e-6, 1 / 300e9)))
    bad = tmp_path / "one.json"
    doc = _bench_doc("nccl", "auto", "broadcast", 8, 5e-6, 1 / 300e9)
    doc["results"] = doc["results"][:1]
    bad.write_text(json.dumps(doc))
    out = tmp_path / "tuning.json"
    assert tune.main([str(src), str(bad), "-o", str(out), "--link-class", "NVL"]) == 0
    captured = capsys.readouterr()
    assert "R^2" in captured.out and "nccl:ring@NVL" in captured.out and "max err" in captured.out
    assert "skipped nccl:ring broadcast 8 ranks: fewer than two sizes" in captured.err
    fit = json.loads(out.read_text())["fits"]["nccl:ring@NVL"]
    assert fit["b_s_per_byte"] == pytest.approx(1 / 300e9, rel=1e-3) and fit["r2"] > 0.999
    c = T.select(load("h100_8x_nvsmi.txt"), "all_reduce", 1 << 30, algo="nccl:ring", tuning=out.read_text())
    assert c["model"].startswith("tuned nccl:ring@NVL")


def test_tune_reads_each_rows_backend_in_a_merged_sweep(tmp_path):
    """A --backend host,nccl document joins the names in environment.backend; each row names its own."""
    from gpucoll.cli import tune

    host = _bench_doc("host", "ring", "all_reduce", 4, 10e-6, 1 / 5e9, model_backend="custom")
    nccl = _bench_doc("nccl", "auto", "all_reduce", 4, 5e-6, 1 / 300e9)
    merged = {"config": host["config"], "environment": {"backend": "host,nccl", "nranks": 4},
              "results": [dict(r, backend="host") for r in host["results"]]
              + [dict(r, backend="nccl") for r in nccl["results"]]}
    fits = tune.fit([merged], link_class="NVL")["fits"]
    assert fits["host:ring@NVL"]["b_s_per_byte"] == pytest.approx(1 / 5e9, rel=1e-3)
    assert fits["nccl:ring@NVL"]["b_s_per_byte"] == pytest.approx(1 / 300e9, rel=1e-3)


def test_host_candidate_honours_host_fits():
    t = load("pcie_2x_nvsmi.txt")
    tuning = json.dumps({"fits": {"host:ring@SHM": {"a_s": 1e-9, "b_s_per_byte": 1e-15, "source": "test"}}})
    c = T.select(t, "all_reduce", 1 << 20, algo="host", tuning=tuning)
    assert c["algorithm"] == "ring" and c["model"].startswith("tuned host:ring@SHM (test)")
    assert T.select(t, "all_reduce", 1 << 20, algo="host:tree")["algorithm"] == "tree"
    with pytest.raises(InvalidArgument, match="host backend has no schedule named warp"):
        T.select(t, "all_reduce", 1 << 20, algo="host:warp")


@pytest.mark.spawns
def test_tune_fits_a_default_benchmark_run_by_what_auto_ran(tmp_path, capsys):
    """gpucoll-bench's default run (--algo auto) records per row what auto resolved to ("algo_resolved"); tune
    fits each algorithm over the sizes auto ran it at (it used to refuse: "no series with two sizes")."""
    import subprocess
    import sys

    from gpucoll import _C
    from gpucoll.cli import tune

    src = tmp_path / "default.json"
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", "all_reduce",
           "--nranks", "2", "--backend", "host", "-b", "1K", "-e", "16M", "-f", "8", "-n", "2", "-w", "1", "--json",
           str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    doc = json.loads(src.read_text())
    assert {r["algo"] for r in doc["results"]} == {"auto"}
    for r in doc["results"]:
        assert r["algo_resolved"] == _C.select_algorithm(0, 2, r["size"], 0, "auto"), r
    out = tmp_path / "tuning.json"
    # --keep-poor-fits: which series get a fit is the point here; how well this busy machine's timings fit is not.
    assert tune.main([str(src), "-o", str(out), "--keep-poor-fits"]) == 0
    fits = json.loads(out.read_text())["fits"]
    series = {}
    for r in doc["results"]:
        series.setdefault(r["algo_resolved"], set()).add(r["size"])
    assert set(fits) == {f"host:{a}@SHM" for a, sizes in series.items() if len(sizes) >= 2} != set()
    capsys.readouterr()


def test_tune_rejects_fits_that_would_mislead_auto(tmp_path, capsys):
    """A series the line steps * a + bytes * b does not describe (R^2 0.39, a worst error of 88% were accepted
    silently) is reported and kept out of "fits", which the selector reads; a clean one is written."""
    from gpucoll.cli import tune

    good = _bench_doc("host", "ring", "all_reduce", 4, 10e-6, 1 / 5e9, model_backend="custom")
    bad = _bench_doc("host", "tree", "all_reduce", 4, 10e-6, 1 / 5e9, model_backend="custom")
    for r, noise in zip(bad["results"], [1.0, 1.9, 0.5, 1.8, 0.45, 1.7, 0.5, 1.9, 0.6, 1.0]):
        r["out_of_place"]["time"] *= noise
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    out = tmp_path / "tuning.json"
    assert tune.main([str(tmp_path / "good.json"), str(tmp_path / "bad.json"), "-o", str(out)]) == 0
    cap = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert set(doc["fits"]) == {"host:ring@SHM"} and set(doc["rejected"]) == {"host:tree@SHM"}
    bad_fit = doc["rejected"]["host:tree@SHM"]
    assert bad_fit["max_rel_error"] > tune.MAX_REL_ERROR and "max err" in bad_fit["problem"]
    assert re.search(r"host:tree@SHM .* REJECTED$", cap.out, re.MULTILINE)
    assert re.search(r"host:ring@SHM .* good$", cap.out, re.MULTILINE)
    assert "warning: host:tree@SHM fits badly (" in cap.err and "auto keeps its default model for it" in cap.err
    # The selector never sees the rejected fit.
    c = T.select(load("pcie_2x_nvsmi.txt"), "all_reduce", 1 << 20, algo="host:tree", tuning=out.read_text())
    assert not c["model"].startswith("tuned")
    # --keep-poor-fits writes it anyway, marked; a file of rejected fits only is exit status 1.
    assert tune.main([str(tmp_path / "bad.json"), "-o", str(out), "--keep-poor-fits"]) == 0
    assert json.loads(out.read_text())["fits"]["host:tree@SHM"]["poor"] is True
    assert "written to \"fits\" anyway" in capsys.readouterr().err
    assert tune.main([str(tmp_path / "bad.json"), "-o", str(out)]) == 1
    assert "every fit was rejected" in capsys.readouterr().err


def test_tune_says_to_rerun_when_auto_rows_do_not_say_what_ran(tmp_path, capsys):
    from gpucoll.cli import tune

    src = tmp_path / "old.json"
    src.write_text(json.dumps(_bench_doc("host", "auto", "all_reduce", 4, 10e-6, 1 / 5e9, model_backend="custom")))
    assert tune.main([str(src), "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "skipped host:auto all_reduce 4 ranks: the rows do not say which algorithm auto ran" in err
    assert "rerun gpucoll-bench with --algo all" in err


def test_tune_counts_sizes_not_points(tmp_path, capsys):
    """In-place and out-of-place rows of one size are two points but not a line: such a series is skipped."""
    from gpucoll.cli import tune

    doc = _bench_doc("host", "ring", "all_reduce", 4, 10e-6, 1 / 5e9, model_backend="custom")
    doc["results"] = [dict(r, in_place=r["out_of_place"]) for r in doc["results"][:1]]
    assert tune.fit([doc])["skipped"] == ["host:ring all_reduce 4 ranks: fewer than two sizes"]


def test_topo_cli_labels_per_node_rings_and_unknown_nic_speeds(tmp_path, capsys):
    from gpucoll.cli import topo as topo_cli

    assert topo_cli.main(["--from-nvidia-smi", str(FIX / "h100_8x_nvsmi.txt"), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "# ring per node, node 0 shown (NCCL-style, any path): 0 -> 1" in out
    assert "# ring per node, node 0 shown over P2P only (our kernels):" in out
    assert "# NIC mlx5_0 host 1 speed unknown, paths to GPUs:" in out and " 0 Gb/s" not in out
    assert topo_cli.main(["--from-nvidia-smi", str(FIX / "h100_8x_nvsmi.txt")]) == 0
    assert "# ring (NCCL-style, any path): 0 -> 1" in capsys.readouterr().out  # one node: no "per node"
    doc = json.loads((FIX / "h100_2node_16x.json").read_text())
    for nic in doc["nics"]:
        nic["speed_gbps"] = 400
    (tmp_path / "t.json").write_text(json.dumps(doc))
    assert topo_cli.main(["--from-json", str(tmp_path / "t.json")]) == 0
    assert "# NIC mlx5_0 host 0 400 Gb/s, paths to GPUs:" in capsys.readouterr().out


def test_tune_splits_a_series_with_two_regimes_into_pieces(tmp_path):
    """A series that one line misses by more than tune.SPLIT_ABOVE (a protocol switch: another latency and
    bandwidth from 256 KiB up) is fitted as size ranges, each with its own line ("pieces"), which the selector and
    explain read by the call's size; a clean line stays one piece."""
    from gpucoll.cli import explain, tune

    doc = _bench_doc("nccl", "auto", "all_reduce", 8, 5e-6, 1 / 300e9)
    steps, per_byte = _C_terms("nccl", "ring", 8)
    for r in doc["results"]:
        if r["size"] >= 256 << 10:
            r["out_of_place"]["time"] = (steps * 40e-6 + r["size"] * per_byte / 100e9) * 1e6
    fit = tune.fit([doc], link_class="NVL")["fits"]["nccl:ring@NVL"]
    assert fit["max_rel_error"] < 1e-6 < tune.SPLIT_ABOVE < fit["one_line_max_rel_error"]
    (piece,) = fit["pieces"]
    assert piece["from_bytes"] == 256 << 10 and piece["a_s"] == pytest.approx(40e-6, rel=1e-6)
    assert fit["a_s"] == pytest.approx(5e-6, rel=1e-6)
    tuning = json.dumps({"fits": {"nccl:ring@NVL": fit}})
    for size in (128 << 10, 256 << 10, 64 << 20):
        c = T.select(load("h100_8x_nvsmi.txt"), "all_reduce", size, algo="nccl:ring", tuning=tuning)
        a, b = explain.fit_at(fit, size)
        assert c["seconds"] == pytest.approx(steps * a + size * per_byte * b, rel=1e-9)
    assert "pieces" not in tune.fit([_bench_doc("nccl", "auto", "all_reduce", 8, 5e-6, 1 / 300e9)], "NVL")["fits"][
        "nccl:ring@NVL"]
    backwards = {"fits": {"nccl:ring@NVL": dict(fit, pieces=[piece, dict(piece, from_bytes=1)])}}
    with pytest.raises(InvalidArgument, match="ascending from_bytes"):
        T.select(load("h100_8x_nvsmi.txt"), "all_reduce", 8, tuning=json.dumps(backwards))


def _C_terms(backend, algo, nranks):
    from gpucoll import _C

    return _C.topo_model_terms(backend, algo, "all_reduce", nranks, 0)


def test_calibrate_refuses_what_it_cannot_measure(tmp_path, capsys):
    """gpucoll-tune --calibrate (tests/topo/test_calibrate.py runs it on a device): a budget too short for a sweep,
    a topology of several hosts (its ranks run on this machine) and the host backend are refused in one line."""
    from gpucoll.cli import tune

    out = str(tmp_path / "t.json")
    assert tune.main(["--calibrate", "--seconds", "2", "-o", out]) == 2
    assert "leaves no time for a sweep" in capsys.readouterr().err
    assert tune.main(["--calibrate", "--topology", str(FIX / "h100_2node_16x.json"), "-o", out]) == 2
    assert "the topology has 2 hosts" in capsys.readouterr().err
    assert tune.main(["--calibrate", "--backend", "host", "--topology", str(FIX / "pcie_2x_nvsmi.txt"), "-o", out]) == 2
    assert "the host backend is fitted from gpucoll-bench" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--calibrate", str(tmp_path / "x.json"), "-o", out])
    assert "give no results files" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_a_tuned_nccl_fit_prices_the_algorithm_nccls_tuner_picks():
    """gpucoll-bench runs NCCL as auto, so gpucoll-tune's "nccl:ring@NVL" is NCCL's own choice, measured: it prices
    the candidate NCCL's tuner picks too where that is NVLS (8x H100 from 16 MiB), the one auto compares; keyed by
    the ring alone it left those sizes at the default model after a calibration."""
    from gpucoll import _C

    t = load("h100_8x_nvsmi.txt")
    tuning = json.dumps({"fits": {"nccl:ring@NVL": {"a_s": 1e-5, "b_s_per_byte": 1e-11, "source": "test"}}})
    steps, per_byte = _C.topo_model_terms("nccl", "ring", "all_reduce", 8, 0)
    for size in (1 << 20, 256 << 20):
        c = T.select(t, "all_reduce", size, algo="nccl", tuning=tuning)
        assert c["model"].startswith("tuned nccl:ring@NVL"), c
        assert c["seconds"] == pytest.approx(steps * 1e-5 + per_byte * size * 1e-11, rel=1e-9)
    assert T.select(t, "all_reduce", 256 << 20, algo="nccl", tuning=tuning)["algorithm"] == "nvls"
    # Candidates NCCL does not pick keep their own model (a fit of NCCL's pick says nothing of a tree it skips).
    tree = [c for c in T.candidates(t, "all_reduce", 256 << 20, tuning=tuning)
            if c["backend"] == "nccl" and c["algorithm"] == "tree" and c["usable"]]
    assert tree and all(not c["model"].startswith("tuned") for c in tree)


def test_calibrate_prices_ranks_sharing_one_gpu():
    """gpucoll-tune --calibrate places rank r on GPU r mod the GPUs (two ranks on a one-GPU machine, as the GPU
    runner and the emulated device have): the fits' link classes come from that layout, and a time the model has
    none for (NCCL's ranks sharing a GPU) is None in the file, not an infinity json would write as "Infinity"."""
    from gpucoll.cli import calibrate

    one = T.from_nvidia_smi("        GPU0    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
                            "GPU0     X      0-31            0               N/A\n")
    assert calibrate._link_class(one, "all_reduce", 2, "custom", "ring", 1 << 20)
    assert calibrate._link_class(one, "all_reduce", 2, "nccl", "", 1 << 20)
    seconds, _ = calibrate.predict(one, "all_reduce", 2, "custom", "oneshot", 1 << 20, "")
    assert seconds is not None and 0 < seconds < 1
    nccl, _ = calibrate.predict(one, "all_reduce", 2, "nccl", "", 1 << 20, "")
    assert nccl is None or 0 < nccl < 1
