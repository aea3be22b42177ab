// NCCL's topology XML (NCCL_TOPO_DUMP_FILE output, also accepted by NCCL_TOPO_FILE).
//
// Shape: <system version="1"> holds <cpu numaid=..> elements; under a CPU, <pci busid=.. class=..> elements
// nest as the PCI tree does (NCCL collapses each PCIe switch into one <pci> node holding its devices); a GPU is
// <pci busid=B class="0x030200"><gpu dev=D sm=S><nvlink target=T count=C tclass=K/></gpu></pci>; a NIC is
// <nic><net name=.. speed=<Mb/s>/></nic>, under a <pci> or directly under the <cpu>. Path classes follow
// NCCL's rules on that tree: both devices directly under the same <pci> node: PIX; a common <pci> ancestor
// further up: PXB; only the CPU in common: PHB; different CPUs: SYS (NCCL has no NODE class). NVLink targets
// with tclass 0x068000 are NVSwitches; a GPU target is a direct link.
//
// The XML reader below handles what NCCL writes (elements, attributes in double or single quotes, comments,
// the <?xml?> prolog) and reports malformed input with its line.
#include <algorithm>
#include <cctype>
#include <map>
#include <memory>

#include "core/error.h"
#include "topo/topology.h"

namespace gpucoll::topo {

namespace {

struct Node {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::vector<std::unique_ptr<Node>> children;
  int line = 0;
  std::string attr(const std::string& k) const {
    auto it = attrs.find(k);
    return it == attrs.end() ? std::string() : it->second;
  }
};

class XmlReader {
 public:
  explicit XmlReader(const std::string& s) : s_(s) {}

  std::unique_ptr<Node> parse() {
    auto root = std::make_unique<Node>();
    root->name = "#document";
    std::vector<Node*> stack{root.get()};
    while (true) {
      const size_t lt = s_.find('<', i_);
      if (lt == std::string::npos) {
        if (s_.find_first_not_of(" \t\r\n", i_) != std::string::npos) fail(i_, "text outside any element");
        break;
      }
      if (s_.find_first_not_of(" \t\r\n", i_) < lt) {
        // NCCL writes no text content; tolerate it inside elements, refuse it at the top level.
        if (stack.size() == 1) fail(i_, "text outside any element");
      }
      i_ = lt;
      if (s_.compare(i_, 4, "<!--") == 0) {
        const size_t end = s_.find("-->", i_);
        if (end == std::string::npos) fail(i_, "unterminated comment");
        i_ = end + 3;
        continue;
      }
      if (s_.compare(i_, 2, "<?") == 0 || s_.compare(i_, 2, "<!") == 0) {
        const size_t end = s_.find('>', i_);
        if (end == std::string::npos) fail(i_, "unterminated declaration");
        i_ = end + 1;
        continue;
      }
      if (s_.compare(i_, 2, "</") == 0) {
        const size_t start = i_;
        i_ += 2;
        const std::string name = ident();
        skip_ws();
        if (i_ >= s_.size() || s_[i_] != '>') fail(start, "malformed end tag </" + name);
        ++i_;
        if (stack.size() == 1 || stack.back()->name != name) {
          fail(start, "</" + name + "> does not close " +
                          (stack.size() == 1 ? std::string("any element")
                                             : "<" + stack.back()->name + "> opened on line " +
                                                   std::to_string(stack.back()->line)));
        }
        stack.pop_back();
        continue;
      }
      const size_t start = i_;
      ++i_;
      auto node = std::make_unique<Node>();
      node->line = line_of(start);
      node->name = ident();
      if (node->name.empty()) fail(start, "expected an element name after '<'");
      bool self_closing = false;
      while (true) {
        skip_ws();
        if (i_ >= s_.size()) fail(start, "unterminated tag <" + node->name + " (truncated file?)");
        if (s_[i_] == '>') {
          ++i_;
          break;
        }
        if (s_.compare(i_, 2, "/>") == 0) {
          i_ += 2;
          self_closing = true;
          break;
        }
        const std::string key = ident();
        if (key.empty()) fail(i_, std::string("unexpected '") + s_[i_] + "' in tag <" + node->name + ">");
        skip_ws();
        if (i_ >= s_.size() || s_[i_] != '=') fail(i_, "attribute " + key + " has no value");
        ++i_;
        skip_ws();
        if (i_ >= s_.size() || (s_[i_] != '"' && s_[i_] != '\'')) fail(i_, "attribute " + key + ": expected a quote");
        const char q = s_[i_++];
        const size_t end = s_.find(q, i_);
        if (end == std::string::npos) fail(i_, "unterminated value of attribute " + key);
        node->attrs[key] = s_.substr(i_, end - i_);
        i_ = end + 1;
      }
      Node* raw = node.get();
      stack.back()->children.push_back(std::move(node));
      if (!self_closing) stack.push_back(raw);
    }
    if (stack.size() > 1) {
      fail(s_.size(), "<" + stack.back()->name + "> opened on line " + std::to_string(stack.back()->line) +
                          " is never closed (truncated file?)");
    }
    return root;
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& msg) const {
    GPUCOLL_INVALID_ARG("NCCL topology XML: line ", line_of(pos), ": ", msg);
  }
  int line_of(size_t pos) const {
    return 1 + static_cast<int>(std::count(s_.begin(), s_.begin() + static_cast<long>(std::min(pos, s_.size())), '\n'));
  }
  void skip_ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  std::string ident() {
    const size_t b = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '_' || s_[i_] == '-' ||
                              s_[i_] == ':' || s_[i_] == '.')) {
      ++i_;
    }
    return s_.substr(b, i_ - b);
  }
  const std::string& s_;
  size_t i_ = 0;
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

int to_int(const Node& n, const std::string& key, int dflt) {
  const std::string v = n.attr(key);
  if (v.empty()) return dflt;
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 0);
  GPUCOLL_CHECK_ARG(end != v.c_str() && *end == '\0', "NCCL topology XML: line ", n.line, ": <", n.name, " ", key,
                    "=\"", v, "\">: expected an integer");
  return static_cast<int>(x);
}

