// `nvidia-smi topo -m` text, as people paste it into issues and chats.
//
// The table has one header line of column names (GPU<i>, NIC<i> or - before r450 - NIC device names such as
// mlx5_0, then "CPU Affinity", "NUMA Affinity", "GPU NUMA ID" in some drivers), one row per device, then a
// legend. What varies in the wild and is accepted here: tabs or runs of spaces, ANSI escapes (nvidia-smi
// underlines the header when stdout is a terminal), CRLF line ends, a shell prompt or other text before the
// header, with or without NIC rows/columns and affinity columns, "SOC" (pre-r390 name of SYS), "N/A"
// affinities, and the output of `nvidia-smi topo -p2p r` appended (NVML's P2P status per pair). Anything else
// inside the tables is an InvalidArgument naming the line.
#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>

#include "core/error.h"
#include "topo/topology.h"

namespace gpucoll::topo {

namespace {

std::string strip_ansi(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\x1b') {
      // CSI: ESC [ parameters final-byte (0x40-0x7e). A lone ESC is dropped.
      if (i + 1 < s.size() && s[i + 1] == '[') {
        i += 2;
        while (i < s.size() && !(s[i] >= 0x40 && s[i] <= 0x7e)) ++i;
      }
      continue;
    }
    if (s[i] != '\r') out += s[i];
  }
  return out;
}

std::vector<std::string> tokens(const std::string& line) {
  std::istringstream is(line);
  std::vector<std::string> out;
  std::string t;
  while (is >> t) out.push_back(t);
  return out;
}

bool starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

bool is_gpu_label(const std::string& s) {
  return s.size() > 3 && starts_with(s, "GPU") && std::isdigit(static_cast<unsigned char>(s[3]));
}

int first_int(const std::string& s) {
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) return -1;
  return std::atoi(s.c_str());
}

enum class Extra { kCpuAffinity, kNumaAffinity, kGpuNumaId };

}  // namespace

