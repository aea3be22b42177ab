// The machine's wiring as a value: GPUs, the path class of every GPU pair, NICs, hosts.
//
// Modelled on NCCL's src/graph/topo.cc, but flattened: we keep what selection needs (the class of the path
// between two GPUs, NVLink counts, whether P2P works, GPU-NIC affinity) rather than NCCL's full graph. A
// Topology is built by detect() (NVML + sysfs + the CUDA driver), by an importer (nvidia-smi topo -m text,
// NCCL's topology XML), or loaded from our JSON; dump/load round-trip unchanged, so tests and gpucoll-topo
// run on recorded machines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpucoll::topo {

// Path classes, fastest first, with nvidia-smi's names (NCCL's PATH_* in the same order). NET joins GPUs on
// different hosts. Numeric order matters: "worse than PXB" is `cls > LinkClass::kPXB`.
enum class LinkClass : int {
  kSelf = 0,  // X
  kNVL = 1,   // NVLink, direct or through NVSwitch (see Link::nvswitch)
  kPIX = 2,   // at most one PCIe switch
  kPXB = 3,   // several PCIe switches, no host bridge
  kPHB = 4,   // through a PCIe host bridge (the CPU)
  kNODE = 5,  // between host bridges inside one NUMA node
  kSYS = 6,   // across the CPUs' interconnect (QPI/UPI/xGMI); nvidia-smi's old name is SOC
  kNET = 7,   // different hosts
};
const char* link_class_name(LinkClass c);
// Accepts X, NV<n>, PIX, PXB, PHB, NODE, SYS, SOC, NET (case-insensitive); *nvlinks gets n for NV<n>.
bool parse_link_class(const std::string& token, LinkClass* out, int* nvlinks);

// What the CUDA driver (cuDeviceCanAccessPeer) or a user says about P2P for a pair. kUnknown: not checked,
// the class decides (NVL, PIX, PXB: yes - NCCL's default P2P level is PXB). kFailed: reported but a transfer
// or mapping failed; P2P kernels must not use it.
enum class P2P : int { kUnknown = 0, kSupported = 1, kUnsupported = 2, kFailed = 3 };
const char* p2p_name(P2P p);
bool parse_p2p(const std::string& s, P2P* out);

struct Link {
  LinkClass cls = LinkClass::kSYS;
  int nvlinks = 0;        // NVLink lanes between the pair (for NVSwitch: the GPU's links into the switches)
  bool nvswitch = false;  // the links go through NVSwitches: pair bandwidth is shared by all peers
  P2P p2p = P2P::kUnknown;
  bool operator==(const Link& o) const {
    return cls == o.cls && nvlinks == o.nvlinks && nvswitch == o.nvswitch && p2p == o.p2p;
  }
};

struct Gpu {
  int index = 0;  // within its host
  int host = 0;
  std::string name;
  std::string bus_id;  // "0000:18:00.0" (lower case, 4-digit domain), or empty
  int numa_node = -1;
  int cc_major = 0, cc_minor = 0;  // 0.0: unknown
  int nvlink_gen = 0;              // 0: unknown/none
  int pcie_gen = 0, pcie_width = 0;
  std::string cpu_affinity;  // as nvidia-smi prints it, e.g. "0-47,96-143"
  bool operator==(const Gpu& o) const;
};

struct Nic {
  std::string name;  // "mlx5_0", "eth0"
  int host = 0;
  std::string bus_id;
  int numa_node = -1;
  double speed_gbps = 0;             // 0: unknown
  std::vector<LinkClass> gpu_paths;  // class of the path to each GPU of its host, by GPU index
  // How NCCL reaches the network through it: "ib" (verbs: InfiniBand, RoCE), "efa" (AWS, libfabric through
  // aws-ofi-nccl), "tcp" (sockets, or GCP's GPUDirect-TCPX/TCPXO plugins); "" unknown (taken as verbs). Nothing
  // on a machine says it in a form the importers read: the user does (gpucoll-topo --net-transport).
  std::string transport;
  bool operator==(const Nic& o) const;
};