struct Place {
  int cpu = -1;
  int numa = -1;
  std::vector<std::string> bridges;  // <pci> ancestors, outermost first, excluding the device's own node
  std::string bus_id;
  int pcie_gen = 0, pcie_width = 0;
};

struct GpuRec {
  Place at;
  int dev = 0, sm = 0, line = 0;
  std::map<std::string, int> direct;  // target bus id -> NVLink count
  int switch_links = 0;
};
struct NicRec {
  Place at;
  std::string name;
  double gbps = 0;
};

int gen_from_speed(const std::string& s) {
  const double gts = std::atof(s.c_str());  // "16.0 GT/s PCIe" -> 16
  return gts >= 60 ? 6 : gts >= 30 ? 5 : gts >= 15 ? 4 : gts >= 7 ? 3 : gts >= 4 ? 2 : gts > 0 ? 1 : 0;
}

void walk(const Node& n, Place at, std::vector<GpuRec>& gpus, std::vector<NicRec>& nics, int& ncpu,
          std::string& vendor) {
  for (const auto& cp : n.children) {
    const Node& c = *cp;
    if (c.name == "cpu") {
      Place p;
      p.cpu = ncpu++;
      // NCCL writes the CPUID vendor string (src/graph/topo.cc kvDictCpuVendor); its P2P rule depends on it.
      const std::string v = c.attr("vendor");
      if (v == "GenuineIntel") vendor = "intel";
      else if (v == "AuthenticAMD") vendor = "amd";
      else if (c.attr("arch") == "arm64") vendor = "arm";
      p.numa = to_int(c, "numaid", -1);
      walk(c, p, gpus, nics, ncpu, vendor);
    } else if (c.name == "pci") {
      GPUCOLL_CHECK_ARG(at.cpu >= 0, "NCCL topology XML: line ", c.line, ": <pci> outside any <cpu>");
      Place p = at;
      if (!at.bus_id.empty()) p.bridges.push_back(at.bus_id);
      p.bus_id = lower(c.attr("busid"));
      GPUCOLL_CHECK_ARG(!p.bus_id.empty(), "NCCL topology XML: line ", c.line, ": <pci> without busid");
      p.pcie_gen = gen_from_speed(c.attr("link_speed"));
      p.pcie_width = to_int(c, "link_width", 0);
      walk(c, p, gpus, nics, ncpu, vendor);
    } else if (c.name == "gpu") {
      GPUCOLL_CHECK_ARG(!at.bus_id.empty(), "NCCL topology XML: line ", c.line, ": <gpu> must sit inside its <pci>");
      GpuRec g;
      g.at = at;
      g.dev = to_int(c, "dev", static_cast<int>(gpus.size()));
      g.sm = to_int(c, "sm", 0);
      g.line = c.line;
      for (const auto& lp : c.children) {
        if (lp->name != "nvlink") continue;
        const int count = to_int(*lp, "count", 1);
        const std::string tclass = lower(lp->attr("tclass"));
        if (tclass == "0x068000") {
          g.switch_links += count;
        } else if (tclass.empty() || tclass.compare(0, 6, "0x0302") == 0 || tclass.compare(0, 6, "0x0300") == 0) {
          g.direct[lower(lp->attr("target"))] += count;
        }  // other targets are CPUs (POWER9 NVLink): not a GPU pair
      }
      gpus.push_back(g);
    } else if (c.name == "nic") {
      // Like a GPU, a NIC's own <pci> node (at.bus_id) is the device; its bridges are the nodes above.
      const Place p = at;
      for (const auto& np : c.children) {
        if (np->name != "net") continue;
        NicRec r;
        r.at = p;
        r.name = np->attr("name");
        r.gbps = to_int(*np, "speed", 0) / 1000.0;  // NCCL writes Mb/s
        nics.push_back(r);
      }
    } else if (c.name == "system" || c.name == "#document") {
      walk(c, at, gpus, nics, ncpu, vendor);
    }
    // Other elements (nvs, c2c, ...) of newer NCCL versions carry nothing we use.
  }
}

