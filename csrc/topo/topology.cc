#include "topo/topology.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <set>

#include "core/error.h"
#include "topo/json.h"

namespace gpucoll::topo {

namespace {
const char* const kClassNames[] = {"X", "NVL", "PIX", "PXB", "PHB", "NODE", "SYS", "NET"};
const char* const kP2PNames[] = {"unknown", "supported", "unsupported", "failed"};
constexpr int kJsonVersion = 1;

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
}  // namespace

const char* link_class_name(LinkClass c) {
  const int i = static_cast<int>(c);
  return i >= 0 && i <= 7 ? kClassNames[i] : "?";
}

bool parse_link_class(const std::string& token, LinkClass* out, int* nvlinks) {
  const std::string t = upper(token);
  if (nvlinks) *nvlinks = 0;
  if (t.size() > 2 && t.compare(0, 2, "NV") == 0 && std::all_of(t.begin() + 2, t.end(), ::isdigit)) {
    *out = LinkClass::kNVL;
    if (nvlinks) *nvlinks = std::atoi(t.c_str() + 2);
    return true;
  }
  if (t == "SOC") {  // nvidia-smi before r390 called the inter-socket path SOC
    *out = LinkClass::kSYS;
    return true;
  }
  for (int i = 0; i <= 7; ++i) {
    if (t == kClassNames[i]) {
      *out = static_cast<LinkClass>(i);
      return true;
    }
  }
  return false;
}

const char* p2p_name(P2P p) {
  const int i = static_cast<int>(p);
  return i >= 0 && i <= 3 ? kP2PNames[i] : "?";
}
bool parse_p2p(const std::string& s, P2P* out) {
  for (int i = 0; i <= 3; ++i) {
    if (s == kP2PNames[i]) {
      *out = static_cast<P2P>(i);
      return true;
    }
  }
  return false;
}

bool Gpu::operator==(const Gpu& o) const {
  return index == o.index && host == o.host && name == o.name && bus_id == o.bus_id && numa_node == o.numa_node &&
         cc_major == o.cc_major && cc_minor == o.cc_minor && nvlink_gen == o.nvlink_gen && pcie_gen == o.pcie_gen &&
         pcie_width == o.pcie_width && cpu_affinity == o.cpu_affinity;
}
bool valid_net_transport(const std::string& t) { return t.empty() || t == "ib" || t == "efa" || t == "tcp"; }

bool Nic::operator==(const Nic& o) const {
  return name == o.name && host == o.host && bus_id == o.bus_id && numa_node == o.numa_node &&
         speed_gbps == o.speed_gbps && gpu_paths == o.gpu_paths && transport == o.transport;
}

size_t Topology::slot(int a, int b) const {
  const int n = num_gpus();
  GPUCOLL_CHECK_ARG(a >= 0 && a < n && b >= 0 && b < n, "GPU index out of range: (", a, ", ", b, ") with ", n,
                    " GPUs");
  if (a > b) std::swap(a, b);
  // Row a of the upper triangle starts after rows 0..a-1, which hold n, n-1, ... entries.
  const size_t row = static_cast<size_t>(a) * static_cast<size_t>(n) - static_cast<size_t>(a) * (a - 1) / 2;
  return row + static_cast<size_t>(b - a);
}

void Topology::reset_links() {
  const int n = num_gpus();
  links_.assign(static_cast<size_t>(n) * (n + 1) / 2, Link{});
  for (int a = 0; a < n; ++a) {
    for (int b = a; b < n; ++b) {
      Link& l = links_[slot(a, b)];
      l.cls = a == b ? LinkClass::kSelf : gpus[a].host != gpus[b].host ? LinkClass::kNET : LinkClass::kSYS;
    }
  }
}

const Link& Topology::link(int a, int b) const { return links_.at(slot(a, b)); }
Link& Topology::link(int a, int b) { return links_.at(slot(a, b)); }

std::vector<int> Topology::host_gpus(int host) const {
  std::vector<int> out;
  for (int i = 0; i < num_gpus(); ++i) {
    if (gpus[i].host == host) out.push_back(i);
  }
  return out;
}

bool Topology::operator==(const Topology& o) const {
  return source == o.source && hosts == o.hosts && gpus == o.gpus && nics == o.nics && notes == o.notes &&
         links_ == o.links_;
}

// ---- JSON ---------------------------------------------------------------------------------------------------
// Links are listed once per unordered pair (a < b); NVLink counts and P2P appear only when they say something,
// which keeps hand-written fixtures short. Every field has one spelling, so dump(load(dump(t))) == dump(t).

std::string Topology::to_json() const {
  Json root = Json::object();
  root.set("format", Json::string("gpucoll-topology"));
  root.set("version", Json::number(kJsonVersion));
  root.set("source", Json::string(source));
  Json hs = Json::array();
  for (const Host& h : hosts) {
    Json& j = hs.push(Json::object());
    j.set("name", Json::string(h.name));
    if (!h.cpu_vendor.empty()) j.set("cpu_vendor", Json::string(h.cpu_vendor));
  }
  root.set("hosts", hs);
  Json gs = Json::array();
  for (const Gpu& g : gpus) {
    Json& j = gs.push(Json::object());
    j.set("index", Json::number(g.index));
    j.set("host", Json::number(g.host));
    j.set("name", Json::string(g.name));
    j.set("bus_id", Json::string(g.bus_id));
    j.set("numa_node", Json::number(g.numa_node));
    Json cc = Json::array();
    cc.push(Json::number(g.cc_major));
    cc.push(Json::number(g.cc_minor));
    j.set("compute_capability", cc);
    j.set("nvlink_gen", Json::number(g.nvlink_gen));
    j.set("pcie_gen", Json::number(g.pcie_gen));
    j.set("pcie_width", Json::number(g.pcie_width));
    j.set("cpu_affinity", Json::string(g.cpu_affinity));
  }
  root.set("gpus", gs);
  Json ls = Json::array();
  for (int a = 0; a < num_gpus(); ++a) {
    for (int b = a + 1; b < num_gpus(); ++b) {
      const Link& l = link(a, b);
      Json& j = ls.push(Json::object());
      j.set("a", Json::number(a));
      j.set("b", Json::number(b));
      j.set("class", Json::string(link_class_name(l.cls)));
      if (l.cls == LinkClass::kNVL) {
        j.set("nvlinks", Json::number(l.nvlinks));
        j.set("nvswitch", Json::boolean(l.nvswitch));
      }
      if (l.p2p != P2P::kUnknown) j.set("p2p", Json::string(p2p_name(l.p2p)));
    }
  }
  root.set("links", ls);
  Json ns = Json::array();
  for (const Nic& n : nics) {
    Json& j = ns.push(Json::object());
    j.set("name", Json::string(n.name));
    j.set("host", Json::number(n.host));
    j.set("bus_id", Json::string(n.bus_id));
    j.set("numa_node", Json::number(n.numa_node));
    j.set("speed_gbps", Json::number(n.speed_gbps));
    Json paths = Json::array();
    for (LinkClass c : n.gpu_paths) paths.push(Json::string(link_class_name(c)));
    j.set("gpu_paths", paths);
    if (!n.transport.empty()) j.set("transport", Json::string(n.transport));  // absent: unknown, as before it existed
  }
  root.set("nics", ns);
  Json notes_j = Json::array();
  for (const std::string& s : notes) notes_j.push(Json::string(s));
  root.set("notes", notes_j);
  return root.dump(2) + "\n";
}

namespace {
int get_int(const Json& o, const char* key, int dflt, const std::string& where) {
  const Json* v = o.get(key);
  return v == nullptr ? dflt : static_cast<int>(v->as_int(where + "." + key));
}
std::string get_str(const Json& o, const char* key, const std::string& where) {
  const Json* v = o.get(key);
  return v == nullptr ? std::string() : v->as_string(where + "." + key);
}
}  // namespace

Topology Topology::from_json(const std::string& text) {
  const Json root = Json::parse(text, "topology JSON");
  GPUCOLL_CHECK_ARG(root.kind() == Json::Kind::kObject, "topology JSON: expected an object at the top level");
  const std::string fmt = get_str(root, "format", "topology");
  GPUCOLL_CHECK_ARG(fmt.empty() || fmt == "gpucoll-topology", "topology JSON: format is '", fmt,
                    "', expected 'gpucoll-topology'");
  const int version = get_int(root, "version", kJsonVersion, "topology");
  GPUCOLL_CHECK_ARG(version == kJsonVersion, "topology JSON: version ", version, " is not supported (this gpucoll "
                    "reads version ", kJsonVersion, ")");
  Topology t;
  t.source = get_str(root, "source", "topology");
  if (const Json* hs = root.get("hosts")) {
    for (const Json& h : hs->as_array("hosts")) {
      const std::string vendor = get_str(h, "cpu_vendor", "hosts[]");
      GPUCOLL_CHECK_ARG(vendor.empty() || vendor == "intel" || vendor == "amd" || vendor == "arm",
                        "topology JSON: hosts[].cpu_vendor '", vendor, "' is not one of intel, amd, arm");
      t.hosts.push_back(Host{get_str(h, "name", "hosts[]"), vendor});
    }
  }
  const auto& gs = root.at("gpus", "topology").as_array("gpus");
  for (size_t i = 0; i < gs.size(); ++i) {
    const std::string w = "gpus[" + std::to_string(i) + "]";
    const Json& j = gs[i];
    Gpu g;
    g.index = get_int(j, "index", static_cast<int>(i), w);
    g.host = get_int(j, "host", 0, w);
    g.name = get_str(j, "name", w);
    g.bus_id = get_str(j, "bus_id", w);
    g.numa_node = get_int(j, "numa_node", -1, w);
    if (const Json* cc = j.get("compute_capability")) {
      const auto& v = cc->as_array(w + ".compute_capability");
      GPUCOLL_CHECK_ARG(v.size() == 2, w, ".compute_capability: expected [major, minor]");
      g.cc_major = static_cast<int>(v[0].as_int(w + ".compute_capability[0]"));
      g.cc_minor = static_cast<int>(v[1].as_int(w + ".compute_capability[1]"));
    }
    g.nvlink_gen = get_int(j, "nvlink_gen", 0, w);
    g.pcie_gen = get_int(j, "pcie_gen", 0, w);
    g.pcie_width = get_int(j, "pcie_width", 0, w);
    g.cpu_affinity = get_str(j, "cpu_affinity", w);
    t.gpus.push_back(g);
  }
  if (t.hosts.empty() && !t.gpus.empty()) t.hosts.push_back(Host{"localhost", ""});
  for (const Gpu& g : t.gpus) {
    GPUCOLL_CHECK_ARG(g.host >= 0 && g.host < static_cast<int>(t.hosts.size()), "topology JSON: GPU ", g.index,
                      " names host ", g.host, " but there are ", t.hosts.size(), " hosts");
  }
  t.reset_links();
  if (const Json* ls = root.get("links")) {
    const auto& arr = ls->as_array("links");
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string w = "links[" + std::to_string(i) + "]";
      const Json& j = arr[i];
      const int a = static_cast<int>(j.at("a", w).as_int(w + ".a"));
      const int b = static_cast<int>(j.at("b", w).as_int(w + ".b"));
      GPUCOLL_CHECK_ARG(a >= 0 && b >= 0 && a < t.num_gpus() && b < t.num_gpus() && a != b, w, ": GPUs (", a, ", ",
                        b, ") out of range for ", t.num_gpus(), " GPUs");
      Link l;
      int n = 0;
      const std::string& cls = j.at("class", w).as_string(w + ".class");
      GPUCOLL_CHECK_ARG(parse_link_class(cls, &l.cls, &n), w, ".class: unknown link class '", cls,
                        "' (expected NVL, PIX, PXB, PHB, NODE, SYS or NET)");
      l.nvlinks = get_int(j, "nvlinks", n, w);
      if (const Json* s = j.get("nvswitch")) l.nvswitch = s->as_bool(w + ".nvswitch");
      const std::string p = get_str(j, "p2p", w);
      GPUCOLL_CHECK_ARG(p.empty() || parse_p2p(p, &l.p2p), w, ".p2p: '", p,
                        "' is not one of unknown, supported, unsupported, failed");
      t.link(a, b) = l;
    }
  }
  if (const Json* ns = root.get("nics")) {
    const auto& arr = ns->as_array("nics");
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string w = "nics[" + std::to_string(i) + "]";
      const Json& j = arr[i];
      Nic n;
      n.name = get_str(j, "name", w);
      n.host = get_int(j, "host", 0, w);
      n.bus_id = get_str(j, "bus_id", w);
      n.numa_node = get_int(j, "numa_node", -1, w);
      if (const Json* s = j.get("speed_gbps")) n.speed_gbps = s->as_number(w + ".speed_gbps");
      if (const Json* tr = j.get("transport")) {
        n.transport = tr->as_string(w + ".transport");
        GPUCOLL_CHECK_ARG(valid_net_transport(n.transport), w, ".transport must be ib, efa, tcp or empty; got '",
                          n.transport, "'");
      }
      if (const Json* ps = j.get("gpu_paths")) {
        for (const Json& p : ps->as_array(w + ".gpu_paths")) {
          LinkClass c;
          const std::string& s = p.as_string(w + ".gpu_paths[]");
          GPUCOLL_CHECK_ARG(parse_link_class(s, &c, nullptr), w, ".gpu_paths: unknown link class '", s, "'");
          n.gpu_paths.push_back(c);
        }
      }
      t.nics.push_back(n);
    }
  }
  if (const Json* ns = root.get("notes")) {
    for (const Json& n : ns->as_array("notes")) t.notes.push_back(n.as_string("notes[]"));
  }
  validate(t);
  return t;
}

