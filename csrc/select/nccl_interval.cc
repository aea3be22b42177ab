// The NCCL model's intervals (nccl_interval.h).
//
// Base width: the 90th percentile of the leave-one-system-out errors of the path kind, each system weighted as
// one. Inputs outside what the kind's systems span widen it, one term per input, added (the misses compound):
// an architecture none of them had, a ranks-per-node count outside their range, more nodes. Message size is
// judged against every kind's published sizes, not the kind's own: what makes time depend on size (latency,
// pipeline steps, protocol switches) is shared by all paths, so a 4 GiB-only kind borrows the others' curves.
// The terms' sizes are chosen so that, built without the left-out system, intervals cover at least 80% of
// left-out points (bench/published/accuracy.py reports coverage and width).
#include "select/nccl_interval.h"

#include <algorithm>
#include <cmath>

namespace gpucoll::topo {

namespace {

const std::vector<NcclEvidence> kShipped = {
#include "select/nccl_evidence.inc"
};

// A kind without any published system: a factor 3 either way. The worst leave-one-kind-out miss before the
// transports were modelled from first principles was 2.8x (no-P2P SHM, issue 34).
constexpr double kUnseen = 1.10;
constexpr double kArch = 0.35;        // an architecture the kind's systems do not include: a factor 1.4
constexpr double kRanks = 0.25;       // ranks per node outside their range
constexpr double kPerDoubling = 0.15;  // per doubling of nodes beyond the range
constexpr double kPerOctave = 0.10;    // per halving of the message below (or doubling above) every published size
// Past 8 octaves below the smallest published size a message is latency-bound: more distance adds nothing.
constexpr double kMaxOctaves = 8;

double octaves_beyond(double v, double lo, double hi) {
  if (lo <= 0 || hi <= 0 || v <= 0) return 0;
  if (v < lo) return std::min(kMaxOctaves, std::log2(lo / v));
  if (v > hi) return std::min(kMaxOctaves, std::log2(v / hi));
  return 0;
}

std::string pct(double log_width) {
  return std::to_string(static_cast<int>(std::lround((std::exp(log_width) - 1) * 100))) + "%";
}

}  // namespace

const std::vector<NcclEvidence>& shipped_nccl_evidence() { return kShipped; }

double nccl_spread(const NcclPath& path, double nbytes, const Tuning& tuning, std::string* why) {
  const std::vector<NcclEvidence>& ev = tuning.has_nccl_evidence ? tuning.nccl_evidence : kShipped;
  const auto it = std::find_if(ev.begin(), ev.end(), [&](const NcclEvidence& e) { return e.kind == path.kind; });
  std::string w;
  if (it == ev.end() || it->systems == 0) {
    if (why) *why = "no published " + path.kind + " system: +-" + pct(kUnseen);
    return kUnseen;
  }
  const NcclEvidence& e = *it;
  double s = e.half_width;
  w = std::to_string(e.systems) + " published " + path.kind + " system" + (e.systems > 1 ? "s" : "") + " (" +
      std::to_string(e.sources) + " source" + (e.sources > 1 ? "s" : "") + "): +-" + pct(s);
  if (std::find(e.ccs.begin(), e.ccs.end(), path.cc) == e.ccs.end()) {
    s += kArch;
    w += "; sm_" + std::to_string(path.cc) + " not among them";
  }
  if (path.local < e.min_local || path.local > e.max_local) {
    s += kRanks;
    w += "; " + std::to_string(path.local) + " ranks per node outside " + std::to_string(e.min_local) + "-" +
         std::to_string(e.max_local);
  }
  if (path.nodes > e.max_nodes) {
    s += kPerDoubling * std::log2(static_cast<double>(path.nodes) / std::max(e.max_nodes, 1));
    w += "; " + std::to_string(path.nodes) + " nodes, published up to " + std::to_string(e.max_nodes);
  }
  double lo = e.min_bytes, hi = e.max_bytes;
  for (const NcclEvidence& o : ev) lo = std::min(lo, o.min_bytes), hi = std::max(hi, o.max_bytes);
  const double oct = octaves_beyond(nbytes, lo, hi);
  if (oct > 0) {
    s += kPerOctave * oct;
    w += "; size outside the published sizes";
  }
  if (why) *why = s > e.half_width ? w + " -> +-" + pct(s) : w;
  return s;
}

}  // namespace gpucoll::topo
