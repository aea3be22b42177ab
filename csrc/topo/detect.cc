// Topology detection on this machine: NVML (dlopen, like NCCL's nvmlwrap.cc), sysfs, and the CUDA driver.
//
// Nothing here throws for missing pieces: no NVML, no driver, no GPU or an unreadable sysfs each leave a note
// in Topology::notes and detection goes on with what it has. Sources, most trusted first:
//   * NVML: GPUs (name, bus id, compute capability, PCIe generation/width), NVLink per link (remote bus id and
//     whether the remote is an NVSwitch), the PCIe path class (nvmlDeviceGetTopologyCommonAncestor, the same
//     call nvidia-smi topo -m uses) and NVML's P2P status.
//   * The CUDA driver (already probed by cuda_probe()): GPUs when NVML is absent, and cuDeviceCanAccessPeer as
//     a cross-check of P2P - NVML can report P2P that the driver then refuses (IOMMU, ACS, virtualisation).
//   * sysfs (/sys/bus/pci/devices, /sys/class/net, /sys/class/infiniband): NUMA nodes, NICs and their speed,
//     and PCIe path classes from the device paths when NVML cannot say.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <dirent.h>

#include "device/cuda_probe.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "topo/topology.h"

namespace gpucoll::topo {

namespace {

// ---- NVML function table ------------------------------------------------------------------------------------
// Types as declared in nvml.h (stable ABI; the _v2/_v3 names are what nvml.h maps the plain names to).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
constexpr int kNvmlMaxLinks = 18;        // NVML_NVLINK_MAX_LINKS
constexpr int kNvmlP2PRead = 0;          // NVML_P2P_CAPS_INDEX_READ
constexpr int kNvmlP2PWrite = 1;         // NVML_P2P_CAPS_INDEX_WRITE
constexpr int kNvmlRemoteSwitch = 2;     // NVML_NVLINK_DEVICE_TYPE_SWITCH

#define GPUCOLL_NVML_FUNCTIONS(X)                                                              \
  X(nvmlInit_v2, nvmlReturn_t, (), true)                                                     \
  X(nvmlShutdown, nvmlReturn_t, (), true)                                                    \
  X(nvmlErrorString, const char*, (nvmlReturn_t), true)                                      \
  X(nvmlDeviceGetCount_v2, nvmlReturn_t, (unsigned int*), true)                              \
  X(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t, (unsigned int, nvmlDevice_t*), true)        \
  X(nvmlDeviceGetName, nvmlReturn_t, (nvmlDevice_t, char*, unsigned int), false)             \
  X(nvmlDeviceGetPciInfo_v3, nvmlReturn_t, (nvmlDevice_t, nvmlPciInfo_t*), true)             \
  X(nvmlDeviceGetCudaComputeCapability, nvmlReturn_t, (nvmlDevice_t, int*, int*), false)     \
  X(nvmlDeviceGetMaxPcieLinkGeneration, nvmlReturn_t, (nvmlDevice_t, unsigned int*), false)  \
  X(nvmlDeviceGetMaxPcieLinkWidth, nvmlReturn_t, (nvmlDevice_t, unsigned int*), false)       \
  X(nvmlDeviceGetNvLinkState, nvmlReturn_t, (nvmlDevice_t, unsigned int, int*), false)       \
  X(nvmlDeviceGetNvLinkRemotePciInfo_v2, nvmlReturn_t, (nvmlDevice_t, unsigned int, nvmlPciInfo_t*), false) \
  X(nvmlDeviceGetNvLinkRemoteDeviceType, nvmlReturn_t, (nvmlDevice_t, unsigned int, int*), false) \
  X(nvmlDeviceGetTopologyCommonAncestor, nvmlReturn_t, (nvmlDevice_t, nvmlDevice_t, int*), false) \
  X(nvmlDeviceGetP2PStatus, nvmlReturn_t, (nvmlDevice_t, nvmlDevice_t, int, int*), false)

struct Nvml {
#define GPUCOLL_NVML_FIELD(name, ret, args, required) ret(*name) args = nullptr;
  GPUCOLL_NVML_FUNCTIONS(GPUCOLL_NVML_FIELD)
#undef GPUCOLL_NVML_FIELD
  std::string reason;  // why not usable; empty when usable

