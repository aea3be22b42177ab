// Topology-aware cost model: which backend and algorithm serve a collective fastest on a given wiring.
//
// Our kernels are priced as  launch + steps * a(class) + bytes / bw(class): steps and the busiest rank's bytes come
// from the schedule checker (algo/checker.h, the one source of truth for traffic), a and bw from the link class
// the pattern crosses (links.h). NCCL is priced by a model of NCCL itself (nccl_model.h): its tuner's pick among
// ring/tree/NVLS x LL/LL128/Simple and an execution model fitted to published nccl-tests results. A tuning file
// (GPUCOLL_TUNING_FILE, written by gpucoll-tune from gpucoll-bench results) replaces a and b per (backend,
// algorithm, link class) and the NCCL model's parameters by name. The host backend's own selection for CPU
// buffers (select/selector.h) is not changed by any of this.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "algo/schedule.h"
#include "topo/topology.h"

namespace gpucoll::topo {

// Which ranks sit on which GPUs: rank r runs on node r / local, GPU gpus[r] (a global Topology index).
struct Layout {
  int nodes = 1;
  int local = 1;
  std::vector<int> gpus;
  int nranks() const { return nodes * local; }
};
// nranks_per_node 0: every GPU of a host; nodes 0: every host of the topology (a single-host topology with
// nodes > 1 is replicated, see replicate()). Throws InvalidArgument when the topology has too few GPUs.
Layout make_layout(const Topology& t, int nranks_per_node, int nodes);
// A communicator's own placement: rank r on GPU gpus[r]; node n's ranks (n*local .. n*local+local-1) must sit
// on one host, different nodes on different hosts. A GPU may appear more than once (ranks sharing a GPU).
// Throws InvalidArgument naming the first rank that breaks a rule.
Layout make_layout(const Topology& t, int nodes, int local, const std::vector<int>& gpus);

struct Backends {
  bool custom = true;  // gpucoll's P2P kernels
  bool nccl = true;
  bool host = true;    // staging GPU buffers through host memory and the shared-memory host backend
  // Why a backend is not available, shown as the candidate's reason (default: "<backend> backend not available").
  std::string custom_why, nccl_why, host_why;
  // What the custom backend implements: "oneshot" (every collective) or "all_reduce:oneshot" (one); names are
  // oneshot, twoshot, ring, tree and hierarchical (it can run the intra-node phases of the two-level
  // all_reduce). Empty: everything the model prices.
  std::vector<std::string> custom_algorithms;
  // The NCCL the ranks load, as ncclGetVersion says (22105 for 2.21.5); its P2P rule changed in 2.23 (links.h).
  // 0: unknown, NCCL >= 2.23's rules.
  int nccl_version = 0;
};

// One fitted line of a tuning file: time = steps * a + bytes * b.
struct Fit {
  double a_s = 0;
  double b_s_per_byte = 0;
  std::string source;
  // Size ranges with a line of their own ("pieces" in the file, by ascending from_bytes): one straight line
  // rarely holds from 4 KiB to 256 MiB (NCCL switches protocol, a CPU's caches overflow), so gpucoll-tune splits
  // a series whose line misses by more than its bar. a_s/b_s_per_byte above hold below the first piece.
  struct Piece {
    double from_bytes = 0;
    double a_s = 0;
    double b_s_per_byte = 0;
  };
  std::vector<Piece> pieces;
  // The (a_s, b_s_per_byte) that hold for a call of nbytes (the message size, as the selector is asked).
  std::pair<double, double> at(double nbytes) const {
    std::pair<double, double> ab{a_s, b_s_per_byte};
    for (const Piece& p : pieces) {
      if (nbytes >= p.from_bytes) ab = {p.a_s, p.b_s_per_byte};
    }
    return ab;
  }
};
// What the published data says about one kind of NCCL path (nccl_interval.h): how far leave-one-system-out
// predictions of that kind missed, and the inputs its systems span.
struct NcclEvidence {
  std::string kind;          // nccl_interval.h's path kinds: nvswitch, nvlink, pcie_p2p, shm, net
  int systems = 0, sources = 0;
  double half_width = 0;     // log(published / predicted) that 90% of left-out points stay within
  std::vector<int> ccs;      // compute capabilities (80, 90) of its systems
  int min_local = 0, max_local = 0, max_nodes = 0;
  double min_bytes = 0, max_bytes = 0;
};
struct Tuning {
  std::map<std::string, Fit> fits;  // key "backend:algorithm@CLASS", e.g. "custom:ring@NVL"
  // The NCCL execution model's parameters by name (nccl_model.h NcclParams), e.g. "net_latency_s", "eta_net".
  std::map<std::string, double> nccl_model;
  // Replaces the shipped evidence (nccl_evidence.inc) when the file has "nccl_evidence"; bench/published uses
  // it to score intervals built without the system they predict.
  std::vector<NcclEvidence> nccl_evidence;
  bool has_nccl_evidence = false;
  std::string path;
};
Tuning parse_tuning(const std::string& json_text, const std::string& what);
// GPUCOLL_TUNING_FILE's contents (read once per path), or no fits.
const Tuning& active_tuning();

struct Candidate {
  std::string backend;     // custom, nccl, host, custom+nccl
  std::string algorithm;   // oneshot, twoshot, ring, tree, nvls, direct, hierarchical, or the host algorithm
  std::string protocol;    // NCCL's LL/LL128/Simple, else ""
  std::string link_class;  // class of the slowest hop: NVL, PIX, PXB, PHB, NODE, SYS, NET, SHM
  bool usable = false;
  std::string reason;      // why not, when !usable
  int steps = 0;
  double bytes = 0;        // per rank, busiest rank, whole message (bandwidth term)
  double seconds = 0;
  double busbw = 0;        // bytes/s, nccl-tests' definition
  std::string model;       // "default" or the tuning-file entry used
  // NCCL candidates: NCCL's own estimate (its tuner ranks by it) and whether its tuner picks this one - NCCL,
  // not gpucoll, chooses its algorithm, so only that one competes in auto selection.
  double tuner_seconds = 0;
  bool nccl_auto = false;
  std::string confidence;  // how sure the model is: "calibrated: ...", "validated: ...", "extrapolated: ..."
  // The interval around the prediction (NCCL candidates): the truth is expected within seconds * e^(+-spread),
  // busbw alike; 0 when the model gives none. spread_why says what widened it.
  double spread = 0;
  std::string spread_why;
};

// Every candidate for the call, usable or not (with reasons), in a fixed order. The host candidate is the host
// cost model's fastest schedule, or `host_algorithm` when given.
std::vector<Candidate> candidates(const Topology& t, const Layout& lay, algo::Coll coll, int64_t nbytes,
                                  const std::string& dtype, const Backends& avail, const Tuning& tuning,
                                  const std::string& host_algorithm = "");

// The fastest usable candidate. `requested` ("auto", "oneshot", "nccl", "nccl:ring", "custom:ring", "host",
// ...) and, when it is auto, GPUCOLL_ALGO win over the model; an impossible request throws InvalidArgument
// saying why.
Candidate select(const Topology& t, const Layout& lay, algo::Coll coll, int64_t nbytes, const std::string& dtype,
                 const Backends& avail, const std::string& requested, const Tuning& tuning);

// One-direction bandwidth between two GPUs of one host in bytes/s (raw link rate, before efficiency; links.cc).
double pair_bandwidth(const Topology& t, int a, int b);
// Whether P2P kernels may use the pair: NVLink, PIX or PXB (NCCL's default P2P level), not refused or failed,
// and not a GeForce board's PCIe path whose P2P status is unknown (the driver disables it).
bool p2p_usable(const Topology& t, int a, int b, std::string* why);
// The ring gpucoll would build over `gpus`: the cycle with the largest bottleneck bandwidth (exhaustive up to 10
// GPUs, else in index order); only P2P-usable hops when require_p2p (empty when no such cycle exists).
std::vector<int> build_ring(const Topology& t, const std::vector<int>& gpus, bool require_p2p);

// nccl-tests' bus bandwidth factor.
double busbw_factor(algo::Coll coll, int nranks);

// Model terms for calibration (gpucoll-tune): steps and bytes per message byte of (backend, algorithm).
bool model_terms(const std::string& backend, const std::string& algorithm, algo::Coll coll, int nranks,
                 int local, int* steps, double* bytes_per_byte);

}  // namespace gpucoll::topo
