"""``gpucoll-topo``: see the wiring and what gpucoll would do on it.

Prints the GPU matrix like ``nvidia-smi topo -m`` with our link classes and each pair's bandwidth, the NICs,
the rings and trees gpucoll would build, and for a collective (all_reduce by default) a table from 8 B to
1 GiB: chosen backend/algorithm, predicted time and bus bandwidth. ``--from-nvidia-smi``/``--from-nccl-xml``/
``--from-json`` explain a machine you are not on; ``--nodes``/``--nranks-per-node`` a multi-node job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpucoll import topology
from gpucoll._help import HelpFormatter, reader_may_leave
from gpucoll.backends import select
from gpucoll.errors import GpucollError

# Machines to try gpucoll-topo on without being on them, shipped in the package (setup.py's package_data): a user
# on a laptop or a CPU-only node sees nothing from detection, and the flags alone do not say what to feed them.
# (flag, file, what it is); the files are copies of tests/fixtures/topo's.
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "topo_examples"
EXAMPLES = (
    ("--from-nvidia-smi", "h100_8x_nvsmi.txt", "8 H100 on NVSwitch with 8 NICs"),
    ("--from-nvidia-smi", "dgx1_v100_nvsmi.txt", "DGX-1: 8 V100 in a hybrid cube-mesh of NVLinks"),
    ("--from-nvidia-smi", "pcie_4x_nvsmi.txt", "4 GPUs on PCIe switches, no NVLink"),
    ("--from-nccl-xml", "a100_8x_nccl.xml", "8 A100, as NCCL_TOPO_DUMP_FILE writes it"),
    ("--from-json", "h100_2node_16x.json", "2 nodes of 8 H100, gpucoll's topology JSON"),
)


def no_gpu_hint() -> list[str]:
    """What to try on a machine where detection finds no GPU: the shipped examples, one command each."""
    lines = ["# no GPU detected here: see what gpucoll would do on another machine, e.g. one of the examples "
             + "shipped with gpucoll:"]
    cmds = [f"gpucoll-topo {flag} {EXAMPLES_DIR / name}" for flag, name, _ in EXAMPLES]
    width = max(map(len, cmds))
    lines += [f"#   {cmd.ljust(width)}  {what}" for cmd, (_, _, what) in zip(cmds, EXAMPLES)]
    lines.append("# or your own: run nvidia-smi topo -m on the GPU machine and give its output to "
                 "gpucoll-topo --from-nvidia-smi FILE ('-': stdin)")
    return lines


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}" if n % div == 0 else f"{n / div:.1f} {unit}"
    return f"{n} B"


def sizes(lo: int = 8, hi: int = 1 << 30) -> list:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    if out[-1] != hi:
        out.append(hi)
    return out


def report(topo, coll: str = "all_reduce", dtype: str = "float32", nranks_per_node: int = 0, nodes: int = 0,
           tuning: str = "", nccl_version=0) -> dict:
    """Everything gpucoll-topo prints, as a dict (the --json output)."""
    if nodes > 1 and topo.num_hosts == 1:
        topo = topology.replicate(topo, nodes)
    n = topo.num_gpus
    matrix = [[topo.link_label(a, b) for b in range(n)] for a in range(n)]
    bw = [[(0.0 if a == b or topo.link_class(a, b) == "NET" else topo.pair_bandwidth(a, b) / 1e9) for b in range(n)]
          for a in range(n)]
    doc = {"topology": topology.to_dict(topo), "matrix": matrix, "bandwidth_GBps": bw, "rows": []}
    if n == 0:
        return doc
    n_nodes, local, gpus = topology._C.topo_layout(topo, nranks_per_node, nodes)
    doc["layout"] = {"nodes": n_nodes, "ranks_per_node": local, "gpus": gpus}
    node0 = gpus[:local]
    doc["ring"] = topology.ring(topo, node0)
    doc["p2p_ring"] = topology.ring(topo, node0, require_p2p=True)
    doc["trees"] = topology.trees(topo, nranks_per_node, nodes)
    # The custom backend as this build has it (issue 5: all_reduce kernels), so the table shows what would run.
    custom = select.custom_algorithms()
    doc["custom_algorithms"] = list(custom)
    esize = {"float64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}.get(dtype, 4)
    for s in sizes():
        if s % esize:
            continue
        choice = topology.select(topo, coll, s, dtype, nranks_per_node, nodes, tuning=tuning,
                                 custom_algorithms=custom, nccl_version=nccl_version)
        doc["rows"].append({**choice, "size": s})
    # How sure the NCCL model is on this layout (nccl_model.cc: the published classes it was calibrated on).
    doc["nccl_confidence"] = topology._C.topo_nccl_confidence(topo, nranks_per_node, nodes)
    # How wide the NCCL model's interval is here and why (nccl_interval.cc), for NCCL's own pick at 1 GiB; rows
    # of a smaller size may be wider (no published point below 1 MiB).
    pick = [c for c in topology.candidates(topo, coll, 1 << 30, dtype, nranks_per_node, nodes, custom=False,
                                           host=False, tuning=tuning, nccl_version=nccl_version)
            if c["nccl_auto"] and c.get("interval")]
    doc["nccl_interval"] = pick[0]["interval"] if pick else ""
    return doc


def print_report(doc: dict, out=None) -> None:
    out = sys.stdout if out is None else out  # looked up per call: a default bound at import goes stale
    t = doc["topology"]
    gpus = t["gpus"]
    n = len(gpus)
    print(f"# topology: {n} GPUs on {len(t['hosts'])} host(s) (source: {t['source']})", file=out)
    for note in t.get("notes", []):
        print(f"# note: {note}", file=out)
    if n == 0:
        print("# no GPUs: nothing to connect", file=out)
        return
    width = 10
    print("".join(["        "] + [f"GPU{i}".ljust(width) for i in range(n)]) + "NUMA  host", file=out)
    for a in range(n):
        cells = []
        for b in range(n):
            lab = doc["matrix"][a][b]
            bw = doc["bandwidth_GBps"][a][b]
            cells.append((f"{lab}/{bw:.0f}" if bw and lab != "X" else lab).ljust(width))
        print(f"GPU{a:<5}" + "".join(cells) + f"{gpus[a]['numa_node']:<6}{t['hosts'][gpus[a]['host']]['name']}",
              file=out)
    print("# cells: link class (NV<n> = n NVLinks, PIX/PXB/PHB/NODE/SYS as nvidia-smi, NET = other host) / "
          "one-direction GB/s the model uses", file=out)
    for nic in t["nics"]:
        paths = " ".join(nic["gpu_paths"]) or "-"
        speed = f"{nic['speed_gbps']:g} Gb/s" if nic["speed_gbps"] > 0 else "speed unknown"
        print(f"# NIC {nic['name']} host {nic['host']} {speed}, paths to GPUs: {paths}", file=out)
    lay = doc["layout"]
    print(f"# layout: {lay['nodes']} node(s) x {lay['ranks_per_node']} ranks", file=out)
    # The rings are built inside a node (node 0's GPUs; every node has the same shape); across nodes the
    # two-level algorithms of the trees line below connect them.
    ring = "ring per node, node 0 shown" if lay["nodes"] > 1 else "ring"
    print(f"# {ring} (NCCL-style, any path): {' -> '.join(map(str, doc['ring']))}", file=out)
    p2p = doc["p2p_ring"]
    print(f"# {ring} over P2P only (our kernels): {' -> '.join(map(str, p2p)) if p2p else 'none (no P2P ring)'}",
          file=out)
    tr = doc["trees"]
    print(f"# trees: chain per node {tr['chains']}; between nodes (parent, child): {tr['inter'] or '-'}", file=out)
    print(f"# custom kernels modelled: {', '.join(doc['custom_algorithms']) or 'all'}; NCCL picks its own "
          f"algorithm (the column is the model's guess)", file=out)
    print(f"# NCCL model here: {doc['nccl_confidence']}", file=out)
    if doc.get("nccl_interval"):
        print(f"# NCCL model's interval at 1 GiB: {doc['nccl_interval']}", file=out)
    print(f"{'size':>10}  {'backend':<12} {'algorithm':<14} {'proto':<7} {'time (us)':>11} {'busbw (GB/s)':>13} "
          f"{'busbw range':>15}  {'sure':<12} model", file=out)
    for r in doc["rows"]:
        sure = (r.get("confidence") or "-").split(":", 1)[0]
        rng = f"{r['busbw_low'] / 1e9:.3g}-{r['busbw_high'] / 1e9:.3g}" if "busbw_high" in r else "-"
        print(f"{_size(r['size']):>10}  {r['backend']:<12} {r['algorithm']:<14} {r['protocol'] or '-':<7} "
              f"{r['seconds'] * 1e6:>11.1f} {r['busbw'] / 1e9:>13.1f} {rng:>15}  {sure:<12} {r['model']}", file=out)
    print("# sure: calibrated = a system class the NCCL model was fitted to; validated = checked against published "
          "points it was not fitted to; extrapolated = no published point of this class; estimate = gpucoll's own "
          "kernels, not yet measured; tuned = a gpucoll-tune fit", file=out)
    print("# busbw range: where the published value of a machine the model never saw fell 80-90% of the time "
          "(leave-one-system-out; bench/published/accuracy.py), widened for inputs beyond the published systems",
          file=out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucoll-topo", formatter_class=HelpFormatter, description=(
        "See the wiring and what gpucoll would do on it: the GPU matrix as nvidia-smi topo -m prints it, with\n"
        "gpucoll's link classes and each pair's bandwidth, the NICs, the rings and trees gpucoll would build, and for\n"
        "a collective a table from 8 B to 1 GiB: chosen backend/algorithm, predicted time and bus bandwidth."))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-nvidia-smi", metavar="FILE", help="the output of nvidia-smi topo -m ('-' for stdin)")
    src.add_argument("--from-nccl-xml", metavar="FILE", help="NCCL_TOPO_DUMP_FILE output")
    src.add_argument("--from-json", metavar="FILE", help="a gpucoll topology JSON (GPUCOLL_TOPO_DUMP_FILE)")
    p.add_argument("--nodes", type=int, default=0, help="nodes in the job (a one-host topology is replicated)")
    p.add_argument("--nranks-per-node", type=int, default=0, help="ranks per node (0: every GPU of a node)")
    p.add_argument("--coll", default="all_reduce", help="collective for the table")
    p.add_argument("--dtype", default="float32", help="element type of the table's calls (float32, float16, "
                   "bfloat16, float64, int8, uint8, int32, int64): it decides which backends can run them")
    p.add_argument("--tuning", metavar="FILE", help="tuning JSON from gpucoll-tune (default: GPUCOLL_TUNING_FILE)")
    p.add_argument("--gpu", metavar="MODEL", help="GPU model when the input has no names (nvidia-smi text), e.g. "
                   "H800, A100, 'GeForce RTX 4090': sets compute capability, NVLink/PCIe generation, GeForce")
    p.add_argument("--cpu-vendor", choices=["intel", "amd", "arm"], help="CPU vendor (NCCL's P2P rule depends on it)")
    p.add_argument("--nic-gbps", type=float, metavar="GBPS", help="speed of every NIC (nvidia-smi text has none)")
    p.add_argument("--net-transport", choices=["ib", "efa", "tcp"], help="how NCCL reaches the network: ib (verbs: "
                   "InfiniBand, RoCE; the default), efa (AWS), tcp (sockets, GCP GPUDirect-TCPX/TCPXO)")
    p.add_argument("--no-p2p", action="store_true", help="PCIe P2P unavailable between the GPUs (e.g. GeForce "
                   "boards; NVML tells when detecting, nvidia-smi topo -p2p r appended to the text does too)")
    p.add_argument("--nccl-version", default="", metavar="X.Y.Z", help="the NCCL the job loads (P2P rule changed "
                   "in 2.23; default: that rule)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


@reader_may_leave
def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    def read(path):
        if path == "-":
            return sys.stdin.read()
        with open(path) as f:
            return f.read()

    try:
        if args.from_nvidia_smi:
            topo = topology.from_nvidia_smi(read(args.from_nvidia_smi))
        elif args.from_nccl_xml:
            topo = topology.from_nccl_xml(read(args.from_nccl_xml))
        elif args.from_json:
            topo = topology.from_json(read(args.from_json))
        else:
            topo = topology.detect()
        if args.gpu:
            topo.set_gpu_model(args.gpu)
        if args.cpu_vendor:
            topo.set_cpu_vendor(args.cpu_vendor)
        if args.nic_gbps:
            topo.set_nic_speed(args.nic_gbps)
        if args.net_transport:
            topo.set_nic_transport(args.net_transport)
        if args.no_p2p:
            for a in range(topo.num_gpus):
                for b in range(a + 1, topo.num_gpus):
                    if topo.link_class(a, b) not in ("NVL", "NET"):
                        topo.set_p2p(a, b, "unsupported")
        tuning = read(args.tuning) if args.tuning else ""
        doc = report(topo, args.coll, args.dtype, args.nranks_per_node, args.nodes, tuning,
                     topology.nccl_version_number(args.nccl_version))
    except (GpucollError, OSError, ValueError) as exc:
        print(f"gpucoll-topo: {exc}", file=sys.stderr)
        return 2
    detected = not (args.from_nvidia_smi or args.from_nccl_xml or args.from_json)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print_report(doc)
    if detected and topo.num_gpus == 0:
        print("\n".join(no_gpu_hint()), file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
