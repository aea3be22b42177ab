// Choosing among the cost model's candidates (cost.cc): layouts, rings, tuning files and the request rules.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>

#include "select/selector.h"
#include "core/config.h"
#include "core/error.h"
#include "select/cost.h"
#include "topo/json.h"
#include "select/nccl_model.h"

namespace gpucoll::topo {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::vector<int> build_ring(const Topology& t, const std::vector<int>& gpus, bool require_p2p) {
  const int n = static_cast<int>(gpus.size());
  auto ok = [&](int a, int b) { return !require_p2p || p2p_usable(t, a, b, nullptr); };
  if (n == 2 && !ok(gpus[0], gpus[1])) return {};
  if (n <= 2) return gpus;
  auto bw = [&](int a, int b) { return t.link(a, b).cls == LinkClass::kNET ? 1.0 : pair_bandwidth(t, a, b); };
  if (n > 10) {
    for (int i = 0; i < n; ++i) {
      if (!ok(gpus[i], gpus[(i + 1) % n])) return {};
    }
    return gpus;
  }
  // Exhaustive search with pruning: maximise the bottleneck, then the sum (more lanes used).
  std::vector<int> best, cur{gpus[0]};
  std::vector<bool> used(static_cast<size_t>(n), false);
  used[0] = true;
  double best_min = -1, best_sum = -1;
  std::function<void(double, double)> dfs = [&](double mn, double sum) {
    if (mn < best_min) return;
    if (static_cast<int>(cur.size()) == n) {
      if (!ok(cur.back(), cur[0])) return;
      const double b = bw(cur.back(), cur[0]);
      const double m = std::min(mn, b), s = sum + b;
      if (m > best_min || (m == best_min && s > best_sum)) best_min = m, best_sum = s, best = cur;
      return;
    }
    for (int i = 1; i < n; ++i) {
      if (used[i] || !ok(cur.back(), gpus[i])) continue;
      const double b = bw(cur.back(), gpus[i]);
      used[i] = true;
      cur.push_back(gpus[i]);
      dfs(std::min(mn, b), sum + b);
      cur.pop_back();
      used[i] = false;
    }
  };
  dfs(1e300, 0);
  return best;
}

Layout make_layout(const Topology& t, int per_node, int nodes) {
  Layout l;
  const int hosts = std::max<int>(1, static_cast<int>(t.hosts.size()));
  l.nodes = nodes > 0 ? nodes : hosts;
  GPUCOLL_CHECK_ARG(l.nodes <= hosts, "the topology has ", hosts, " host(s), ", l.nodes,
                    " nodes requested (replicate a single-host topology with --nodes)");
  int min_gpus = 1 << 30;
  for (int h = 0; h < l.nodes; ++h) min_gpus = std::min<int>(min_gpus, static_cast<int>(t.host_gpus(h).size()));
  l.local = per_node > 0 ? per_node : min_gpus;
  GPUCOLL_CHECK_ARG(l.local >= 1 && l.local <= min_gpus, "ranks per node must be in [1, ", min_gpus,
                    "] for this topology, got ", l.local);
  for (int h = 0; h < l.nodes; ++h) {
    const std::vector<int> ids = t.host_gpus(h);
    l.gpus.insert(l.gpus.end(), ids.begin(), ids.begin() + l.local);
  }
  return l;
}

Layout make_layout(const Topology& t, int nodes, int local, const std::vector<int>& gpus) {
  GPUCOLL_CHECK_ARG(nodes >= 1 && local >= 1, "layout: nodes and ranks per node must be >= 1, got ", nodes, " and ",
                    local);
  GPUCOLL_CHECK_ARG(static_cast<int64_t>(gpus.size()) == static_cast<int64_t>(nodes) * local, "layout: ", nodes,
                    " node(s) x ", local, " ranks need ", nodes * local, " GPU indices, got ", gpus.size());
  std::set<int> hosts;
  for (int n = 0; n < nodes; ++n) {
    int host = -1;
    for (int i = 0; i < local; ++i) {
      const int r = n * local + i, g = gpus[static_cast<size_t>(r)];
      GPUCOLL_CHECK_ARG(g >= 0 && g < t.num_gpus(), "layout: rank ", r, " is on GPU ", g, " but the topology has ",
                        t.num_gpus(), " GPUs");
      if (i == 0) host = t.gpus[static_cast<size_t>(g)].host;
      GPUCOLL_CHECK_ARG(t.gpus[static_cast<size_t>(g)].host == host, "layout: rank ", r, " (node ", n,
                        ") is on host ", t.gpus[static_cast<size_t>(g)].host, ", rank ", n * local, " of its node on host ",
                        host);
    }
    GPUCOLL_CHECK_ARG(hosts.insert(host).second, "layout: node ", n, " is on host ", host,
                      " like an earlier node; each node is one host");
  }
  Layout l;
  l.nodes = nodes;
  l.local = local;
  l.gpus = gpus;
  return l;
}

Tuning parse_tuning(const std::string& text, const std::string& what) {
  const Json root = Json::parse(text, what);
  Tuning t;
  t.path = what;
  const Json* fits_p = root.get("fits");
  GPUCOLL_CHECK_ARG(fits_p != nullptr || root.get("nccl_model") != nullptr || root.get("nccl_evidence") != nullptr,
                    what, ": expected \"fits\", \"nccl_model\" or \"nccl_evidence\"");
  static const Json kNoFits = Json::object();
  const Json& fits = fits_p != nullptr ? *fits_p : kNoFits;
  for (const auto& kv : fits.items()) {
    const std::string w = what + ": fits." + kv.first;
    Fit f;
    f.a_s = kv.second.at("a_s", w).as_number(w + ".a_s");
    f.b_s_per_byte = kv.second.at("b_s_per_byte", w).as_number(w + ".b_s_per_byte");
    GPUCOLL_CHECK_ARG(f.a_s >= 0 && f.b_s_per_byte > 0, w, ": a_s must be >= 0 and b_s_per_byte > 0");
    const Json* src = kv.second.get("source");
    f.source = src ? src->as_string(w + ".source") : what;
    if (const Json* pieces = kv.second.get("pieces")) {
      for (const Json& j : pieces->as_array(w + ".pieces")) {
        const std::string wp = w + ".pieces[" + std::to_string(f.pieces.size()) + "]";
        Fit::Piece pc;
        pc.from_bytes = j.at("from_bytes", wp).as_number(wp + ".from_bytes");
        pc.a_s = j.at("a_s", wp).as_number(wp + ".a_s");
        pc.b_s_per_byte = j.at("b_s_per_byte", wp).as_number(wp + ".b_s_per_byte");
        GPUCOLL_CHECK_ARG(pc.a_s >= 0 && pc.b_s_per_byte > 0, wp, ": a_s must be >= 0 and b_s_per_byte > 0");
        GPUCOLL_CHECK_ARG(f.pieces.empty() || pc.from_bytes > f.pieces.back().from_bytes, wp,
                          ": pieces must come by ascending from_bytes");
        f.pieces.push_back(pc);
      }
    }
    t.fits[kv.first] = f;
  }
  // The NCCL execution model's parameters by name (nccl_model.h), e.g. {"net_latency_s": 9e-5, "eta_net": 0.8}.
  if (const Json* m = root.get("nccl_model")) {
    const std::vector<std::string> names = nccl_param_names();
    for (const auto& kv : m->items()) {
      const std::string w = what + ": nccl_model." + kv.first;
      GPUCOLL_CHECK_ARG(std::find(names.begin(), names.end(), kv.first) != names.end(), w,
                        ": not a parameter of the NCCL model");
      const double v = kv.second.as_number(w);
      GPUCOLL_CHECK_ARG(v >= 0 && std::isfinite(v), w, ": must be a finite number >= 0");
      t.nccl_model[kv.first] = v;
    }
  }
  // Evidence for the NCCL model's intervals (cost.h NcclEvidence), one object per path kind.
  if (const Json* ev = root.get("nccl_evidence")) {
    t.has_nccl_evidence = true;
    for (const Json& j : ev->as_array(what + ": nccl_evidence")) {
      const std::string w = what + ": nccl_evidence[" + std::to_string(t.nccl_evidence.size()) + "]";
      NcclEvidence e;
      e.kind = j.at("kind", w).as_string(w + ".kind");
      e.systems = static_cast<int>(j.at("systems", w).as_int(w + ".systems"));
      e.sources = static_cast<int>(j.at("sources", w).as_int(w + ".sources"));
      e.half_width = j.at("half_width", w).as_number(w + ".half_width");
      for (const Json& c : j.at("ccs", w).as_array(w + ".ccs")) e.ccs.push_back(static_cast<int>(c.as_int(w + ".ccs")));
      e.min_local = static_cast<int>(j.at("min_local", w).as_int(w + ".min_local"));
      e.max_local = static_cast<int>(j.at("max_local", w).as_int(w + ".max_local"));
      e.max_nodes = static_cast<int>(j.at("max_nodes", w).as_int(w + ".max_nodes"));
      e.min_bytes = j.at("min_bytes", w).as_number(w + ".min_bytes");
      e.max_bytes = j.at("max_bytes", w).as_number(w + ".max_bytes");
      GPUCOLL_CHECK_ARG(e.half_width >= 0 && std::isfinite(e.half_width), w, ": half_width must be finite, >= 0");
      t.nccl_evidence.push_back(e);
    }
  }
  return t;
}

const Tuning& active_tuning() {
  static std::mutex mu;
  static std::map<std::string, Tuning> cache;
  std::lock_guard<std::mutex> lock(mu);
  const std::string path = config_raw("GPUCOLL_TUNING_FILE");
  auto it = cache.find(path);
  if (it != cache.end()) return it->second;
  Tuning t;
  if (!path.empty()) {
    std::ifstream f(path);
    if (!f) GPUCOLL_INVALID_ARG("GPUCOLL_TUNING_FILE=", path, ": cannot open the file");
    std::stringstream ss;
    ss << f.rdbuf();
    t = parse_tuning(ss.str(), "GPUCOLL_TUNING_FILE=" + path);
  }
  return cache.emplace(path, t).first->second;
}

Candidate select(const Topology& t, const Layout& lay, algo::Coll coll, int64_t nbytes, const std::string& dtype,
                 const Backends& avail, const std::string& requested, const Tuning& tuning) {
  std::string req = lower(requested);
  std::string source = "algo";
  if (req.empty() || req == "auto") {
    req = algo::algo_override(coll);
    source = "GPUCOLL_ALGO";
  }
  // "backend:algorithm", "backend" or "algorithm". A bare algorithm name means the GPU backends' (custom, NCCL):
  // the host backend picks among its own schedules, so "host" or "host:ring" name it.
  const bool any = req.empty() || req == "auto";
  const size_t colon = req.find(':');
  const std::string want_b = colon == std::string::npos ? "" : req.substr(0, colon);
  const std::string want_a = colon == std::string::npos ? req : req.substr(colon + 1);
  const std::string host_algorithm = want_b == "host" ? want_a : "";
  const std::vector<Candidate> all = candidates(t, lay, coll, nbytes, dtype, avail, tuning, host_algorithm);
  // NCCL chooses its own algorithm and protocol: among the NCCL candidates a request admits, only the one NCCL's
  // tuner ranks first runs (NCCL_ALGO narrows NCCL's choice the same way), so it alone competes on time.
  auto matches = [&](const Candidate& c) {
    if (any) return true;
    return colon != std::string::npos ? (c.backend == want_b && c.algorithm == want_a)
                                       : (c.backend == want_a || (c.backend != "host" && c.algorithm == want_a));
  };
  const Candidate* nccl_pick = nullptr;
  for (const Candidate& c : all) {
    if (c.backend == "nccl" && c.usable && matches(c) &&
        (nccl_pick == nullptr || c.tuner_seconds < nccl_pick->tuner_seconds)) {
      nccl_pick = &c;
    }
  }
  const Candidate* best = nullptr;
  std::string reasons, names;
  for (const Candidate& c : all) {
    const std::string full = c.backend + ":" + c.algorithm;
    if (names.find(full) == std::string::npos) names += (names.empty() ? "" : ", ") + full;
    if (!matches(c)) continue;
    if (!c.usable) {
      const std::string r = full + (c.protocol.empty() || any ? "" : "/" + c.protocol) + ": " + c.reason;
      if (reasons.find(r) == std::string::npos) reasons += (reasons.empty() ? "" : "; ") + r;
    } else if ((c.backend != "nccl" || &c == nccl_pick) && (best == nullptr || c.seconds < best->seconds)) {
      best = &c;
    }
  }
  if (best != nullptr) return *best;
  if (any) GPUCOLL_INVALID_ARG("no backend can run ", algo::coll_name(coll), " on this topology: ", reasons);
  if (reasons.empty()) {
    GPUCOLL_INVALID_ARG(source, "='", req, "' names no backend or algorithm for ", algo::coll_name(coll),
                        "; candidates: auto, ", names);
  }
  GPUCOLL_INVALID_ARG(source, "='", req, "' cannot run ", algo::coll_name(coll), " on ", lay.nranks(),
                      " ranks of this topology: ", reasons);
}

}  // namespace gpucoll::topo
