// The link and path model (links.h): raw rates for our kernels, NCCL's units and transport rules for NCCL.
#include "topo/links.h"

#include <algorithm>

#include "select/cost.h"

namespace gpucoll::topo {

// ---- Raw rates ----------------------------------------------------------------------------------------------------
// NVLink lane rate, one direction: P100 160 GB/s over 4 links (gen 1, 20 GB/s), V100 300/6, A100 600/12,
// H100 900/18 (gens 2-4, 25 GB/s), B200 1800/18 (gen 5, 50 GB/s) - NVIDIA's bidirectional product figures halved.
double nvlink_lane_bw(int gen) { return gen >= 5 ? 50e9 : gen >= 2 ? 25e9 : 20e9; }

namespace {
// PCIe per lane, one direction, after 128b/130b encoding: gen 3 0.985, gen 4 1.969, gen 5 3.938 GB/s (PCI-SIG).
double pcie_lane_bw(int gen) {
  return gen >= 6 ? 7.877e9 : gen == 5 ? 3.938e9 : gen == 4 ? 1.969e9 : gen == 3 ? 0.985e9 : 0.5e9;
}
// When an importer could not see the PCIe generation: Hopper boards are PCIe gen 5, Ampere gen 4, older gen 3
// (NVIDIA's H100/A100/V100 datasheets), x16 (every datacenter GPU's slot). Assumption, not a measurement.
int pcie_gen_of(const Gpu& g) { return g.pcie_gen > 0 ? g.pcie_gen : g.cc_major >= 9 ? 5 : g.cc_major == 8 ? 4 : 3; }
int pcie_width_of(const Gpu& g) { return g.pcie_width > 0 ? g.pcie_width : 16; }
}  // namespace

double pcie_bw(const Gpu& g) { return pcie_lane_bw(pcie_gen_of(g)) * pcie_width_of(g); }
// Unknown NVLink generation (infer_defaults could not tell it): gen 3, the A100's. Assumption.
int nvlink_gen_of(const Gpu& g) { return g.nvlink_gen > 0 ? g.nvlink_gen : 3; }

double gpu_nvlink_bw(const Topology& t, int g, const std::vector<int>& group) {
  double sum = 0, sw = 0;
  for (int p : group) {
    if (p == g || t.link(g, p).cls != LinkClass::kNVL) continue;
    const double bw = t.link(g, p).nvlinks * nvlink_lane_bw(nvlink_gen_of(t.gpus[g]));
    if (t.link(g, p).nvswitch) sw = std::max(sw, bw);
    else sum += bw;
  }
  return sw + sum;
}

LinkClass worst_class(const Topology& t, const std::vector<int>& group) {
  LinkClass w = LinkClass::kSelf;
  for (size_t i = 0; i < group.size(); ++i) {
    for (size_t j = i + 1; j < group.size(); ++j) w = std::max(w, t.link(group[i], group[j]).cls);
  }
  return w;
}

// Paths that cannot do P2P are staged through host memory: each byte crosses PCIe twice plus a host copy; 0.5 of
// the PCIe rate inside a socket, 0.4 across sockets. Estimates for our kernels' fallback (NCCL's SHM transport
// has its own, calibrated, efficiency in nccl_model.cc).
double pair_bandwidth(const Topology& t, int a, int b) {
  const Link& l = t.link(a, b);
  const double pcie = std::min(pcie_bw(t.gpus[a]), pcie_bw(t.gpus[b]));
  switch (l.cls) {
    case LinkClass::kSelf: return 1e15;
    case LinkClass::kNVL:
      return l.nvlinks * nvlink_lane_bw(std::min(nvlink_gen_of(t.gpus[a]), nvlink_gen_of(t.gpus[b])));
    case LinkClass::kPIX:
    case LinkClass::kPXB: return p2p_usable(t, a, b, nullptr) ? pcie : pcie * 0.5;
    case LinkClass::kPHB:
    case LinkClass::kNODE: return pcie * 0.5;
    case LinkClass::kSYS: return pcie * 0.4;
    case LinkClass::kNET: return 0;
  }
  return 0;
}

bool p2p_usable(const Topology& t, int a, int b, std::string* why) {
  const Link& l = t.link(a, b);
  std::string reason;
  if (l.p2p == P2P::kFailed) reason = "P2P is reported but failed";
  else if (l.p2p == P2P::kUnsupported) reason = "the driver reports no P2P access";
  else if (l.cls > LinkClass::kPXB) reason = std::string("the path is ") + link_class_name(l.cls) +
                                             " (P2P needs NVLink or a PCIe switch: PIX/PXB)";
  else if (l.cls != LinkClass::kNVL && l.p2p == P2P::kUnknown && (is_geforce(t.gpus[a]) || is_geforce(t.gpus[b])))
    reason = "GeForce boards have PCIe P2P disabled by the driver";
  if (reason.empty()) return true;
  if (why) *why = "GPU " + std::to_string(a) + " and GPU " + std::to_string(b) + ": " + reason;
  return false;
}

// ---- NCCL's units and rules ------------------------------------------------------------------------------------
double nccl_nvlink_bw(const Gpu& g) {
  const int cc = g.cc_major * 10 + g.cc_minor;
  if (cc == 0) return nvlink_gen_of(g) >= 4 ? 20.6e9 : 20e9;  // unknown compute capability: by NVLink generation
  // src/graph/topo.h SM*_NVLINK_BW; Blackwell's (SM100_NVLINK_BW 40.1, NVLink 5 at twice the lane rate) came after
  // the 2.21.5 tables the tuner follows, with the GPUs that need it.
  return (cc >= 100 ? 40.1 : cc >= 90 ? 20.6 : cc == 86 ? 12.0 : cc >= 70 ? 20.0 : 18.0) * 1e9;
}

double nccl_pcie_bw(const Gpu& g) {
  static const int per_lane[] = {0, 15, 30, 60, 120, 240, 480};  // 100 Mb/s units by generation 1..6
  const int gen = std::min(pcie_gen_of(g), 6);
  return pcie_width_of(g) * per_lane[gen] / 80.0 * 1e9;
}

namespace {

// NCCL's path bandwidth for a PCIe path between two GPUs: the slower GPU link, and across sockets no more than
// the CPUs' interconnect (NCCL 2.21.5 src/graph/topo.h: SKL_QPI_BW 10, AMD_BW 16 GB/s; unknown vendor: Intel).
double nccl_pci_path_bw(const Topology& t, int a, int b) {
  double bw = std::min(nccl_pcie_bw(t.gpus[a]), nccl_pcie_bw(t.gpus[b]));
  if (t.link(a, b).cls == LinkClass::kSYS) {
    const std::string& v = t.hosts[static_cast<size_t>(t.gpus[a].host)].cpu_vendor;
    bw = std::min(bw, (v == "amd" ? 16.0 : v == "arm" ? 6.0 : 10.0) * 1e9);
  }
  return bw;
}

}  // namespace

Hop nccl_hop(const Topology& t, int a, int b, int nccl_version) {
  Hop h;
  const Link& l = t.link(a, b);
  const Gpu& ga = t.gpus[static_cast<size_t>(a)];
  const std::string& vendor = t.hosts[static_cast<size_t>(ga.host)].cpu_vendor;
  if (l.cls == LinkClass::kNVL) {
    h.p2p = h.nvlink = true;
    h.bw = l.nvlinks * std::min(nccl_nvlink_bw(ga), nccl_nvlink_bw(t.gpus[static_cast<size_t>(b)]));
    return h;
  }
  h.bw = nccl_pci_path_bw(t, a, b);
  // NCCL's P2P level (src/graph/paths.cc ncclTopoCheckP2p). Up to 2.22: any path (PATH_SYS) except on Intel,
  // ARM and Zhaoxin CPUs, where up to PXB. From 2.23 (v2.23.4-1): up to PXB, except AMD hosts with at most
  // two GPUs, where any path. An unknown CPU vendor is taken as Intel (the stricter rule).
  const bool old_rule = nccl_version > 0 && nccl_version < 22300;
  int host_gpus = 0;
  for (const Gpu& g : t.gpus) host_gpus += g.host == ga.host;
  const bool any_path = old_rule ? vendor == "amd" : vendor == "amd" && host_gpus <= 2;
  if (l.cls > LinkClass::kPXB && !any_path) {
    h.why = std::string("the path is ") + link_class_name(l.cls) + " and NCCL's P2P level on " +
            (vendor.empty() ? "an unknown (taken as Intel)" : vendor) + " CPU is PXB";
  } else if (l.p2p == P2P::kUnsupported || l.p2p == P2P::kFailed) {
    h.why = std::string("NVML/the driver report P2P ") + p2p_name(l.p2p);  // NCCL checks NVML's P2P status too
  } else if (l.p2p == P2P::kUnknown && (is_geforce(ga) || is_geforce(t.gpus[static_cast<size_t>(b)]))) {
    h.why = "GeForce boards report no PCIe P2P to NVML";
  } else {
    h.p2p = true;
    // Intel root complexes split P2P traffic into 64 B TLPs: NCCL charges 6/5 of the bytes (INTEL_P2P_OVERHEAD).
    if (l.cls > LinkClass::kPXB && vendor != "amd") h.bw = h.bw * 5 / 6;
  }
  return h;
}

double host_net_bw(const Topology& t, int host, const std::vector<int>& gpus, std::string* note) {
  // NCCL's net bandwidth is the NIC's speed in Mb/s / 8000 GB/s (src/transport/net_ib.cc); 100 Gb/s when a
  // NIC's speed is unknown (an assumption, noted).
  double nic = 0;
  int unknown = 0, count = 0;
  for (const Nic& n : t.nics) {
    if (n.host != host) continue;
    ++count;
    if (n.speed_gbps > 0) nic += n.speed_gbps / 8 * 1e9;
    else nic += 100.0 / 8 * 1e9, ++unknown;
  }
  if (count == 0) {
    nic = 100.0 / 8 * 1e9;
    if (note) *note = "no NIC known on host " + std::to_string(host) + ": assumed one 100 Gb/s NIC";
  } else if (unknown > 0 && note) {
    *note = std::to_string(unknown) + " NIC(s) of host " + std::to_string(host) + " with unknown speed: assumed 100 Gb/s";
  }
  double feed = 0;
  for (int g : gpus) {
    if (t.gpus[static_cast<size_t>(g)].host == host) feed += nccl_pcie_bw(t.gpus[static_cast<size_t>(g)]);
  }
  return feed > 0 ? std::min(nic, feed) : nic;
}

}  // namespace gpucoll::topo