  std::string err(nvmlReturn_t r) const {
    const char* s = nvmlErrorString != nullptr ? nvmlErrorString(r) : nullptr;
    return (s != nullptr ? std::string(s) : std::string("NVML error")) + " (" + std::to_string(r) + ")";
  }
};

// Loaded once and kept: NVML is reference counted by nvmlInit/nvmlShutdown, the library itself stays mapped
// (as NCCL does), so repeated detections cost one init each.
const Nvml& nvml() {
  static const Nvml table = [] {
    Nvml t;
    dlerror();
    void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      t.reason = std::string("NVML not available: libnvidia-ml.so.1 not found (") + (e ? e : "dlopen failed") + ")";
      return t;
    }
    std::string missing;
#define GPUCOLL_NVML_RESOLVE(name, ret, args, required)            \
  t.name = reinterpret_cast<ret(*) args>(dlsym(h, #name));                 \
  if (t.name == nullptr && (required)) missing += " " #name;
    GPUCOLL_NVML_FUNCTIONS(GPUCOLL_NVML_RESOLVE)
#undef GPUCOLL_NVML_RESOLVE
    if (!missing.empty()) t.reason = "NVML too old: libnvidia-ml.so.1 lacks" + missing;
    return t;
  }();
  return table;
}

// ---- sysfs --------------------------------------------------------------------------------------------------

// "00000000:18:00.0" (NVML) or "0000:18:00.0" (CUDA) -> "0000:18:00.0".
std::string normalize_bus_id(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const size_t colon = s.find(':');
  if (colon != std::string::npos && colon > 4) s = s.substr(colon - 4);
  return s;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (f) std::getline(f, s);
  return s;
}

int numa_of(const std::string& bus_id) {
  const std::string s = read_line("/sys/bus/pci/devices/" + bus_id + "/numa_node");
  return s.empty() ? -1 : std::atoi(s.c_str());
}

// The PCI path of a device: components of its /sys/devices path, root complex first, the device last.
std::vector<std::string> pci_chain_of_path(const std::string& link) {
  char buf[PATH_MAX];
  if (realpath(link.c_str(), buf) == nullptr) return {};
  std::vector<std::string> out;
  std::istringstream is(buf);
  std::string part;
  bool in = false;
  while (std::getline(is, part, '/')) {
    if (part.rfind("pci", 0) == 0 && part.find(':') != std::string::npos) in = true;
    if (in && !part.empty()) out.push_back(part);
  }
  // Drop what hangs below the last PCI function (a netdev's "virtio2", "net", ...): the chain ends at the device.
  auto is_bdf = [](const std::string& p) { return p.size() == 12 && p[4] == ':' && p[7] == ':' && p[10] == '.'; };
  while (out.size() > 1 && !is_bdf(out.back())) out.pop_back();
  if (out.size() < 2) out.clear();
  return out;
}

// nvidia-smi's classes from two sysfs paths (see the report's notes for the rules): different root complexes
// are NODE within a NUMA node and SYS across; only the root complex in common is PHB; otherwise at most one
// switch level below the common bridge is PIX, more is PXB.
LinkClass classify_paths(const std::vector<std::string>& a, const std::vector<std::string>& b, int numa_a,
                         int numa_b) {
  if (a.size() < 2 || b.size() < 2) return LinkClass::kSYS;  // unknown: the conservative class
  if (a[0] != b[0]) return numa_a >= 0 && numa_a == numa_b ? LinkClass::kNODE : LinkClass::kSYS;
  size_t k = 0;
  while (k < a.size() - 1 && k < b.size() - 1 && a[k] == b[k]) ++k;
  if (k <= 1) return LinkClass::kPHB;
  const size_t da = a.size() - 1 - k, db = b.size() - 1 - k;
  return da <= 1 && db <= 1 ? LinkClass::kPIX : LinkClass::kPXB;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') out.emplace_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct NicFound {
  Nic nic;
  std::vector<std::string> chain;
};

std::vector<NicFound> sysfs_nics() {
  std::vector<NicFound> out;
  std::map<std::string, size_t> by_bus;
  // InfiniBand/RoCE devices first: NCCL's IB transport names NICs this way (mlx5_0), and their netdevs are
  // the same PCI function.
  for (const std::string& name : list_dir("/sys/class/infiniband")) {
    const std::string dev = "/sys/class/infiniband/" + name + "/device";
    NicFound f;
    f.chain = pci_chain_of_path(dev);
    if (f.chain.empty()) continue;
    f.nic.name = name;
    f.nic.bus_id = f.chain.back();
    f.nic.numa_node = numa_of(f.nic.bus_id);
    const std::string rate = read_line("/sys/class/infiniband/" + name + "/ports/1/rate");  // "200 Gb/sec (4X HDR)"
    f.nic.speed_gbps = std::atof(rate.c_str());
    by_bus[f.nic.bus_id] = out.size();
    out.push_back(f);
  }
  for (const std::string& name : list_dir("/sys/class/net")) {
    const std::string dev = "/sys/class/net/" + name + "/device";
    NicFound f;
    f.chain = pci_chain_of_path(dev);
    if (f.chain.empty()) continue;  // lo, bridges, veth, docker0: no PCI device behind them
    f.nic.bus_id = f.chain.back();
    if (by_bus.count(f.nic.bus_id)) continue;
    f.nic.name = name;
    f.nic.numa_node = numa_of(f.nic.bus_id);
    const std::string speed = read_line("/sys/class/net/" + name + "/speed");  // Mb/s; -1 when down
    const double mbps = std::atof(speed.c_str());
    f.nic.speed_gbps = mbps > 0 ? mbps / 1000.0 : 0;
    by_bus[f.nic.bus_id] = out.size();
    out.push_back(f);
  }
  return out;
}

// The CPU vendor as NCCL reads it (CPUID vendor string; arm64 has none): its P2P level depends on it.
std::string cpu_vendor() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("vendor_id", 0) == 0) {
      if (line.find("GenuineIntel") != std::string::npos) return "intel";
      if (line.find("AuthenticAMD") != std::string::npos) return "amd";
      return "";
    }
    if (line.rfind("CPU implementer", 0) == 0) return "arm";
  }
  return "";
}

