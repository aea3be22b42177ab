// What NCCL would do for a collective on a given wiring, and how long it would take.
//
// Two parts, kept apart on purpose. The *pick* is NCCL's own tuner (src/graph/tuning.cc, NCCL 2.21.5): every
// algorithm x protocol (ring, tree, NVLS, NVLS-tree x LL, LL128, Simple) gets NCCL's latency and bandwidth from
// its tables and from an approximation of its graph search (links.h), and NCCL runs the one its formula
// lat + bytes/bw says is fastest. The *time* of each candidate is a separate execution model in the same
// terms - NCCL's latency, its bandwidth scaled by what the protocol and transport really achieve, plus the
// pipeline steps its chunking makes per channel (src/enqueue.cc) - whose efficiencies were fitted to published
// nccl-tests results (tests/fixtures/published/nccl_allreduce.json, calibration points only).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "algo/schedule.h"
#include "select/cost.h"
#include "topo/topology.h"

namespace gpucoll::topo {

// The execution model's constants (nccl_model.cc says where each default comes from). A tuning file's
// "nccl_model" object overrides any of them by name; gpucoll-tune writes net_latency_s and eta_net there.
struct NcclParams {
  double t0_s;           // per call: launch and the benchmark's host loop
  double eta_simple;     // achieved / NCCL's bandwidth, Simple protocol over NVLink or PCIe P2P
  double eta_ll128;      // ... LL128
  double eta_ll;         // ... LL
  double step_simple_s;  // per pipeline step and channel, Simple protocol (flag handshake not hidden)
  double eta_nvls;       // NVLS bus bandwidth / the GPU's NVLink bandwidth in NCCL's units
  double step_nvls_s;    // per NVLS pipeline step
  double shm_host_bw;    // bytes/s: what the host lets each GPU stage through it (SHM), written and read at once
  double eta_net;        // achieved / NIC line rate
  double eta_nvls_tree;  // NVLS-tree's intra-node part / single-node NVLS
  double net_latency_s;  // added per inter-node step (NCCL's own table is in the latency already)
  double eta_efa;        // what EFA reaches / what verbs reach on the same line rate (Nic::transport "efa")
};
NcclParams nccl_params(const Tuning& tuning);
std::vector<std::string> nccl_param_names();
std::vector<std::pair<std::string, double>> nccl_param_values(const Tuning& tuning);

// Every NCCL candidate for the call (usable or not, with reasons). The one NCCL's tuner picks has nccl_auto set;
// every candidate's `seconds` is the execution model's time, `tuner_seconds` NCCL's own estimate.
std::vector<Candidate> nccl_candidates(const Topology& t, const Layout& lay, algo::Coll coll, double nbytes,
                                       const std::string& dtype, int nccl_version, const Tuning& tuning);

// The path the layout's NCCL calls take, as the intervals' evidence is kept (nccl_interval.h).
struct NcclPath;
NcclPath nccl_path(const Topology& t, const Layout& lay);

// How sure the execution model is on this layout: "calibrated", "validated" or "extrapolated", with the class
// of system and why (what makes it a class the published data did or did not cover).
std::string nccl_confidence(const Topology& t, const Layout& lay);

// For fitting the network (gpucoll-tune): the time of NCCL's pick for this call written as
//   seconds = base_s + net_steps * net_latency_s + net_s / eta_net
// with the current parameters for everything else. False when the call does not cross the network or the pick
// is not network-bound (then every term but base_s is 0).
struct NetTerms {
  std::string algorithm, protocol;
  double base_s = 0, net_steps = 0, net_s = 0;
};
NetTerms nccl_net_terms(const Topology& t, const Layout& lay, algo::Coll coll, double nbytes, const std::string& dtype,
                        int nccl_version, const Tuning& tuning);

}  // namespace gpucoll::topo