void validate(const Topology& t) {
  const int nh = static_cast<int>(t.hosts.size());
  std::map<int, std::set<int>> seen;
  for (int i = 0; i < t.num_gpus(); ++i) {
    const Gpu& g = t.gpus[i];
    GPUCOLL_CHECK_ARG(g.host >= 0 && g.host < nh, "topology: GPU ", i, " is on host ", g.host, " of ", nh);
    GPUCOLL_CHECK_ARG(seen[g.host].insert(g.index).second, "topology: host ", g.host, " lists GPU index ", g.index,
                      " twice");
    if (i > 0) {
      GPUCOLL_CHECK_ARG(t.gpus[i - 1].host <= g.host, "topology: GPUs must be listed host by host");
    }
  }
  for (int a = 0; a < t.num_gpus(); ++a) {
    for (int b = a + 1; b < t.num_gpus(); ++b) {
      const Link& l = t.link(a, b);
      const bool same_host = t.gpus[a].host == t.gpus[b].host;
      GPUCOLL_CHECK_ARG(same_host == (l.cls != LinkClass::kNET), "topology: GPUs ", a, " and ", b,
                        same_host ? " share a host but their link is NET" : " are on different hosts but linked by ",
                        same_host ? "" : link_class_name(l.cls));
      GPUCOLL_CHECK_ARG(l.cls != LinkClass::kSelf, "topology: GPUs ", a, " and ", b, " are different GPUs, not X");
      GPUCOLL_CHECK_ARG(l.cls != LinkClass::kNVL || l.nvlinks >= 1, "topology: GPUs ", a, " and ", b,
                        " are linked by NVLink with ", l.nvlinks, " links");
    }
  }
  for (const Nic& n : t.nics) {
    GPUCOLL_CHECK_ARG(n.host >= 0 && n.host < nh, "topology: NIC ", n.name, " is on host ", n.host, " of ", nh);
  }
}