// ---- CUDA driver cross-check --------------------------------------------------------------------------------
using PFN_cuDeviceCanAccessPeer = int (*)(int*, int, int);

}  // namespace

Topology detect_local() {
  Topology t;
  t.source = "detect";
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  t.hosts.push_back(Host{host, cpu_vendor()});

  // GPUs: NVML first, the CUDA driver when NVML is absent.
  const Nvml& nv = nvml();
  std::vector<nvmlDevice_t> handles;
  std::map<std::string, int> direct_links;  // "a|remote bus id" -> count
  std::vector<int> switch_links;
  bool nvml_up = false;
  if (nv.reason.empty()) {
    const nvmlReturn_t r = nv.nvmlInit_v2();
    if (r != kNvmlSuccess) {
      t.notes.push_back("NVML not usable: nvmlInit failed: " + nv.err(r));
    } else {
      nvml_up = true;
      unsigned int count = 0;
      if (nv.nvmlDeviceGetCount_v2(&count) != kNvmlSuccess) count = 0;
      for (unsigned int i = 0; i < count; ++i) {
        nvmlDevice_t d = nullptr;
        nvmlPciInfo_t pci{};
        if (nv.nvmlDeviceGetHandleByIndex_v2(i, &d) != kNvmlSuccess || nv.nvmlDeviceGetPciInfo_v3(d, &pci) != 0) {
          t.notes.push_back("NVML: GPU " + std::to_string(i) + " skipped (no handle or PCI info)");
          continue;
        }
        Gpu g;
        g.index = static_cast<int>(t.gpus.size());
        g.bus_id = normalize_bus_id(pci.busId);
        char name[96] = {};
        if (nv.nvmlDeviceGetName && nv.nvmlDeviceGetName(d, name, sizeof(name) - 1) == kNvmlSuccess) g.name = name;
        if (nv.nvmlDeviceGetCudaComputeCapability) nv.nvmlDeviceGetCudaComputeCapability(d, &g.cc_major, &g.cc_minor);
        unsigned int v = 0;
        if (nv.nvmlDeviceGetMaxPcieLinkGeneration && nv.nvmlDeviceGetMaxPcieLinkGeneration(d, &v) == 0) g.pcie_gen = static_cast<int>(v);
        if (nv.nvmlDeviceGetMaxPcieLinkWidth && nv.nvmlDeviceGetMaxPcieLinkWidth(d, &v) == 0) g.pcie_width = static_cast<int>(v);
        int sw = 0;
        for (unsigned int l = 0; l < static_cast<unsigned int>(kNvmlMaxLinks) && nv.nvmlDeviceGetNvLinkState; ++l) {
          int active = 0;
          if (nv.nvmlDeviceGetNvLinkState(d, l, &active) != kNvmlSuccess || !active) continue;
          int type = -1;
          if (nv.nvmlDeviceGetNvLinkRemoteDeviceType && nv.nvmlDeviceGetNvLinkRemoteDeviceType(d, l, &type) == 0 &&
              type == kNvmlRemoteSwitch) {
            ++sw;
            continue;
          }
          nvmlPciInfo_t remote{};
          if (nv.nvmlDeviceGetNvLinkRemotePciInfo_v2 && nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(d, l, &remote) == 0) {
            ++direct_links[std::to_string(g.index) + "|" + normalize_bus_id(remote.busId)];
          }
        }
        switch_links.push_back(sw);
        handles.push_back(d);
        t.gpus.push_back(g);
      }
    }
  } else {
    t.notes.push_back(nv.reason);
  }
  const CudaProbe cuda = cuda_probe();
  if (t.gpus.empty() && !nvml_up) {
    for (const CudaDeviceInfo& d : cuda.devices) {
      Gpu g;
      g.index = static_cast<int>(t.gpus.size());
      g.name = d.name;
      g.bus_id = normalize_bus_id(d.pci_bus_id);
      g.cc_major = d.major;
      g.cc_minor = d.minor;
      t.gpus.push_back(g);
    }
    if (!t.gpus.empty()) {
      t.notes.push_back(cuda.emulated ? "GPUs of gpucoll's emulated CUDA device (not GPUs): links modelled as one PCIe "
                                        "switch, P2P as the emulator says"
                                      : "GPUs from the CUDA driver; NVLink unknown without NVML");
    }
  }
  if (cuda.devices.empty()) t.notes.push_back("CUDA: " + cuda.reason);

  std::vector<std::vector<std::string>> chains;
  for (Gpu& g : t.gpus) {
    g.numa_node = numa_of(g.bus_id);
    chains.push_back(pci_chain_of_path("/sys/bus/pci/devices/" + g.bus_id));
  }
  t.reset_links();
  const int n = t.num_gpus();
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      Link l;
      const auto ab = direct_links.find(std::to_string(a) + "|" + t.gpus[b].bus_id);
      const auto ba = direct_links.find(std::to_string(b) + "|" + t.gpus[a].bus_id);
      const int direct = std::max(ab == direct_links.end() ? 0 : ab->second, ba == direct_links.end() ? 0 : ba->second);
      if (direct > 0) {
        l.cls = LinkClass::kNVL;
        l.nvlinks = direct;
      } else if (nvml_up && switch_links[a] > 0 && switch_links[b] > 0) {
        l.cls = LinkClass::kNVL;
        l.nvlinks = std::min(switch_links[a], switch_links[b]);
        l.nvswitch = true;
      } else if (nvml_up && nv.nvmlDeviceGetTopologyCommonAncestor) {
        int level = 0;
        // NVML_TOPOLOGY_INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50.
        if (nv.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b], &level) == 0) {
          l.cls = level <= 10 ? LinkClass::kPIX : level <= 20 ? LinkClass::kPXB : level <= 30 ? LinkClass::kPHB
                  : level <= 40 ? LinkClass::kNODE : LinkClass::kSYS;
        } else {
          l.cls = classify_paths(chains[a], chains[b], t.gpus[a].numa_node, t.gpus[b].numa_node);
        }
      } else if (cuda.emulated) {
        // gpucoll's emulated devices have no PCI path (their bus ids are made up): model them as GPUs behind one
        // PCIe switch, P2P-capable as far as the path goes; the driver cross-check below applies GPUCOLL_EMU_P2P.
        l.cls = LinkClass::kPIX;
      } else {
        l.cls = classify_paths(chains[a], chains[b], t.gpus[a].numa_node, t.gpus[b].numa_node);
      }
      if (nvml_up && nv.nvmlDeviceGetP2PStatus) {
        // NCCL (src/graph/paths.cc) wants both the read and the write status OK; a GeForce board reports
        // NOT_SUPPORTED over PCIe, which is how its disabled P2P is told apart.
        int rd = 0, wr = 0;
        if (nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], kNvmlP2PRead, &rd) == 0 &&
            nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], kNvmlP2PWrite, &wr) == 0) {
          l.p2p = rd == 0 && wr == 0 ? P2P::kSupported : P2P::kUnsupported;
        }
      }
      t.link(a, b) = l;
    }
  }
  if (nvml_up) nv.nvmlShutdown();

  // Cross-check P2P with the driver, matching CUDA devices to ours by bus id (CUDA_VISIBLE_DEVICES may hide
  // or reorder them).
  if (n > 1) {
    void* h = cuda.driver_available ? dlopen(cuda_driver_library(), RTLD_NOW | RTLD_NOLOAD) : nullptr;
    auto can = h ? reinterpret_cast<PFN_cuDeviceCanAccessPeer>(dlsym(h, "cuDeviceCanAccessPeer")) : nullptr;
    if (can == nullptr) {
      t.notes.push_back("P2P not cross-checked with cuDeviceCanAccessPeer: " +
                        (cuda.driver_available ? std::string("entry point missing") : cuda.reason));
    } else {
      std::map<std::string, int> cuda_index;
      for (const CudaDeviceInfo& d : cuda.devices) cuda_index[normalize_bus_id(d.pci_bus_id)] = d.index;
      for (int a = 0; a < n; ++a) {
        for (int b = a + 1; b < n; ++b) {
          auto ia = cuda_index.find(t.gpus[a].bus_id), ib = cuda_index.find(t.gpus[b].bus_id);
          if (ia == cuda_index.end() || ib == cuda_index.end()) continue;
          int x = 0, y = 0;
          if (can(&x, ia->second, ib->second) != 0 || can(&y, ib->second, ia->second) != 0) continue;
          Link& l = t.link(a, b);
          if (l.p2p == P2P::kSupported && !(x && y)) {
            t.notes.push_back("GPU " + std::to_string(a) + " and " + std::to_string(b) +
                              ": NVML reports P2P but cuDeviceCanAccessPeer refuses it");
          }
          l.p2p = x && y ? P2P::kSupported : P2P::kUnsupported;
        }
      }
    }
    if (h != nullptr) dlclose(h);
  }

  for (NicFound& f : sysfs_nics()) {
    for (int g = 0; g < n; ++g) {
      f.nic.gpu_paths.push_back(classify_paths(chains[g], f.chain, t.gpus[g].numa_node, f.nic.numa_node));
    }
    t.nics.push_back(f.nic);
  }
  infer_defaults(t);
  validate(t);
  return t;
}

