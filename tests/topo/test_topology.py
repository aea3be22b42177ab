"""Topology value, importers, JSON round trip and detection (csrc/topo/, gpucoll/topology.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from gpucoll import topology as T
from gpucoll.errors import InvalidArgument

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "topo"
FIXTURES = sorted(p.name for p in FIX.iterdir())


def load(name):
    return T.load(str(FIX / name))


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_imports_and_round_trips(name):
    t = load(name)
    assert t.num_gpus >= 2
    text = t.to_json()
    back = T.from_json(text)
    assert back == t
    assert back.to_json() == text  # unchanged, byte for byte
    assert json.loads(text)["format"] == "gpucoll-topology"


def classes(t, host=0):
    ids = t.host_gpus(host)
    return {(a, b): t.link_label(a, b) for a in ids for b in ids if a < b}


@pytest.mark.parametrize("name,label", [("h100_8x_nvsmi.txt", "NV18"), ("a100_8x_nvsmi.txt", "NV12"),
                                        ("a100_8x_nccl.xml", "NV12")])
def test_nvswitch_full_mesh(name, label):
    t = load(name)
    assert t.num_gpus == 8
    assert set(classes(t).values()) == {label}
    assert all(t.link_nvswitch(a, b) for a, b in classes(t))


def test_h100_nics_and_affinity():
    d = T.to_dict(load("h100_8x_nvsmi.txt"))
    assert [n["name"] for n in d["nics"]] == [f"mlx5_{i}" for i in range(8)]
    assert d["nics"][3]["gpu_paths"][3] == "PIX" and d["nics"][3]["gpu_paths"][5] == "SYS"
    assert d["gpus"][5]["numa_node"] == 1 and d["gpus"][5]["cpu_affinity"] == "56-111,168-223"
    assert d["gpus"][0]["nvlink_gen"] == 4


def test_dgx1_hybrid_cube_mesh():
    t = load("dgx1_v100_nvsmi.txt")  # CRLF, old SOC wording, mlx5_* NIC columns
    c = classes(t)
    assert c[(0, 1)] == "NV1" and c[(0, 3)] == "NV2" and c[(0, 5)] == "SYS" and c[(4, 7)] == "NV2"
    assert not t.link_nvswitch(0, 1)
    assert sum(1 for v in c.values() if v.startswith("NV")) == 16
    d = T.to_dict(t)
    assert [n["name"] for n in d["nics"]] == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]
    assert d["gpus"][0]["nvlink_gen"] == 2
    # P2P ring over NVLink exists (the cube-mesh has a Hamiltonian NVLink cycle).
    ring = T.ring(t, range(8), require_p2p=True)
    assert sorted(ring) == list(range(8))


def test_pcie_boxes():
    assert classes(load("pcie_2x_nvsmi.txt")) == {(0, 1): "PHB"}
    c4 = classes(load("pcie_4x_nvsmi.txt"))
    assert c4[(0, 1)] == "PIX" and c4[(0, 2)] == "PXB" and c4[(0, 3)] == "SYS"
    x = classes(load("pcie_4x_nccl.xml"))
    assert x[(0, 1)] == "PIX" and x[(0, 2)] == "PHB" and x[(0, 3)] == "SYS"
    d = T.to_dict(load("pcie_4x_nccl.xml"))
    assert d["nics"][0]["name"] == "eth0" and d["nics"][0]["speed_gbps"] == 100
    assert d["gpus"][0]["compute_capability"] == [8, 6] and d["gpus"][0]["pcie_gen"] == 3


def test_two_node_fixture():
    t = load("h100_2node_16x.json")
    assert t.num_hosts == 2 and t.num_gpus == 16
    assert t.link_class(0, 8) == "NET" and t.link_label(0, 1) == "NV18"
    assert T.hosts_of_ranks(t) == {"localhost-0": list(range(8)), "localhost-1": list(range(8, 16))}


def test_a100_xml_nics():
    d = T.to_dict(load("a100_8x_nccl.xml"))
    assert len(d["nics"]) == 4 and d["nics"][0]["speed_gbps"] == 200
    assert d["nics"][0]["gpu_paths"][:2] == ["PIX", "PIX"] and d["nics"][0]["gpu_paths"][2] == "PHB"
    assert d["nics"][0]["gpu_paths"][4] == "SYS"
    assert d["gpus"][0]["compute_capability"] == [8, 0] and d["gpus"][0]["numa_node"] == 1


def test_merge_groups_by_host_and_replicate():
    h = load("h100_8x_nvsmi.txt")
    two = T.replicate(h, 2)
    assert two == load("h100_2node_16x.json")
    merged = T.merge([two, h])
    assert merged.num_hosts == 3


class DictStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v

    def get(self, k, timeout=None):
        return self.d[k]


def test_merge_through_store():
    store = DictStore()
    h = load("pcie_2x_nvsmi.txt")
    # Two ranks on the same host publish the same view; the result has one host.
    store.set("gpucoll/topo/1", json.dumps(T.to_dict(h)).replace("localhost", "myhost").encode())
    store.set("gpucoll/topo/0", json.dumps(T.to_dict(h)).replace("localhost", "myhost").encode())
    got = T.merge_through_store(store, 0, 2, local=T.from_json(store.d["gpucoll/topo/0"].decode()))
    assert got.num_hosts == 1 and got.num_gpus == 2 and got.link_class(0, 1) == "PHB"


# ---- importer robustness ------------------------------------------------------------------------------------

SMI = (FIX / "pcie_4x_nvsmi.txt").read_text()


@pytest.mark.parametrize("text,match", [
    ("", "empty input"),
    ("   \n\n", "empty input"),
    ("hello world\n", "no header line"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n", r"end of input.*GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\n", r"line 3: row GPU1 has 1 link cells, expected 2"),
    ("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tPIX\t X\n", r"line 2: unknown link 'FOO' in column GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tSYS\t X\n", r"line 3: .*symmetric"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU7\tPIX\t X\n", r"line 3: row 'GPU7' is not one of"),
    ("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X\n", r"line 2: .*should be X"),
])
def test_nvsmi_malformed(text, match):
    with pytest.raises(InvalidArgument, match=match):
        T.from_nvidia_smi(text)


def test_nvsmi_truncated_fixture():
    lines = SMI.splitlines()
    with pytest.raises(InvalidArgument, match="GPU3"):
        T.from_nvidia_smi("\n".join(lines[:4]))  # header + GPU0..GPU2, GPU3's row lost


def test_nvsmi_spaces_ansi_and_minimal():
    t = T.from_nvidia_smi("\x1b[4m        GPU0    GPU1\x1b[0m\nGPU0     X      NV4\nGPU1    NV4      X\n")
    assert t.link_label(0, 1) == "NV4" and not t.link_nvswitch(0, 1)


XML = (FIX / "pcie_4x_nccl.xml").read_text()


@pytest.mark.parametrize("text,match", [
    ("", "empty input"),
    ("<foo/>", "no <system>"),
    (XML[: XML.index("</cpu>")], r"never closed"),
    ("<system>\n<cpu>\n</pci>\n</system>", r"line 3: </pci> does not close <cpu> opened on line 2"),
    ("<system>\n<gpu dev='0'/>\n</system>", r"line 2: <gpu> must sit inside its <pci>"),
    ("<system>\n<cpu numaid='x'/>\n</system>", r"line 2: .*numaid=\"x\".*integer"),
    ("<system><cpu numaid=0/></system>", r"expected a quote"),
])
def test_xml_malformed(text, match):
    with pytest.raises(InvalidArgument, match=match):
        T.from_nccl_xml(text)


@pytest.mark.parametrize("text,match", [
    ("", "empty input"),
    ("{", "line 1"),
    ('{"gpus": [{"host": 3}]}', "host"),
    ('{"gpus": [{}, {}], "links": [{"a": 0, "b": 1, "class": "WAT"}]}', "unknown link class 'WAT'"),
    ('{"format": "other", "gpus": []}', "format"),
])
def test_json_malformed(text, match):
    with pytest.raises(InvalidArgument, match=match):
        T.from_json(text)


# ---- detection ----------------------------------------------------------------------------------------------

def _run(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60, check=False)


def test_detect_here_does_not_fail():
    t = T.detect()
    assert t.num_hosts == 1
    if t.num_gpus == 0:
        assert any("NVML" in n or "CUDA" in n for n in t.notes)
    assert T.from_json(t.to_json()) == t


@pytest.mark.spawns
def test_topo_file_and_dump_file(tmp_path):
    dump = tmp_path / "dump.json"
    r = _run("from gpucoll import topology as T; t = T.detect(); print(t.num_gpus, t.source)",
             GPUCOLL_TOPO_FILE=str(FIX / "dgx1_v100_nvsmi.txt"), GPUCOLL_TOPO_DUMP_FILE=str(dump))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["8", "nvidia-smi"]
    assert T.from_json(dump.read_text()) == load("dgx1_v100_nvsmi.txt")
    r = _run("from gpucoll import topology as T; print(T.detect().num_gpus)", GPUCOLL_TOPO_DUMP_FILE=str(dump))
    assert r.returncode == 0 and T.from_json(dump.read_text()).source == "detect"


def test_nvidia_smi_p2p_table():
    """`nvidia-smi topo -p2p r` appended to the table: NVML's P2P status per pair (how GeForce boards show)."""
    text = (FIX / "autodl_2080ti_2x_nvsmi.txt").read_text()
    assert load("autodl_2080ti_2x_nvsmi.txt").link_p2p(0, 1) == "unsupported"
    ok = T.from_nvidia_smi(text.replace(" GPU0   X       NS", " GPU0   X       OK").replace(" GPU1   NS      X",
                                                                                           " GPU1   OK      X"))
    assert ok.link_p2p(0, 1) == "supported"
    one_way = T.from_nvidia_smi(text.replace(" GPU0   X       NS", " GPU0   X       OK"))
    assert one_way.link_p2p(0, 1) == "unsupported"  # a pair is supported only when both directions say OK
    with pytest.raises(InvalidArgument, match="P2P status 'MAYBE'"):
        T.from_nvidia_smi(text.replace(" GPU0   X       NS", " GPU0   X       MAYBE"))
    with pytest.raises(InvalidArgument, match="P2P table lists 3 GPUs"):
        T.from_nvidia_smi(text.replace("        GPU0    GPU1\n", "        GPU0    GPU1    GPU2\n"))