bool known_gpu(const std::string& name, KnownGpu* out) {
  // Longest names first where one is a prefix of another (H200 before H20, A100 before A10). Datasheet facts:
  // compute capability, host PCIe generation, NVLink generation of the SXM/bridge parts (0: no NVLink).
  struct Row { const char* key; KnownGpu g; };
  static const Row rows[] = {
      {"GB200", {10, 0, 6, 5, false}}, {"B200", {10, 0, 6, 5, false}}, {"B100", {10, 0, 6, 5, false}},
      {"GH200", {9, 0, 5, 4, false}},  {"H200", {9, 0, 5, 4, false}},  {"H100", {9, 0, 5, 4, false}},
      {"H800", {9, 0, 5, 4, false}},   {"H20", {9, 0, 5, 4, false}},   {"A100", {8, 0, 4, 3, false}},
      {"A800", {8, 0, 4, 3, false}},   {"A30", {8, 0, 4, 3, false}},   {"A40", {8, 6, 4, 3, false}},
      {"A10", {8, 6, 4, 0, false}},    {"L40S", {8, 9, 4, 0, false}},  {"L40", {8, 9, 4, 0, false}},   {"L4", {8, 9, 4, 0, false}},
      {"V100", {7, 0, 3, 2, false}},   {"T4", {7, 5, 3, 0, false}},    {"P100", {6, 0, 3, 1, false}},
      {"RTX 5090", {12, 0, 5, 0, true}}, {"RTX 4090", {8, 9, 4, 0, true}}, {"RTX 3090", {8, 6, 4, 3, true}},
      {"RTX 2080", {7, 5, 3, 2, true}},
  };
  KnownGpu g;
  std::string up;
  for (char c : name) up += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  g.geforce = up.find("GEFORCE") != std::string::npos;
  for (const Row& r : rows) {
    const size_t at = up.find(r.key);
    // A whole word: "H20" must not match inside "H200", "A10" not inside "A100".
    const size_t end = at + std::strlen(r.key);
    if (at == std::string::npos || (end < up.size() && std::isalnum(static_cast<unsigned char>(up[end])))) continue;
    const bool geforce = g.geforce || r.g.geforce;
    g = r.g;
    g.geforce = geforce;
    *out = g;
    return true;
  }
  *out = g;
  return false;
}