// Class of the PCI path between two devices, from their bridge chains (see the top of the file).
// A device's chain is the bridges above it; its own <pci> node is the device, not a bridge.
LinkClass pci_class(const Place& a, const Place& b) {
  if (a.cpu != b.cpu) return LinkClass::kSYS;
  const std::vector<std::string>& ca = a.bridges;
  const std::vector<std::string>& cb = b.bridges;
  size_t k = 0;
  while (k < ca.size() && k < cb.size() && ca[k] == cb[k]) ++k;
  if (k == 0) return LinkClass::kPHB;
  return (ca.size() == k && cb.size() == k) ? LinkClass::kPIX : LinkClass::kPXB;
}

}  // namespace

Topology from_nccl_xml(const std::string& text) {
  GPUCOLL_CHECK_ARG(text.find_first_not_of(" \t\r\n") != std::string::npos, "NCCL topology XML: line 1: empty input");
  XmlReader reader(text);
  const std::unique_ptr<Node> doc = reader.parse();
  const Node* system = nullptr;
  for (const auto& c : doc->children) {
    if (c->name == "system") system = c.get();
  }
  GPUCOLL_CHECK_ARG(system != nullptr, "NCCL topology XML: line 1: no <system> element (is this an "
                    "NCCL_TOPO_DUMP_FILE?)");
  std::vector<GpuRec> gpus;
  std::vector<NicRec> nics;
  int ncpu = 0;
  std::string vendor;
  walk(*system, Place{}, gpus, nics, ncpu, vendor);
  std::stable_sort(gpus.begin(), gpus.end(), [](const GpuRec& a, const GpuRec& b) { return a.dev < b.dev; });

  Topology t;
  t.source = "nccl-xml";
  t.hosts.push_back(Host{"localhost", vendor});
  for (size_t i = 0; i < gpus.size(); ++i) {
    const GpuRec& r = gpus[i];
    if (i > 0) {
      GPUCOLL_CHECK_ARG(r.dev != gpus[i - 1].dev, "NCCL topology XML: line ", r.line, ": a second <gpu dev=\"", r.dev,
                        "\"> (first on line ", gpus[i - 1].line, ")");
    }
    Gpu g;
    g.index = static_cast<int>(i);
    g.bus_id = r.at.bus_id;
    g.numa_node = r.at.numa;
    g.cc_major = r.sm / 10;
    g.cc_minor = r.sm % 10;
    g.pcie_gen = r.at.pcie_gen;
    g.pcie_width = r.at.pcie_width;
    t.gpus.push_back(g);
  }
  t.reset_links();
  for (size_t a = 0; a < gpus.size(); ++a) {
    for (size_t b = a + 1; b < gpus.size(); ++b) {
      Link l;
      auto da = gpus[a].direct.find(gpus[b].at.bus_id);
      auto db = gpus[b].direct.find(gpus[a].at.bus_id);
      const int direct = std::max(da == gpus[a].direct.end() ? 0 : da->second,
                                  db == gpus[b].direct.end() ? 0 : db->second);
      if (direct > 0) {
        l.cls = LinkClass::kNVL;
        l.nvlinks = direct;
      } else if (gpus[a].switch_links > 0 && gpus[b].switch_links > 0) {
        l.cls = LinkClass::kNVL;
        l.nvlinks = std::min(gpus[a].switch_links, gpus[b].switch_links);
        l.nvswitch = true;
      } else {
        l.cls = pci_class(gpus[a].at, gpus[b].at);
      }
      t.link(static_cast<int>(a), static_cast<int>(b)) = l;
    }
  }
  for (const NicRec& r : nics) {
    Nic n;
    n.name = r.name;
    n.bus_id = r.at.bus_id;
    n.numa_node = r.at.numa;
    n.speed_gbps = r.gbps;
    for (const GpuRec& g : gpus) n.gpu_paths.push_back(pci_class(g.at, r.at));
    t.nics.push_back(n);
  }
  infer_defaults(t);
  validate(t);
  return t;
}

}  // namespace gpucoll::topo