Topology from_text(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  GPUCOLL_CHECK_ARG(first != std::string::npos, "topology: empty input");
  if (text[first] == '{') return Topology::from_json(text);
  if (text[first] == '<') return from_nccl_xml(text);
  return from_nvidia_smi(text);
}

Topology detect() {
  Topology t;
  if (config_is_set("GPUCOLL_TOPO_FILE")) {
    const std::string path = config_raw("GPUCOLL_TOPO_FILE");
    std::ifstream f(path);
    if (!f) GPUCOLL_SYSCALL_FAIL("open(" + path + ") for GPUCOLL_TOPO_FILE", errno);
    std::stringstream ss;
    ss << f.rdbuf();
    t = from_text(ss.str());
    GPUCOLL_INFO("topology from GPUCOLL_TOPO_FILE=", path, " (", t.num_gpus(), " GPUs)");
  } else {
    t = detect_local();
  }
  if (config_is_set("GPUCOLL_TOPO_DUMP_FILE")) {
    const std::string path = config_raw("GPUCOLL_TOPO_DUMP_FILE");
    const std::string tmp = path + ".tmp" + std::to_string(getpid());
    std::ofstream f(tmp);
    f << t.to_json();
    f.close();
    // A failed dump must not fail detection (it is a diagnostic, as NCCL_TOPO_DUMP_FILE is): warn instead.
    if (!f || std::rename(tmp.c_str(), path.c_str()) != 0) {
      GPUCOLL_WARN("GPUCOLL_TOPO_DUMP_FILE=", path, ": could not write the topology: ", std::strerror(errno));
      std::remove(tmp.c_str());
    }
  }
  return t;
}

}  // namespace gpucoll::topo