bool is_geforce(const Gpu& g) {
  KnownGpu k;
  known_gpu(g.name, &k);
  return k.geforce;
}

void set_gpu_model(Topology& t, const std::string& name) {
  KnownGpu k;
  GPUCOLL_CHECK_ARG(known_gpu(name, &k) || k.geforce, "GPU model '", name, "' is not one gpucoll knows (e.g. H100, H800, A100, "
                    "A800, V100, L40S, RTX 4090; or a name containing GeForce)");
  for (Gpu& g : t.gpus) {
    g.name = name;
    g.cc_major = k.cc_major;
    g.cc_minor = k.cc_minor;
    g.pcie_gen = k.pcie_gen;
    g.nvlink_gen = 0;  // re-derived from the compute capability below
  }
  infer_defaults(t);
}

void infer_defaults(Topology& t) {
  // What the name says fills what the importer could not see (nvidia-smi text carries no names; a JSON or
  // gpucoll-topo --gpu may give one).
  for (Gpu& g : t.gpus) {
    KnownGpu k;
    if (!known_gpu(g.name, &k)) continue;
    if (g.cc_major == 0) g.cc_major = k.cc_major, g.cc_minor = k.cc_minor;
    if (g.pcie_gen == 0) g.pcie_gen = k.pcie_gen;
  }
  // NVLink lane bandwidth differs by generation (links.cc), so an unknown generation is worth a guess. From
  // the compute capability: sm_60 NVLink 1, sm_70 2, sm_80 3, sm_90 4, sm_100 5 (NVIDIA product pages).
  for (int h = 0; h < static_cast<int>(t.hosts.size()); ++h) {
    const std::vector<int> ids = t.host_gpus(h);
    for (int i : ids) {
      Gpu& g = t.gpus[i];
      int total = 0, peers_nvl = 0;
      for (int j : ids) {
        if (j != i && t.link(i, j).cls == LinkClass::kNVL) {
          total += t.link(i, j).nvlinks;
          ++peers_nvl;
        }
      }
      if (g.nvlink_gen != 0 || peers_nvl == 0) continue;
      if (g.cc_major >= 10) g.nvlink_gen = 5;
      else if (g.cc_major == 9) g.nvlink_gen = 4;
      else if (g.cc_major == 8) g.nvlink_gen = 3;
      else if (g.cc_major == 7) g.nvlink_gen = 2;
      else if (g.cc_major == 6) g.nvlink_gen = 1;
      if (g.nvlink_gen != 0) continue;
      // Unknown GPU: the per-GPU link count of the SXM parts (P100 4, V100 6, A100 12, H100 18). Through a
      // switch nvidia-smi shows the full count to every peer, so use the largest single-peer count then.
      int first = -1;
      bool uniform = peers_nvl == static_cast<int>(ids.size()) - 1;
      for (int j : ids) {
        if (j == i || !uniform) continue;
        if (first < 0) first = t.link(i, j).nvlinks;
        uniform = t.link(i, j).nvlinks == first;
      }
      const int per_gpu = uniform && peers_nvl > 1 && first * peers_nvl > 18 ? first : total;
      g.nvlink_gen = per_gpu >= 18 ? 4 : per_gpu >= 12 ? 3 : per_gpu >= 5 ? 2 : 1;
    }
    // NVSwitch: every pair NVLink with the same count c, and c links to each of P-1 peers would need more
    // lanes than any GPU of that generation has (gen 1: 4, gen 2: 6, gen 3: 12, gen 4/5: 18).
    if (ids.size() < 3) continue;
    const int c = t.link(ids[0], ids[1]).nvlinks;
    bool uniform = true;
    for (size_t x = 0; x < ids.size(); ++x) {
      for (size_t y = x + 1; y < ids.size(); ++y) {
        const Link& l = t.link(ids[x], ids[y]);
        uniform = uniform && l.cls == LinkClass::kNVL && l.nvlinks == c;
      }
    }
    const int gen = t.gpus[ids[0]].nvlink_gen;
    const int lanes = gen <= 1 ? 4 : gen == 2 ? 6 : gen == 3 ? 12 : 18;
    if (uniform && c * static_cast<int>(ids.size() - 1) > lanes) {
      for (size_t x = 0; x < ids.size(); ++x) {
        for (size_t y = x + 1; y < ids.size(); ++y) t.link(ids[x], ids[y]).nvswitch = true;
      }
    }
  }
}