def test_gpu_model_by_name():
    # nvidia-smi text has no names: an H800's NV8 reads as NVLink 2 by link count; its name makes it Hopper.
    t = T.from_nvidia_smi((FIX / "h100_8x_nvsmi.txt").read_text().replace("NV18", "NV8"))
    assert T.to_dict(t)["gpus"][0]["nvlink_gen"] == 2
    t.set_gpu_model("H800")
    g = T.to_dict(t)["gpus"][0]
    assert (g["name"], g["compute_capability"], g["nvlink_gen"], g["pcie_gen"]) == ("H800", [9, 0], 4, 5)
    assert t.link_nvswitch(0, 1)
    t.set_gpu_model("NVIDIA GeForce RTX 4090")
    assert T.to_dict(t)["gpus"][0]["compute_capability"] == [8, 9]
    with pytest.raises(InvalidArgument, match="not one gpucoll knows"):
        t.set_gpu_model("Voodoo 5")
    # Whole words: an H20 is not an H200, an A10 not an A100.
    for name, cc in (("NVIDIA H20", [9, 0]), ("NVIDIA A10", [8, 6]), ("NVIDIA A100-SXM4-80GB", [8, 0])):
        t.set_gpu_model(name)
        assert T.to_dict(t)["gpus"][0]["compute_capability"] == cc, name


def test_cpu_vendor():
    assert load("a100_8x_nccl.xml").cpu_vendor() == "amd"  # NCCL's dump: vendor="AuthenticAMD"
    t = load("pcie_2x_nvsmi.txt")
    assert t.cpu_vendor() == ""
    t.set_cpu_vendor("intel")
    back = T.from_json(t.to_json())
    assert back == t and back.cpu_vendor() == "intel"
    d = T.to_dict(t)
    d["hosts"][0]["cpu_vendor"] = "via"
    with pytest.raises(InvalidArgument, match="cpu_vendor 'via'"):
        T.from_json(json.dumps(d))
    assert T.to_dict(T.replicate(t, 2))["hosts"][1]["cpu_vendor"] == "intel"  # merge keeps it
