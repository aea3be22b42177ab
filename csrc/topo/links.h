// The link and path model: what one GPU pair, one GPU or one host can move, and over which transport.
//
// Two views of the same wires. Raw link rates (NVIDIA's and PCI-SIG's figures) price our own P2P kernels and the
// host staging copies. NCCL's units (src/graph/topo.h and topo.cc: 20 GB/s per NVLink on sm_80, width x GT/s / 8
// x 0.75 for PCIe, ...) are what NCCL's graph search and tuner work in, so the NCCL model (nccl_model.h) takes
// them, together with NCCL's rules for when a hop may use P2P and when it goes through host memory (SHM).
#pragma once

#include <string>
#include <vector>

#include "topo/topology.h"

namespace gpucoll::topo {

// ---- Raw rates (bytes/s, one direction) -------------------------------------------------------------------------
double nvlink_lane_bw(int gen);
double pcie_bw(const Gpu& g);  // the GPU's own PCIe link
int nvlink_gen_of(const Gpu& g);
// A GPU's NVLink bandwidth towards `group`: through NVSwitch its lane count once, in a direct mesh the sum.
double gpu_nvlink_bw(const Topology& t, int g, const std::vector<int>& group);
LinkClass worst_class(const Topology& t, const std::vector<int>& group);

// ---- NCCL's units (bytes/s, one direction) ---------------------------------------------------------------------
// Per NVLink: sm_60 18, sm_70/sm_80 20, sm_86 12, sm_90+ 20.6 GB/s (NCCL 2.21.5 src/graph/topo.h SM*_NVLINK_BW).
double nccl_nvlink_bw(const Gpu& g);
// PCIe: width x per-lane rate (gen 3 8 GT/s -> 60, gen 4 120, gen 5 240, in 100 Mb/s) / 80 (NCCL 2.21.5
// src/graph/topo.cc ncclTopoAddPci): gen 3 x16 = 12 GB/s, gen 4 x16 = 24, gen 5 x16 = 48.
double nccl_pcie_bw(const Gpu& g);
// One ring hop as NCCL would run it: P2P (NVLink or PCIe, including through a host bridge where NCCL's P2P
// level allows) or SHM (staged through host memory). `gbps` is NCCL's path bandwidth of the hop in bytes/s.
struct Hop {
  bool p2p = false;
  bool nvlink = false;
  double bw = 0;
  std::string why;  // why not P2P, when !p2p
};
// nccl_version as ncclGetVersion reports it (22105 for 2.21.5); 0: the rules of NCCL >= 2.23.
Hop nccl_hop(const Topology& t, int a, int b, int nccl_version);
// The network a host's ranks reach: the sum of its NICs' rates (100 Gb/s per NIC whose speed is unknown, noted
// in *note), no more than the sum of the PCIe links of the host's GPUs in `gpus` that feed them.
double host_net_bw(const Topology& t, int host, const std::vector<int>& gpus, std::string* note);

}  // namespace gpucoll::topo