Topology merge(const std::vector<Topology>& parts) {
  // Group by host name: ranks on one host each report the GPUs they see (often just their own); the union
  // by bus id (or index when the bus id is unknown) is the host's topology.
  Topology out;
  out.source = "merge";
  std::vector<std::string> order;
  std::map<std::string, std::vector<const Topology*>> by_host;
  for (const Topology& p : parts) {
    for (size_t h = 0; h < p.hosts.size(); ++h) {
      if (!by_host.count(p.hosts[h].name)) order.push_back(p.hosts[h].name);
      by_host[p.hosts[h].name].push_back(&p);
    }
    for (const std::string& n : p.notes) {
      if (std::find(out.notes.begin(), out.notes.end(), n) == out.notes.end()) out.notes.push_back(n);
    }
  }
  struct Src { const Topology* t; int gpu; };
  std::vector<Src> srcs;
  for (size_t h = 0; h < order.size(); ++h) {
    out.hosts.push_back(Host{order[h], ""});
    for (const Topology* p : by_host[order[h]]) {
      for (const Host& ph : p->hosts) {
        if (ph.name == order[h] && out.hosts.back().cpu_vendor.empty()) out.hosts.back().cpu_vendor = ph.cpu_vendor;
      }
    }
    std::map<std::string, size_t> key_to_slot;
    std::vector<Src> host_srcs;
    for (const Topology* p : by_host[order[h]]) {
      int ph = 0;
      while (p->hosts[ph].name != order[h]) ++ph;
      for (int g : p->host_gpus(ph)) {
        const Gpu& gpu = p->gpus[g];
        const std::string key = gpu.bus_id.empty() ? "#" + std::to_string(gpu.index) : gpu.bus_id;
        if (key_to_slot.count(key)) continue;
        key_to_slot[key] = host_srcs.size();
        host_srcs.push_back({p, g});
      }
      for (const Nic& n : p->nics) {
        if (n.host != ph) continue;
        bool dup = false;
        for (const Nic& m : out.nics) dup = dup || (m.host == static_cast<int>(h) && m.name == n.name);
        if (!dup) {
          Nic copy = n;
          copy.host = static_cast<int>(h);
          out.nics.push_back(copy);
        }
      }
    }
    std::sort(host_srcs.begin(), host_srcs.end(), [](const Src& a, const Src& b) {
      return a.t->gpus[a.gpu].index < b.t->gpus[b.gpu].index;
    });
    for (const Src& s : host_srcs) {
      Gpu g = s.t->gpus[s.gpu];
      g.host = static_cast<int>(h);
      out.gpus.push_back(g);
      srcs.push_back(s);
    }
  }
  out.reset_links();
  for (int a = 0; a < out.num_gpus(); ++a) {
    for (int b = a + 1; b < out.num_gpus(); ++b) {
      if (out.gpus[a].host != out.gpus[b].host) continue;
      // A pair is known when one part saw both GPUs; otherwise it stays SYS (the conservative class).
      if (srcs[a].t == srcs[b].t) out.link(a, b) = srcs[a].t->link(srcs[a].gpu, srcs[b].gpu);
    }
  }
  validate(out);
  return out;
}

Topology replicate(const Topology& one, int nodes) {
  GPUCOLL_CHECK_ARG(nodes >= 1, "nodes must be >= 1, got ", nodes);
  GPUCOLL_CHECK_ARG(one.hosts.size() <= 1, "replicate needs a single-host topology, this one has ", one.hosts.size(),
                    " hosts");
  if (nodes == 1) return one;
  std::vector<Topology> parts;
  const std::string base = one.hosts.empty() ? std::string("node") : one.hosts[0].name;
  for (int n = 0; n < nodes; ++n) {
    Topology c = one;
    if (c.hosts.empty()) c.hosts.push_back(Host{});
    c.hosts[0].name = base + "-" + std::to_string(n);
    parts.push_back(std::move(c));
  }
  Topology out = merge(parts);
  out.source = one.source;
  return out;
}

}  // namespace gpucoll::topo