// "ib", "efa", "tcp" or "" (Nic::transport).
bool valid_net_transport(const std::string& t);

struct Host {
  std::string name;
  // "intel", "amd", "arm" or "" (unknown): NCCL's P2P level depends on it (src/graph/paths.cc), see links.h.
  std::string cpu_vendor;
  bool operator==(const Host& o) const { return name == o.name && cpu_vendor == o.cpu_vendor; }
};

class Topology {
 public:
  std::string source;  // "detect", "nvidia-smi", "nccl-xml", "json", "merge"
  std::vector<Host> hosts;
  std::vector<Gpu> gpus;  // global order: host by host
  std::vector<Nic> nics;
  std::vector<std::string> notes;  // what detection could not do and why (NVML absent, P2P unchecked, ...)

  int num_gpus() const { return static_cast<int>(gpus.size()); }
  // Resizes the link matrix to the GPU count (new pairs: SYS, or NET across hosts; diagonal: X).
  void reset_links();
  const Link& link(int a, int b) const;
  Link& link(int a, int b);  // symmetric: link(a, b) and link(b, a) are the same object
  // Global indices of the GPUs of one host, in index order.
  std::vector<int> host_gpus(int host) const;

  std::string to_json() const;
  static Topology from_json(const std::string& text);
  bool operator==(const Topology& o) const;

 private:
  std::vector<Link> links_;  // upper triangle incl. diagonal, row-major
  size_t slot(int a, int b) const;
};

// Structural checks every importer runs last: indices, hosts, symmetric classes, NVLink counts; throws
// InvalidArgument naming the problem.
void validate(const Topology& t);

// Fills what importers cannot see from what they can: compute capability and PCIe generation from the GPU's
// name (known_gpu below), NVLink generation from the compute capability or, when both are unknown, from the
// GPU's total link count (18: gen 4 as on H100, 12: gen 3, 6: gen 2, 4: gen 1 - an H800's NV8 needs its name);
// NVSwitch when all pairs show the same count and that many links to every peer cannot be separate wires.
void infer_defaults(Topology& t);

// What a GPU's product name tells (NVIDIA's datasheets): compute capability, PCIe generation, NVLink generation
// (0: none), and whether it is a GeForce board (its driver disables PCIe P2P; NVML reports that, see links.h).
struct KnownGpu {
  int cc_major = 0, cc_minor = 0, pcie_gen = 0, nvlink_gen = 0;
  bool geforce = false;
};
// False when the name matches no entry (then only `geforce` may be set, from the word GeForce).
bool known_gpu(const std::string& name, KnownGpu* out);
bool is_geforce(const Gpu& g);
// Names every GPU (nvidia-smi text carries no names) and re-derives what the name tells: compute capability,
// PCIe and NVLink generation, NVSwitch. Throws InvalidArgument for a name known_gpu does not know.
void set_gpu_model(Topology& t, const std::string& name);

// Detection on this machine. Never throws for a missing driver, NVML or GPU: the result then has no GPUs and
// `notes` says why. GPUCOLL_TOPO_FILE replaces detection with that file; GPUCOLL_TOPO_DUMP_FILE writes the
// result (after either) as JSON.
Topology detect();
Topology detect_local();  // the hardware only, ignoring both variables

// Any of our formats, told apart by the first character: '{' JSON, '<' NCCL XML, else nvidia-smi text.
Topology from_text(const std::string& text);
Topology from_nvidia_smi(const std::string& text);
Topology from_nccl_xml(const std::string& text);

// Joins per-host topologies (ranks' views merged by host name first: GPUs are unioned by bus id, else by
// index) into one multi-host value; pairs across hosts are NET.
Topology merge(const std::vector<Topology>& parts);
// `nodes` copies of a single-host topology named <host>-0 .. <host>-(n-1): explain a multi-node job.
Topology replicate(const Topology& one_host, int nodes);

}  // namespace gpucoll::topo
