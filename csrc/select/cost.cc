#include "select/cost.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <tuple>

#include "algo/checker.h"
#include "algo/registry.h"
#include "select/selector.h"
#include "core/error.h"
#include "topo/links.h"
#include "select/nccl_model.h"

namespace gpucoll::topo {

namespace {

// ---- Our kernels and the host backend: shipped defaults (each with its source) ----------------------------------
// Our P2P kernels (issue 5) have not been measured on a GPU yet: assume 0.6 of the link (vLLM's custom
// allreduce loses to NCCL above ~8 MB on A100/H100, which is why its default max size is 8 MB). Estimate;
// gpucoll-tune replaces it with a fit of gpucoll-bench --backend custom runs.
constexpr double kCustomEff = 0.6;
// Our kernels: one launch (~4 us with the flag setup) and a flag handshake per step, ~1.5 us over NVLink and
// ~3 us over PCIe (one round trip of a 4-byte write and poll). Estimates until measured.
constexpr double kCustomLaunch = 4e-6;
double custom_step_lat(LinkClass c) { return c == LinkClass::kNVL ? 1.5e-6 : 3e-6; }
const char* const kCustomConfidence = "estimate: gpucoll's kernels have not been measured on a GPU yet";

struct Counts {
  bool ok = false;
  std::string error;
  int steps = 0;
  double per_byte = 0;  // the busiest rank's bytes (max of read and read-from) per message byte
};

// Why schedule `name` cannot serve (coll, nranks, local), without running it ("" where it can): what counts()
// reports before its checker, for callers that have other reasons to give up first.
std::string inapplicable(const std::string& name, algo::Coll coll, int nranks, int local) {
  const algo::Algorithm* a = algo::find_algorithm(name);
  if (a == nullptr) return "no schedule named " + name;
  if (!a->supports(coll)) return std::string(name) + " does not implement " + algo::coll_name(coll);
  const char* why = a->unusable(algo::Params{coll, nranks, 0, local});
  return why != nullptr ? why : "";
}

// The schedule's steps and busiest-rank bytes, from running it through the checker (cached). That run's cost grows
// steeply with the rank count (minutes at 256 ranks), so candidates ask for it only once nothing else rules them out.
const Counts& counts(const std::string& name, algo::Coll coll, int nranks, int local) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, int>, Counts> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(name, static_cast<int>(coll), nranks, local);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Counts c;
  const algo::Algorithm* a = algo::find_algorithm(name);
  const algo::Params p{coll, nranks, 0, local};
  if (a == nullptr) {
    c.error = "no schedule named " + name;
  } else if (!a->supports(coll)) {
    c.error = std::string(name) + " does not implement " + algo::coll_name(coll);
  } else if (const char* why = a->unusable(p)) {
    c.error = why;
  } else {
    const algo::Shape shape = a->shape(p);
    const int64_t unit = static_cast<int64_t>(std::max(shape.nchunks, 1)) * nranks * 4096;
    const algo::CheckResult r = algo::check_schedule(*a, p, unit);
    if (!r.ok) {
      c.error = "schedule failed the checker: " + r.error;
    } else {
      c.ok = true;
      c.steps = r.nsteps;
      // The busiest rank's link carries what it reads and, for rooted patterns (scatter, broadcast by pull),
      // what its peers read from it: the larger of the two bounds the time.
      c.per_byte = static_cast<double>(std::max(r.max_bytes_recv(), r.max_bytes_sent())) /
                        static_cast<double>(unit);
    }
  }
  return cache.emplace(key, c).first->second;
}

int dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {
      {"float32", 4}, {"float", 4}, {"float16", 2}, {"half", 2}, {"bfloat16", 2}, {"float64", 8}, {"double", 8},
      {"int8", 1},    {"uint8", 1}, {"int32", 4},   {"uint32", 4}, {"int64", 8},  {"uint64", 8},  {"float8_e4m3", 1},
      {"float8_e4m3fn", 1}, {"float8_e5m2", 1}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

double busbw_factor(algo::Coll coll, int n) {
  switch (coll) {
    case algo::Coll::kAllReduce: return 2.0 * (n - 1) / n;
    case algo::Coll::kBroadcast:
    case algo::Coll::kReduce: return 1.0;
    default: return static_cast<double>(n - 1) / n;
  }
}

namespace {

// What NCCL runs for a collective, priced with our schedules' counts: all_reduce, all_gather and reduce_scatter
// are rings (our ring schedule moves what NCCL's ring moves); all_to_all, gather and scatter are grouped
// send/recv (our direct schedule). Broadcast and reduce are a pipelined chain along NCCL's ring, which none of
// our schedules is: every rank receives the message once (bytes S) and the pipeline fills over P-1 hops.
Counts nccl_counts(algo::Coll coll, int nranks, std::string* algorithm) {
  if (coll == algo::Coll::kBroadcast || coll == algo::Coll::kReduce) {
    *algorithm = "ring";
    Counts c;
    c.ok = true;
    c.steps = std::max(nranks - 1, 1);
    c.per_byte = nranks > 1 ? 1.0 : 0.0;
    return c;
  }
  const bool ring = coll == algo::Coll::kAllReduce || coll == algo::Coll::kAllGather ||
                    coll == algo::Coll::kReduceScatter;
  *algorithm = ring ? "ring" : "direct";
  return counts(*algorithm, coll, nranks, nranks);
}

}  // namespace

bool model_terms(const std::string& backend, const std::string& algorithm, algo::Coll coll, int nranks, int local,
                 int* steps, double* bytes_per_byte) {
  // NVLS is priced by bus bandwidth; NCCL's ring/direct by the schedules NCCL's pattern matches (nccl_counts).
  if (backend == "nccl" && algorithm == "nvls") {
    *steps = 2;
    *bytes_per_byte = busbw_factor(coll, nranks);
    return true;
  }
  std::string nccl_algo;
  const Counts c = backend == "nccl" && algorithm != "hierarchical" ? nccl_counts(coll, nranks, &nccl_algo)
                                                                    : counts(algorithm, coll, nranks,
                                                                             local > 0 ? local : nranks);
  if (!c.ok || (!nccl_algo.empty() && nccl_algo != algorithm)) return false;
  *steps = c.steps;
  *bytes_per_byte = c.per_byte;
  return true;
}

namespace {

struct Ctx {
  const Topology& t;
  const Layout& lay;
  algo::Coll coll;
  double S;
  const Tuning& tuning;
  std::vector<int> node0;  // the first node's GPUs (all nodes look alike in a layout)
};

void finish(const Ctx& x, Candidate& c, double launch, double step_lat, double bw) {
  const std::string key = c.backend + ":" + c.algorithm + "@" + c.link_class;
  auto it = x.tuning.fits.find(key);
  if (it != x.tuning.fits.end()) {
    const auto [a, b] = it->second.at(x.S);
    c.seconds = c.steps * a + c.bytes * b;
    c.model = "tuned " + key + " (" + it->second.source + ")";
  } else {
    c.seconds = launch + c.steps * step_lat + (bw > 0 ? c.bytes / bw : 0);
    c.model = "default";
  }
  c.usable = true;
  c.busbw = c.seconds > 0 ? x.S * busbw_factor(x.coll, x.lay.nranks()) / c.seconds : 0;
  if (it != x.tuning.fits.end()) c.confidence = "tuned: " + it->second.source;
}

// Custom P2P kernels on one node: ring needs a ring of P2P hops, the others P2P between every pair.
Candidate custom(const Ctx& x, const std::string& name) {
  Candidate c;
  c.backend = "custom";
  c.algorithm = name;
  c.confidence = kCustomConfidence;
  const int P = x.lay.nranks();
  const std::string no = inapplicable(name, x.coll, P, P);
  if (!no.empty()) return c.reason = no, c;
  if (x.lay.nodes > 1) return c.reason = "P2P kernels work inside one node; this job spans " +
                                         std::to_string(x.lay.nodes) + " nodes", c;
  const Counts k = counts(name, x.coll, P, P);
  if (!k.ok) return c.reason = k.error, c;
  const std::vector<int>& g = x.node0;
  double bw = 0;
  LinkClass cls = LinkClass::kSelf;
  if (name == "ring") {
    const std::vector<int> ring = build_ring(x.t, g, true);
    if (ring.empty()) {
      std::string why;
      for (size_t i = 0; i < g.size() && why.empty(); ++i) {
        for (size_t j = i + 1; j < g.size() && why.empty(); ++j) p2p_usable(x.t, g[i], g[j], &why);
      }
      return c.reason = "no ring of working P2P links (" + why + ")", c;
    }
    bw = 1e300;
    for (size_t i = 0; i < ring.size(); ++i) {
      const int a = ring[i], b = ring[(i + 1) % ring.size()];
      cls = std::max(cls, x.t.link(a, b).cls);
      // Through NVSwitch a ring hop gets the GPU's whole NVLink bandwidth: it is the only peer at that moment.
      bw = std::min(bw, x.t.link(a, b).nvswitch ? gpu_nvlink_bw(x.t, a, g) : pair_bandwidth(x.t, a, b));
    }
  } else {
    std::string why;
    for (size_t i = 0; i < g.size(); ++i) {
      for (size_t j = i + 1; j < g.size(); ++j) {
        if (!p2p_usable(x.t, g[i], g[j], &why)) return c.reason = name + " needs working P2P between every pair: " + why, c;
      }
    }
    // All peers at once: each peer's share over its pair link, and everything through the GPU's ingress
    // (NVLink total, or one PCIe x16 for all peers).
    cls = worst_class(x.t, g);
    double min_pair = 1e300;
    for (int p : g) {
      if (p != g[0]) min_pair = std::min(min_pair, pair_bandwidth(x.t, g[0], p));
    }
    const double ingress = cls == LinkClass::kNVL ? gpu_nvlink_bw(x.t, g[0], g) : pcie_bw(x.t.gpus[g[0]]);
    // One GPU in the node (a one-GPU machine; ranks sharing it): no pair link, the copy is bound by the GPU alone.
    // (g[1] was read regardless: found when the emulated device made detection return one GPU.)
    bw = g.size() < 2 ? ingress : std::min(ingress, x.t.link(g[0], g[1]).nvswitch ? ingress : min_pair * (P - 1));
  }
  c.link_class = link_class_name(cls);
  c.steps = k.steps;
  c.bytes = k.per_byte * x.S;
  finish(x, c, kCustomLaunch, custom_step_lat(cls), bw * kCustomEff);
  return c;
}

// Two levels: ring reduce-scatter/all-gather inside each node (our P2P kernels), ring all_reduce between nodes on
// 1/L of the data per rank (hierarchical.h). Phase steps and bytes follow that header's formulas; their sums are
// checked against the checker's totals. The inter-node phase is priced by the NCCL model as L concurrent rings,
// one per GPU and rail (one rank per node each, 1/L of the data), as NCCL itself would run them.
Candidate hierarchical(const Ctx& x, bool custom_ok) {
  Candidate c;
  c.algorithm = "hierarchical";
  c.backend = "custom+nccl";
  c.confidence = kCustomConfidence;
  const int P = x.lay.nranks(), L = x.lay.local, N = x.lay.nodes;
  const std::string no = inapplicable("hierarchical", x.coll, P, L);
  if (!no.empty()) return c.reason = no, c;
  if (N < 2) return c.reason = "a single node: nothing to split (the flat algorithms are the same schedule)", c;
  const int intra_steps = 2 * (L - 1), inter_steps = 2 * (N - 1);
  // Our kernels take the intra-node phases only when the custom backend can and every node has P2P between all
  // its ranks' GPUs; otherwise NCCL runs the whole call (its own trees are two-level across nodes).
  std::string why = custom_ok ? "" : "the custom backend cannot run the intra-node phases";
  for (int n = 0; n < N && why.empty(); ++n) {
    for (int i = 0; i < L && why.empty(); ++i) {
      for (int j = i + 1; j < L && why.empty(); ++j) {
        p2p_usable(x.t, x.lay.gpus[static_cast<size_t>(n * L + i)], x.lay.gpus[static_cast<size_t>(n * L + j)], &why);
      }
    }
  }
  if (!why.empty()) return c.reason = why + "; NCCL's own algorithms are two-level across nodes", c;
  const Counts k = counts("hierarchical", x.coll, P, L);
  if (!k.ok) return c.reason = k.error, c;
  GPUCOLL_INTERNAL_CHECK(intra_steps + inter_steps == k.steps);
  c.link_class = "NET";
  c.steps = k.steps;
  c.bytes = k.per_byte * x.S;
  finish(x, c, kCustomLaunch, 0, 0);
  if (c.model == "default") {
    const LinkClass intra_cls = worst_class(x.t, x.node0);
    double intra_bw = 1e300;
    for (int g : x.node0) intra_bw = std::min(intra_bw, intra_cls == LinkClass::kNVL ? gpu_nvlink_bw(x.t, g, x.node0)
                                                                                    : pcie_bw(x.t.gpus[g]));
    std::vector<int> rail;
    for (int n = 0; n < N; ++n) rail.push_back(x.lay.gpus[static_cast<size_t>(n * L)]);
    const Layout inter = make_layout(x.t, N, 1, rail);
    double inter_s = 0;
    const int64_t esize = 4;
    const double share = std::ceil(x.S / L / esize) * esize;
    for (const Candidate& n : nccl_candidates(x.t, inter, algo::Coll::kAllReduce, share, "float32", 0, x.tuning)) {
      if (n.nccl_auto) inter_s = n.seconds;
    }
    c.seconds += intra_steps * custom_step_lat(intra_cls) + 2.0 * (L - 1) / L * x.S / (intra_bw * kCustomEff) + inter_s;
    c.model = "custom kernels (estimate) + NCCL model for the inter-node rings";
    c.busbw = x.S * busbw_factor(x.coll, P) / c.seconds;
  }
  return c;
}

Candidate host(const Ctx& x, const std::string& only) {
  Candidate c;
  c.backend = "host";
  c.algorithm = only;
  c.link_class = "SHM";
  c.confidence = "estimate: host cost model measured on CPUs, the PCIe copies estimated";
  const int P = x.lay.nranks();
  if (x.lay.nodes > 1) return c.reason = "the host backend is shared memory on one node", c;
  const algo::CostParams cp = algo::host_cost_params();
  double best = -1;
  std::string why;
  for (const algo::Algorithm* a : algo::algorithms()) {
    if (!only.empty() && only != a->name) continue;
    algo::Prediction p = algo::predict(*a, x.coll, P, static_cast<int64_t>(x.S), P, cp);
    // A gpucoll-tune fit of this schedule on the host backend ("host:ring@SHM") replaces the host model's a, b.
    const auto fit = x.tuning.fits.find(std::string("host:") + a->name + "@SHM");
    const Counts k = counts(a->name, x.coll, P, P);
    if (p.usable && fit != x.tuning.fits.end() && k.ok) {
      const auto [fa, fb] = fit->second.at(x.S);
      p.seconds = k.steps * fa + k.per_byte * x.S * fb;
    }
    if (!p.usable) why = p.reason;
    if (p.usable && (best < 0 || p.seconds < best)) {
      best = p.seconds;
      c.algorithm = a->name;
      c.steps = p.steps;
      c.bytes = static_cast<double>(p.bytes_recv);
    }
  }
  if (best < 0) {
    c.reason = only.empty() ? "no host algorithm serves this collective"
               : why.empty() ? "the host backend has no schedule named " + only : why;
    return c;
  }
  // GPU buffers are copied to host memory and back over each GPU's PCIe link: 0.8 of the PCIe rate for a
  // pageable cudaMemcpy and ~5 us per copy call. Estimates; the host backend has not run on GPU buffers yet.
  const double pcie = x.node0.empty() ? 1e15 : pcie_bw(x.t.gpus[static_cast<size_t>(x.node0[0])]) * 0.8;
  c.seconds = best + 2 * x.S / pcie + 2 * 5e-6;
  c.usable = true;
  const auto fit = x.tuning.fits.find("host:" + c.algorithm + "@SHM");
  c.model = (fit != x.tuning.fits.end() ? "tuned host:" + c.algorithm + "@SHM (" + fit->second.source + ")"
                                        : std::string("host cost model (select/selector.h)")) +
            " + 2 PCIe copies";
  c.busbw = x.S * busbw_factor(x.coll, P) / c.seconds;
  return c;
}

}  // namespace

std::vector<Candidate> candidates(const Topology& t, const Layout& lay, algo::Coll coll, int64_t nbytes,
                                  const std::string& dtype, const Backends& avail, const Tuning& tuning,
                                  const std::string& host_algorithm) {
  const int esize = dtype_size(lower(dtype));
  GPUCOLL_CHECK_ARG(esize > 0, "unknown dtype '", dtype, "' (expected e.g. float32, bfloat16, float16, int32)");
  GPUCOLL_CHECK_ARG(nbytes >= 0 && nbytes % esize == 0, "nbytes=", nbytes, " is not a whole number of ", dtype,
                    " elements");
  GPUCOLL_CHECK_ARG(lay.nranks() >= 1 && static_cast<int>(lay.gpus.size()) == lay.nranks(), "bad layout");
  Ctx x{t, lay, coll, static_cast<double>(nbytes), tuning, {}};
  x.node0.assign(lay.gpus.begin(), lay.gpus.begin() + lay.local);
  auto implemented = [&](const std::string& name) {
    const auto& v = avail.custom_algorithms;
    const std::string scoped = std::string(algo::coll_name(coll)) + ":" + name;
    return v.empty() || std::find(v.begin(), v.end(), name) != v.end() ||
           std::find(v.begin(), v.end(), scoped) != v.end();
  };
  std::vector<Candidate> out;
  auto add = [&](Candidate c, bool available, const std::string& why, const char* what) {
    if (!available && c.usable) {
      c.usable = false;
      c.reason = why.empty() ? std::string(what) + " backend not available" : why;
    }
    out.push_back(c);
  };
  for (const char* name : {"oneshot", "twoshot", "ring", "tree"}) {
    Candidate c = custom(x, name);
    if (avail.custom && c.usable && !implemented(name)) {
      c.usable = false;
      c.reason = std::string("the custom backend does not implement ") + name + " for " + algo::coll_name(coll) + " yet";
    }
    add(c, avail.custom, avail.custom_why, "custom");
  }
  for (Candidate& c : nccl_candidates(t, lay, coll, x.S, lower(dtype), avail.nccl_version, tuning)) {
    // A gpucoll-tune fit of NCCL runs replaces the model's time. gpucoll-bench runs NCCL as auto, so a fit such as
    // "nccl:ring@NVL" is NCCL's own choice, measured, and priced with the ring's step and byte counts: it also
    // prices the candidate NCCL's tuner picks where that is not the ring (NVLS from 16 MiB on an 8-GPU H100 box),
    // the one auto compares. Keyed by the ring alone, a calibration left those sizes at the default model on the
    // machines where they matter most.
    auto fit = tuning.fits.find(c.backend + ":" + c.algorithm + "@" + c.link_class);
    std::string pattern = c.algorithm;
    if (fit == tuning.fits.end() && c.nccl_auto) {
      fit = tuning.fits.find("nccl:ring@" + c.link_class);
      pattern = "ring";
    }
    if (c.usable && fit != tuning.fits.end()) {
      int steps = 0;
      double per_byte = 0;
      if (model_terms("nccl", pattern, coll, lay.nranks(), lay.local, &steps, &per_byte)) {
        const auto [a, b] = fit->second.at(x.S);
        c.seconds = steps * a + per_byte * x.S * b;
        c.model = "tuned " + fit->first + " (" + fit->second.source + ")";
        // Measured on this machine: what is left is run-to-run noise and the fit's own misfit, not extrapolation.
        c.spread = std::log(1.1);
        c.spread_why = "a gpucoll-tune fit of this machine: +-10%";
      }
    }
    if (c.usable) c.busbw = c.seconds > 0 ? x.S * busbw_factor(coll, lay.nranks()) / c.seconds : 0;
    add(c, avail.nccl, avail.nccl_why, "nccl");
  }
  if (coll == algo::Coll::kAllReduce) {
    add(hierarchical(x, avail.custom && implemented("hierarchical")), avail.nccl, avail.nccl_why, "nccl");
  }
  add(host(x, lower(host_algorithm)), avail.host, avail.host_why, "host");
  if (lay.nranks() == 1) {
    for (Candidate& c : out) c.busbw = 0;
  }
  return out;
}

}  // namespace gpucoll::topo