Topology from_nvidia_smi(const std::string& raw) {
  const std::string text = strip_ansi(raw);
  std::vector<std::string> lines;
  {
    std::istringstream is(text);
    std::string l;
    while (std::getline(is, l)) lines.push_back(l);
  }
  auto where = [](size_t i) { return "nvidia-smi topo -m: line " + std::to_string(i + 1); };

  // Header: the first line with a GPU0 column.
  size_t h = 0;
  std::vector<std::string> head;
  for (; h < lines.size(); ++h) {
    head = tokens(lines[h]);
    bool found = false;
    for (const std::string& t : head) found = found || t == "GPU0";
    if (found) break;
  }
  GPUCOLL_CHECK_ARG(h < lines.size(), "nvidia-smi topo -m: ",
                    lines.empty() || text.find_first_not_of(" \t\n") == std::string::npos ? "empty input"
                                                                                               : "no header line",
                    ": expected a line of column names starting with GPU0 (paste the whole output of "
                    "`nvidia-smi topo -m`)");
  std::vector<std::string> cols;  // device columns in order
  std::vector<Extra> extras;
  for (size_t k = 0; k < head.size(); ++k) {
    const std::string& t = head[k];
    auto next_is = [&](size_t off, const char* w) { return k + off < head.size() && head[k + off] == w; };
    if (t == "CPU" && next_is(1, "Affinity")) {
      extras.push_back(Extra::kCpuAffinity);
      k += 1;
    } else if (t == "NUMA" && next_is(1, "Affinity")) {
      extras.push_back(Extra::kNumaAffinity);
      k += 1;
    } else if (t == "GPU" && next_is(1, "NUMA") && next_is(2, "ID")) {
      extras.push_back(Extra::kGpuNumaId);
      k += 2;
    } else {
      GPUCOLL_CHECK_ARG(extras.empty(), where(h), ": unexpected column '", t, "' after the affinity columns");
      cols.push_back(t);
    }
  }
  std::map<std::string, int> col_index;
  std::vector<int> gpu_cols, nic_cols;
  for (size_t c = 0; c < cols.size(); ++c) {
    GPUCOLL_CHECK_ARG(col_index.emplace(cols[c], static_cast<int>(c)).second, where(h), ": column '", cols[c],
                      "' appears twice");
    (is_gpu_label(cols[c]) ? gpu_cols : nic_cols).push_back(static_cast<int>(c));
  }
  const int ng = static_cast<int>(gpu_cols.size());
  for (int g = 0; g < ng; ++g) {
    GPUCOLL_CHECK_ARG(cols[gpu_cols[g]] == "GPU" + std::to_string(g), where(h), ": GPU columns must be GPU0..GPU",
                      ng - 1, " in order; column ", gpu_cols[g] + 1, " is '", cols[gpu_cols[g]], "'");
  }

  // Rows until the legend (or the end). cell[r][c] holds the token and its line.
  std::vector<std::vector<std::string>> cell(cols.size());
  std::vector<size_t> row_line(cols.size(), 0);
  std::vector<bool> have(cols.size(), false);
  std::vector<std::string> nic_legend;
  Topology t;
  t.source = "nvidia-smi";
  t.hosts.push_back(Host{"localhost", ""});
  for (int g = 0; g < ng; ++g) {
    Gpu gpu;
    gpu.index = g;
    t.gpus.push_back(gpu);
  }
  size_t i = h + 1;
  for (; i < lines.size(); ++i) {
    const std::vector<std::string> tk = tokens(lines[i]);
    if (tk.empty()) continue;
    if (tk[0] == "Legend:" || (tk[0] == "NIC" && tk.size() > 1 && tk[1] == "Legend:")) break;
    if (tk[0] == "GPU0" && std::all_of(tk.begin(), tk.end(), is_gpu_label)) break;  // a -p2p table's header
    auto it = col_index.find(tk[0]);
    GPUCOLL_CHECK_ARG(it != col_index.end(), where(i), ": row '", tk[0],
                      "' is not one of the header's columns (line ", h + 1, ")");
    const int r = it->second;
    GPUCOLL_CHECK_ARG(!have[r], where(i), ": a second row for ", tk[0], " (first on line ", row_line[r] + 1, ")");
    GPUCOLL_CHECK_ARG(tk.size() >= cols.size() + 1, where(i), ": row ", tk[0], " has ", tk.size() - 1,
                      " link cells, expected ", cols.size(), " (truncated table?)");
    have[r] = true;
    row_line[r] = i;
    cell[r].assign(tk.begin() + 1, tk.begin() + 1 + static_cast<long>(cols.size()));
    for (size_t c = 0; c < cols.size(); ++c) {
      const std::string& v = cell[r][c];
      LinkClass cls;
      GPUCOLL_CHECK_ARG(parse_link_class(v, &cls, nullptr) && cls != LinkClass::kNET, where(i), ": unknown link '",
                        v, "' in column ", cols[c], " (expected X, NV<n>, PIX, PXB, PHB, NODE, SYS or SOC)");
      GPUCOLL_CHECK_ARG((cls == LinkClass::kSelf) == (static_cast<int>(c) == r), where(i), ": '", v, "' in column ",
                        cols[c], (static_cast<int>(c) == r ? " should be X (the device itself)" : " but X means self"));
    }
    if (is_gpu_label(tk[0])) {
      // Affinity cells: "0-47,96-143" or "N/A"; missing ones are allowed (nvidia-smi leaves them blank).
      Gpu& gpu = t.gpus[r < ng ? r : 0];
      for (size_t e = 0; e < extras.size() && cols.size() + 1 + e < tk.size(); ++e) {
        const std::string& v = tk[cols.size() + 1 + e];
        if (extras[e] == Extra::kCpuAffinity) gpu.cpu_affinity = v == "N/A" ? "" : v;
        if (extras[e] == Extra::kNumaAffinity && gpu.numa_node < 0) gpu.numa_node = first_int(v);
      }
    }
  }
  const size_t end_line = i;
  for (; i < lines.size(); ++i) {
    // NIC legend: "  NIC0: mlx5_0".
    const std::vector<std::string> tk = tokens(lines[i]);
    if (tk.size() == 2 && tk[0].size() > 4 && starts_with(tk[0], "NIC") && tk[0].back() == ':') {
      const std::string label = tk[0].substr(0, tk[0].size() - 1);
      auto it = col_index.find(label);
      if (it != col_index.end()) cols[it->second] = label + "=" + tk[1];
    }
  }
  for (int g = 0; g < ng; ++g) {
    GPUCOLL_CHECK_ARG(have[gpu_cols[g]], "nvidia-smi topo -m: line ", end_line + 1,
                      (end_line >= lines.size() ? " (end of input)" : ""), ": the header (line ", h + 1,
                      ") lists GPU", g, " but the table has no row for it (truncated table?)");
  }
  t.reset_links();
  for (int a = 0; a < ng; ++a) {
    for (int b = a + 1; b < ng; ++b) {
      const std::string& ab = cell[gpu_cols[a]][gpu_cols[b]];
      const std::string& ba = cell[gpu_cols[b]][gpu_cols[a]];
      Link l;
      parse_link_class(ab, &l.cls, &l.nvlinks);
      Link r;
      parse_link_class(ba, &r.cls, &r.nvlinks);
      GPUCOLL_CHECK_ARG(l == r, where(row_line[gpu_cols[b]]), ": GPU", b, " -> GPU", a, " is ", ba, " but GPU", a,
                        " -> GPU", b, " is ", ab, " (line ", row_line[gpu_cols[a]] + 1, "); the matrix must be "
                        "symmetric");
      t.link(a, b) = l;
    }
  }
  // `nvidia-smi topo -p2p r` (or w, n, a, p) pasted after the table: NVML's P2P status per pair, which is how a
  // GeForce board's disabled PCIe P2P shows (NS). OK is supported; NS, CNS, GNS, TNS (not supported by the
  // GPU, chipset or topology) unsupported; U unknown. A pair is supported only when both directions say OK.
  for (size_t j = end_line; j < lines.size(); ++j) {
    const std::vector<std::string> hd = tokens(lines[j]);
    if (hd.empty() || hd[0] != "GPU0" || !std::all_of(hd.begin(), hd.end(), is_gpu_label)) continue;
    GPUCOLL_CHECK_ARG(static_cast<int>(hd.size()) == ng, where(j), ": the P2P table lists ", hd.size(),
                      " GPUs, the topology table ", ng);
    for (size_t k = j + 1; k < lines.size(); ++k) {
      const std::vector<std::string> tk = tokens(lines[k]);
      if (tk.empty()) continue;
      if (!is_gpu_label(tk[0])) break;
      const int a = std::atoi(tk[0].c_str() + 3);
      GPUCOLL_CHECK_ARG(a < ng && static_cast<int>(tk.size()) == ng + 1, where(k), ": P2P row ", tk[0], " has ",
                        tk.size() - 1, " cells, expected ", ng);
      for (int b = 0; b < ng; ++b) {
        const std::string& v = tk[static_cast<size_t>(b) + 1];
        if (a == b) continue;
        P2P p;
        if (v == "OK") p = P2P::kSupported;
        else if (v == "NS" || v == "CNS" || v == "GNS" || v == "TNS") p = P2P::kUnsupported;
        else if (v == "U") p = P2P::kUnknown;
        else GPUCOLL_INVALID_ARG(where(k), ": P2P status '", v, "' (expected OK, NS, CNS, GNS, TNS or U)");
        Link& l = t.link(a, b);
        if (p == P2P::kUnsupported || l.p2p == P2P::kUnknown) l.p2p = p;
      }
    }
    break;
  }
  for (int c : nic_cols) {
    Nic n;
    const size_t eq = cols[c].find('=');
    n.name = eq == std::string::npos ? cols[c] : cols[c].substr(eq + 1);
    for (int g = 0; g < ng; ++g) {
      LinkClass cls;
      parse_link_class(cell[gpu_cols[g]][c], &cls, nullptr);
      n.gpu_paths.push_back(cls);
    }
    t.nics.push_back(n);
  }
  infer_defaults(t);
  validate(t);
  return t;
}

}  // namespace gpucoll::topo
