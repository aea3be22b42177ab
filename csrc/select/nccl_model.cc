// NCCL's tuner and an execution model in its terms (nccl_model.h). Constants from NCCL carry their file and
// version; the execution model's efficiencies carry the fit that produced them.
#include "select/nccl_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "algo/registry.h"
#include "core/error.h"
#include "select/nccl_interval.h"
#include "topo/links.h"

namespace gpucoll::topo {

namespace {

enum Algo { kTree = 0, kRing = 1, kNvls = 2, kNvlsTree = 3, kNumAlgos = 4 };
enum Proto { kLL = 0, kLL128 = 1, kSimple = 2, kNumProtos = 3 };
enum Hw { kHwNvl = 0, kHwPci = 1, kHwNet = 2 };
const char* const kAlgoNames[] = {"tree", "ring", "nvls", "nvls_tree"};
const char* const kProtoNames[] = {"LL", "LL128", "Simple"};

// ---- NCCL 2.21.5, src/graph/tuning.cc (microseconds, GB/s) -------------------------------------------------------
constexpr double kBaseLat[kNumAlgos][kNumProtos] = {{6.8, 14.0, 0}, {6.6, 14.0, 8.4}, {0, 0, 0}, {0, 0, 0}};
constexpr double kHwLat[3][kNumAlgos][kNumProtos] = {
    /* NVLink */ {{.6, 1.25, 28}, {.6, 1.9, 3.4}, {0, 0, 25}, {0, 0, 25}},
    /* PCI    */ {{1.0, 1.9, 28}, {1.0, 2.5, 5.7}, {0, 0, 0}, {0, 0, 0}},
    /* NET    */ {{5.0, 8.5, 28}, {2.7, 4.0, 14.0}, {0, 0, 18}, {0, 0, 14}}};
// [Volta, Ampere, Hopper][1 node, 2 nodes, more]; LL's row is indexed by GPU on one node, by CPU (Intel 0, AMD
// 1) across nodes. Blackwell uses Hopper's rows (2.21.5 predates it).
constexpr double kLLMaxBw[3][3] = {{39.0, 39.0, 20.4}, {87.7, 22.5, 19.0}, {141.0, 45.0, 35.0}};
constexpr double kPerChMaxRingLL128Bw[3][3] = {{20, 20, 20}, {20, 20, 20}, {36.7, 36.7, 36.7}};
constexpr double kPerChMaxTreeLL128Bw[3][3] = {{20, 20, 20}, {20, 20, 20}, {36.7, 36.7, 29.0}};
constexpr double kPerChMaxTreeBw[3][3] = {{26.5, 18.5, 10.0}, {24.0, 23.6, 17.8}, {38.7, 41.4, 36.0}};
// Powers of two from 64 B: NCCL's own correction of its tree model at medium sizes (ncclTopoGetAlgoTime).
constexpr double kTreeCorrection[kNumProtos][23] = {
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9}};
// Buffer sizes per protocol / NCCL_STEPS (8) = step sizes (src/include/device.h, 2.21.5): Simple 4 MiB / 8 with
// 4 steps per ring chunk (ALLREDUCE_CHUNKSTEPS); LL 512 KiB / 8, half of it data; LL128 120 x 640 x 8 x 8 B / 8,
// 120 of 128 B data. NVLS chunks 128 KiB (NCCL_NVLS_CHUNKSIZE), NVLS_NCHANNELS 16 (src/transport/nvls.cc).
constexpr double kSimpleStep = 512 * 1024, kLLChunk = 32 * 1024, kLL128Chunk = 614400.0 * 120 / 128;
constexpr int kRingChunkSteps = 4, kNvlsChannels = 16, kMaxChannels = 32;

// ---- The execution model's defaults --------------------------------------------------------------------------
// Fitted by bench/published/fit_nccl_model.py (least squares on the log error, from the previous defaults) to the
// 30 "calibrate" points of tests/fixtures/published/nccl_allreduce.json: Azure ND H100 v5 (NVLS, NCCL 2.18.5),
// every other size of Azure ND A100 v4 (NCCL 2.18.5) and of 2x RTX 2080 Ti without P2P, and NVIDIA/nccl#1221
// (2 and 4 nodes x 8 H100, 8x 400G RoCE, NCCL 2.19.3). What they mean: NCCL's NVLink/PCIe units are what Simple
// achieves (0.99); LL128 reaches 0.6 and LL 0.71 of what NCCL's tuner credits them with; NVLS moves 1.47x the
// GPU's NVLink rate in bus bandwidth (the switch reduces); the host stages 4.1 GB/s per GPU through its memory
// (SHM, shm_host_cap: the no-P2P pair's 4 GB/s, below its 6 GB/s share of the PCIe path); NICs 0.94 of line
// rate; each Simple pipeline step costs 2.4 us and each NVLS step 8 us beyond its bytes; nccl-tests' per-call
// overhead is 6.3 us.
constexpr NcclParams kDefaults = {
    /*t0_s*/ 6.35e-6, /*eta_simple*/ 0.991, /*eta_ll128*/ 0.598, /*eta_ll*/ 0.714, /*step_simple_s*/ 2.36e-6,
    /*eta_nvls*/ 1.473, /*step_nvls_s*/ 8.07e-6, /*shm_host_bw*/ 4.105e9, /*eta_net*/ 0.944, /*eta_nvls_tree*/ 0.888,
    /*net_latency_s*/ 0, /*eta_efa*/ 1.0};

struct ParamRef { const char* name; double NcclParams::*field; };
constexpr ParamRef kParamRefs[] = {
    {"t0_s", &NcclParams::t0_s}, {"eta_simple", &NcclParams::eta_simple}, {"eta_ll128", &NcclParams::eta_ll128},
    {"eta_ll", &NcclParams::eta_ll}, {"step_simple_s", &NcclParams::step_simple_s},
    {"eta_nvls", &NcclParams::eta_nvls}, {"step_nvls_s", &NcclParams::step_nvls_s},
    {"shm_host_bw", &NcclParams::shm_host_bw}, {"eta_net", &NcclParams::eta_net},
    {"eta_nvls_tree", &NcclParams::eta_nvls_tree}, {"net_latency_s", &NcclParams::net_latency_s},
    {"eta_efa", &NcclParams::eta_efa}};

int log2i(double x) { return x >= 1 ? static_cast<int>(std::floor(std::log2(x))) : -1; }

// What NCCL's graph search would find for the layout, approximated from the link model (links.h): the ring's
// bandwidth (NVLink total per GPU when every hop is NVLink, as NCCL builds several rings over all links; else
// the slowest hop), its transport, the network, the channel count (two per 20 GB/s of ring bandwidth, as the
// search's duplicated channels come out on NVLink; two per NIC across nodes; at most 32).
struct Graph {
  int P = 1, N = 1, L = 1, arch = 0, cc = 0;
  bool nvlink = true, shm = false, nvswitch = false, ll128 = true;
  // Some GPU of the ring both writes its outgoing hop into host memory and reads its incoming hop out of it
  // (shm_host_cap): every GPU of a no-P2P pair does.
  bool shm_both = false;
  // EFA: aws-ofi-nccl sets NCCL_PROTO=simple when it loads, unless the platform is known to order LL/LL128's
  // flag and data writes (src/platform-aws.c, force_proto_simple: p3dn, p4d, p4de and any unlisted instance).
  bool simple_only = false;
  double intra = 1e15, net = 0;  // bytes/s, NCCL units
  int nch = 2, nics = 0;
  std::string cpu_vendor, shm_why, net_note, net_transport;
};

// A ring whose hops go through host memory (NCCL's SHM transport, no P2P): each such hop is a write by the sender
// into host memory and a read by the receiver from it, so its bytes climb the sender's PCIe path to the CPU and
// descend the receiver's. GPUs behind one PCIe switch (PIX/PXB between them) share that switch's uplink, one
// x16 link like theirs: every SHM hop leaving the group crosses it upwards and every hop entering it downwards,
// and each hop gets its share. NCCL's graph search charges a path's bandwidth to every link on it the same way
// (src/graph/search.cc), so this is what its tuner believes too. Two GPUs under one switch: half the link each
// way. The P2P hops are left to nccl_hop's figure.
double shm_ring_bw(const Topology& t, const std::vector<int>& ring, int nccl_version) {
  const size_t n = ring.size();
  auto group = [&](int a, int x) {  // x is a, or behind a's PCIe switch
    const LinkClass c = t.link(a, x).cls;
    return x == a || c == LinkClass::kPIX || c == LinkClass::kPXB;
  };
  std::vector<std::pair<int, int>> shm;
  for (size_t i = 0; i < n; ++i) {
    const int a = ring[i], b = ring[(i + 1) % n];
    if (a != b && !nccl_hop(t, a, b, nccl_version).p2p) shm.emplace_back(a, b);
  }
  double bw = 1e300;
  for (const auto& [a, b] : shm) {
    int up = 0, down = 0;  // SHM hops through a's uplink upwards and through b's downwards
    for (const auto& [x, y] : shm) up += group(a, x), down += group(b, y);
    bw = std::min(bw, nccl_hop(t, a, b, nccl_version).bw / std::max({up, down, 1}));
  }
  return bw;
}

Graph graph_of(const Topology& t, const Layout& lay, int nccl_version) {
  Graph g;
  g.P = lay.nranks();
  g.N = lay.nodes;
  g.L = lay.local;
  const std::vector<int> node0(lay.gpus.begin(), lay.gpus.begin() + lay.local);
  int cc = 1000;
  for (int x : lay.gpus) {
    const Gpu& gp = t.gpus[static_cast<size_t>(x)];
    cc = std::min(cc, gp.cc_major > 0 ? gp.cc_major * 10 + gp.cc_minor : nvlink_gen_of(gp) >= 4 ? 90 : 80);
  }
  g.cc = cc;
  g.arch = cc >= 90 ? 2 : cc >= 80 ? 1 : 0;
  g.cpu_vendor = t.hosts[static_cast<size_t>(t.gpus[static_cast<size_t>(node0[0])].host)].cpu_vendor;
  if (g.L > 1) {
    const std::vector<int> ring = build_ring(t, node0, false);
    double slowest = 1e300;
    g.nvswitch = true;
    for (size_t i = 0; i < ring.size(); ++i) {
      const int a = ring[i], b = ring[(i + 1) % ring.size()];
      if (a == b) continue;
      const Hop h = nccl_hop(t, a, b, nccl_version);
      g.nvlink = g.nvlink && h.nvlink;
      g.nvswitch = g.nvswitch && t.link(a, b).nvswitch;
      slowest = std::min(slowest, h.bw);
      if (!h.p2p) g.shm = true, g.shm_why = h.why;
    }
    g.intra = slowest;
    if (g.shm) g.intra = std::min(g.intra, shm_ring_bw(t, ring, nccl_version));
    for (size_t i = 0; g.shm && i < ring.size(); ++i) {
      const size_t n = ring.size();
      const int prev = ring[(i + n - 1) % n], x = ring[i], next = ring[(i + 1) % n];
      if (prev != x && x != next && !nccl_hop(t, prev, x, nccl_version).p2p && !nccl_hop(t, x, next, nccl_version).p2p)
        g.shm_both = true;
    }
    if (g.nvlink) {
      for (int a : node0) {
        double sum = 0, sw = 0;
        for (int b : node0) {
          if (a == b || t.link(a, b).cls != LinkClass::kNVL) continue;
          const double bw = t.link(a, b).nvlinks * nccl_nvlink_bw(t.gpus[static_cast<size_t>(a)]);
          if (t.link(a, b).nvswitch) sw = std::max(sw, bw);
          else sum += bw;
        }
        g.intra = std::min(g.intra, sw + sum);
      }
    }
  } else {
    g.nvswitch = false;
  }
  g.ll128 = g.nvlink && cc >= 70;
  for (const Nic& n : t.nics) {
    if (n.host == t.gpus[static_cast<size_t>(node0[0])].host && n.transport == "efa") g.simple_only = true;
  }
  g.nch = std::max(2, std::min(kMaxChannels, 2 * static_cast<int>(std::ceil(std::min(g.intra, 1e13) / 20e9))));
  if (g.N > 1) {
    for (const Nic& n : t.nics) {
      if (n.host != t.gpus[static_cast<size_t>(node0[0])].host) continue;
      ++g.nics;
      if (g.net_transport.empty()) g.net_transport = n.transport;
      // LL128 across nodes needs the GPU-NIC path within PXB, on Hopper within PXN (a NIC reached through a
      // peer GPU over NVLink; nvidia-smi shows such NICs as NODE); src/graph/tuning.cc.
      LinkClass best = LinkClass::kNET;
      for (int x : node0) {
        const int idx = t.gpus[static_cast<size_t>(x)].index;
        if (idx < static_cast<int>(n.gpu_paths.size())) best = std::min(best, n.gpu_paths[static_cast<size_t>(idx)]);
      }
      if (best > LinkClass::kPXB && !(cc >= 90 && best <= LinkClass::kNODE)) g.ll128 = false;
    }
    g.net = host_net_bw(t, t.gpus[static_cast<size_t>(node0[0])].host, node0, &g.net_note);
    g.nch = std::max(2, std::min(g.L > 1 ? g.nch : kMaxChannels, 2 * std::max(g.nics, 1)));
  }
  return g;
}

struct Entry {
  bool on = false;
  std::string why;
  double lat = 0;     // s
  double algbw = 0;   // bytes/s, NCCL's (before the tree correction)
  int nsteps = 0;     // NCCL's step count of the pattern (ring: per rank)
};

// NCCL's tuner for one algorithm x protocol (ncclTopoTuneModel, 2.21.5), for this collective.
Entry tune(const Graph& g, algo::Coll coll, int a, int p, const NcclParams& prm) {
  Entry e;
  const int P = g.P, N = g.N, L = g.L;
  const bool ar = coll == algo::Coll::kAllReduce;
  const int nsteps = ar ? 2 * (P - 1)
                        : (coll == algo::Coll::kAllGather || coll == algo::Coll::kReduceScatter) ? P - 1 : P;
  const int ninter = N == 1 ? 0 : ar ? 2 * (N - 1) : N - 1;
  const int i2 = N == 1 ? 0 : N == 2 ? 1 : 2;
  const int i1 = N == 1 ? g.arch : g.cpu_vendor == "amd" ? 1 : 0;
  const Hw intra_hw = g.nvlink ? kHwNvl : kHwPci;
  e.nsteps = nsteps;
  if (!g.ll128 && p == kLL128) return e.why = "NCCL enables LL128 only over NVLink (and NICs within PXB)", e;
  const double ring_bw = N == 1 ? g.intra : std::min(g.intra, g.net);
  double bus = 0;
  if (a == kRing) {
    bus = ring_bw;
    if (p == kLL) bus = std::min(kLLMaxBw[i1][i2] * 1e9, bus * .5);
    if (p == kLL128) bus = std::min(bus * .92, g.nch * kPerChMaxRingLL128Bw[g.arch][i2] * 1e9);
  } else if (a == kTree) {
    bus = std::min((N <= 2 ? g.intra : ring_bw) * .92, g.nch * kPerChMaxTreeBw[g.arch][i2] * 1e9);
    if (p == kLL) bus = std::min(bus / 3.8, kLLMaxBw[i1][i2] * 1e9);
    if (p == kLL128) bus = std::min(bus * (N == 1 ? 7.0 / 9 : 120.0 / 128), g.nch * kPerChMaxTreeLL128Bw[g.arch][i2] * 1e9);
  } else {
    bus = a == kNvls ? g.intra : std::min(g.intra, N <= 2 ? g.net : g.net / 2);
  }
  e.algbw = bus * (a == kRing ? static_cast<double>(P) / nsteps : a == kTree ? .5 : 5.0 / 6);
  const double intra_lat = kHwLat[intra_hw][a][p];
  const double inter_lat = kHwLat[kHwNet][a][p] + prm.net_latency_s * 1e6;
  double lat = kBaseLat[a][p];
  if (a == kRing) {
    if (coll == algo::Coll::kBroadcast || coll == algo::Coll::kReduce) {
      lat += nsteps * kHwLat[N == 1 ? intra_hw : kHwNet][p == kSimple ? kTree : kRing][p];
    } else {
      // Inter-node rings pay the network's post overhead per step (1 us Intel, 2 us AMD, x3 for Simple).
      const double over = N > 1 ? (g.cpu_vendor == "amd" ? 2.0 : 1.0) * (p == kSimple ? 3 : 1) : 0;
      lat += (nsteps - ninter) * std::max(intra_lat, over) + ninter * inter_lat;
    }
  } else if (a == kTree) {
    lat += 2 * ((L - 1) * intra_lat + log2i(N) * inter_lat);
  } else if (a == kNvls) {
    lat = intra_lat;
  } else {
    lat += intra_lat + 2 * log2i(N) * inter_lat;
  }
  e.lat = lat * 1e-6;
  e.on = e.algbw > 0;
  return e;
}

double tree_correction(int p, double nbytes) {
  const int ls = log2i(nbytes / 64);
  return ls >= 0 && ls < 23 ? kTreeCorrection[p][ls] : 1.0;
}

// NCCL's estimate (ncclTopoGetAlgoTime): lat + bytes / bw, with its tree correction and the ring plateau factor.
double tuner_seconds(const Graph& g, algo::Coll coll, int a, int p, const Entry& e, double S) {
  double bw = e.algbw * (a == kTree ? tree_correction(p, S) : 1.0), lat = e.lat;
  if (a == kRing && p == kSimple && g.N > 1 && coll == algo::Coll::kAllReduce && S / (g.nch * g.P) >= 64) lat *= 1.4;
  return lat + S / bw;
}

// Pipeline steps one channel goes through (src/enqueue.cc computeColl, computeCollChunkInfo): the ring loops over
// nranks chunks per channel, each chunk ALLREDUCE_CHUNKSTEPS steps; NVLS shrinks its chunk for small messages.
double pipeline_steps(const Graph& g, int a, int p, int nsteps, double S) {
  if (a == kNvls || a == kNvlsTree) {
    const double ops = static_cast<double>(kNvlsChannels) * g.L;
    double chunk = 128 * 1024;
    if (S < 64 * ops * chunk) chunk = std::min(chunk, 65536.0);
    if (S < 8 * ops * chunk) chunk = std::min(chunk, 32768.0);
    if (S < 2 * ops * chunk) chunk = std::min(chunk, 16384.0);
    return std::ceil(S / (ops * chunk));
  }
  const double per_channel = S / g.nch;
  const double chunk = p == kSimple ? kSimpleStep * (a == kRing ? kRingChunkSteps : 1) : p == kLL ? kLLChunk : kLL128Chunk;
  const int k = p == kSimple && a == kRing ? kRingChunkSteps : 1;
  if (a == kRing) return std::ceil(per_channel / (g.P * chunk)) * nsteps * k;
  return std::ceil(per_channel / chunk) * 2;
}

struct Timed {
  double seconds = 0, net_steps = 0, net_s = 0, base_s = 0;
  bool net_bound = false;
};

// NCCL's SHM transport (src/transport/shm.cc, its default direct mode: NCCL_SHM_USE_CUDA_MEMCPY=0, the FIFO in
// the receiver's NUMA node) has the sender's SMs store each step into a FIFO in host memory and the receiver's
// SMs load it back. Every byte crosses the sender's PCIe path upwards and the receiver's downwards, which
// shm_ring_bw charges in NCCL's units as NCCL does. What changes the rate beyond that is whether one GPU does
// both at once: writes its outgoing hop into host memory while reading its incoming hop out of it, as every GPU
// of a no-P2P pair does. Then each of its reads (non-posted) waits behind its own stream of posted writes, which
// PCIe forbids it to pass, and the rate is the host's, not a share of the link: the published no-P2P pairs,
// PCIe gen 3 behind one switch and gen 4 on their own root ports, both reach about 4 GB/s; on one gen-3 pair with
// one channel NCCL's maintainers saw all_reduce at 3.9 GB/s where broadcast, whose bytes flow one way, reached
// 10.3 ("some CPUs do not handle bidirectional traffic well", NVIDIA/nccl#384). A ring whose host-staged hops
// leave every GPU one way only (P2P pairs behind switches joined through the CPU) keeps its PCIe share. So where
// some GPU stages both ways, the ring's bus bandwidth is the lesser of its share and shm_host_bw, a rate per GPU
// (each GPU's reads wait on its own writes); LL's 16-byte lines carry 8 bytes of data, so it moves half of that.
// Two GPUs within one socket are all the data has: how the rate goes with more GPUs per host (the intervals widen
// for ranks per node outside the evidence) or across sockets (they do not: no path kind says which sockets it
// crosses yet) it cannot say.
double shm_host_cap(int p, const NcclParams& prm) {
  return prm.shm_host_bw * (p == kLL ? 0.5 : p == kLL128 ? 120.0 / 128 : 1.0);
}

// The execution model: NCCL's latency, its bandwidth times the calibrated efficiency of the protocol and the
// transport, the network at eta_net of the NICs' rate, and a per-step cost for the pipeline steps.
Timed execute(const Graph& g, algo::Coll coll, int a, int p, const Entry& e, double S, const NcclParams& prm) {
  const double bf = busbw_factor(coll, g.P);
  const double eta_p = p == kSimple ? prm.eta_simple : p == kLL128 ? prm.eta_ll128 : prm.eta_ll;
  double bw = e.algbw * eta_p * (a == kTree ? tree_correction(p, S) : 1.0);
  if (g.shm_both) bw = std::min(bw, shm_host_cap(p, prm) / bf);
  if (a == kNvls || a == kNvlsTree) bw = prm.eta_nvls * g.intra / bf * (a == kNvlsTree ? prm.eta_nvls_tree : 1.0);
  Timed r;
  double net_cap = 0;
  if (g.N > 1) {
    // The NICs at eta_net of their rate bound a ring's and a tree's bus bandwidth alike: on two nodes the tree
    // sends the message across only once each way, yet published two-node runs show no more than a ring's
    // figure (nccl#1221, nccl-tests#175). NVLS-tree moves the message once each way, twice for the interior
    // nodes of a tree over more than two nodes (NCCL 2.21.5 halves its network bandwidth there).
    // A transport's own efficiency is kept apart from eta_net, so that what one transport reaches does not move
    // the others' (leave-one-system-out: EFA's misses pulled the verbs systems' predictions down).
    const double eta = prm.eta_net * (g.net_transport == "efa" ? prm.eta_efa : 1.0);
    net_cap = a == kRing ? eta * g.net * g.P / e.nsteps
              : a == kTree ? eta * g.net / (2.0 * (g.P - 1) / g.P)
                           : eta * g.net / (g.N > 2 ? 2 : 1);
    if (net_cap < bw) bw = net_cap, r.net_bound = true;
  }
  double lat = e.lat;
  if (a == kRing && p == kSimple && g.N > 1 && coll == algo::Coll::kAllReduce && S / (g.nch * g.P) >= 64) lat *= 1.4;
  const double steps = pipeline_steps(g, a, p, e.nsteps, S);
  const double step_cost = p != kSimple ? 0 : (a == kNvls || a == kNvlsTree) ? prm.step_nvls_s : prm.step_simple_s;
  r.seconds = prm.t0_s + lat + S / bw + steps * step_cost;
  if (g.N > 1) {
    const int ninter = a == kRing ? (coll == algo::Coll::kAllReduce ? 2 * (g.N - 1) : g.N - 1) : 2 * log2i(g.N);
    r.net_steps = (a == kRing && p == kSimple && coll == algo::Coll::kAllReduce && S / (g.nch * g.P) >= 64 ? 1.4 : 1.0) *
                  ninter;
    r.net_s = r.net_bound ? S / (net_cap / prm.eta_net) : 0;
    r.base_s = r.seconds - r.net_steps * prm.net_latency_s - (r.net_bound ? S / bw : 0);
  }
  return r;
}

bool nvls_dtype(const std::string& d) {
  // ncclNvlsSupported (src/include/device.h, 2.21.5): 32/64-bit integers, f16, bf16, f32, f64 (sum).
  return d != "int8" && d != "uint8" && d.rfind("float8", 0) != 0;
}

struct Plan {
  Graph g;
  std::vector<Candidate> out;
  std::vector<std::pair<Entry, Timed>> timing;  // per candidate (usable ones)
};

Plan plan(const Topology& t, const Layout& lay, algo::Coll coll, double S, const std::string& dtype, int nccl_version,
          const Tuning& tuning) {
  Plan pl;
  const NcclParams prm = nccl_params(tuning);
  pl.g = graph_of(t, lay, nccl_version);
  const Graph& g = pl.g;
  const bool ar = coll == algo::Coll::kAllReduce;
  const bool ring_coll = ar || coll == algo::Coll::kAllGather || coll == algo::Coll::kReduceScatter ||
                         coll == algo::Coll::kBroadcast || coll == algo::Coll::kReduce;
  const bool nvls_coll = ar || coll == algo::Coll::kAllGather || coll == algo::Coll::kReduceScatter;
  std::string nvls_why;
  if (!nvls_coll) nvls_why = "NVLS serves all_reduce, all_gather and reduce_scatter";
  else if (g.cc < 90 || !g.nvswitch) nvls_why = "NVLS needs NVSwitch and sm_90 or newer (NVLink SHARP)";
  else if (g.L <= 2) nvls_why = "NCCL enables NVLS only with more than two GPUs in the node (src/transport/nvls.cc)";
  else if (!nvls_dtype(dtype)) nvls_why = "NCCL's NVLS kernels do not take " + dtype;
  const std::string src = g.shm ? " (SHM: " + g.shm_why + ")" : "";
  for (int a : {kRing, kTree, kNvls, kNvlsTree}) {
    for (int p : {kLL, kLL128, kSimple}) {
      if ((a == kNvls || a == kNvlsTree) && p != kSimple) continue;
      Candidate c;
      c.backend = "nccl";
      c.algorithm = kAlgoNames[a];
      c.protocol = kProtoNames[p];
      c.link_class = g.N > 1 ? "NET" : g.nvlink ? "NVL" : g.shm ? "SHM" : "PCI";
      Entry e;
      if (a == kRing && !ring_coll) c.reason = "NCCL runs " + std::string(algo::coll_name(coll)) + " as send/recv";
      else if (a == kTree && !ar) c.reason = "NCCL's tree serves all_reduce only";
      else if ((a == kNvls && g.N > 1) || (a == kNvlsTree && g.N == 1))
        c.reason = a == kNvls ? "NVLS across nodes needs CollNet (NVLS-tree runs instead)" : "NVLS-tree is for several nodes";
      else if ((a == kNvls || a == kNvlsTree) && !nvls_why.empty()) c.reason = nvls_why;
      else if (a == kNvlsTree && !ar) c.reason = "NVLS-tree serves all_reduce only";
      else if (g.P < 2) c.reason = "one rank: nothing to exchange";
      else if (g.simple_only && p != kSimple) c.reason = "aws-ofi-nccl sets NCCL_PROTO=simple on EFA hosts";
      else {
        e = tune(g, coll, a, p, prm);
        if (!e.on) c.reason = e.why;
      }
      if (c.reason.empty()) {
        const Timed tm = execute(g, coll, a, p, e, S, prm);
        c.usable = true;
        c.steps = e.nsteps;
        c.bytes = S;
        c.seconds = tm.seconds;
        c.tuner_seconds = tuner_seconds(g, coll, a, p, e, S);
        c.model = "NCCL tuner 2.21.5 + fitted execution" + src;
        pl.timing.emplace_back(e, tm);
      } else {
        pl.timing.emplace_back(Entry{}, Timed{});
      }
      pl.out.push_back(c);
    }
  }
  Candidate* best = nullptr;
  for (Candidate& c : pl.out) {
    if (c.usable && (best == nullptr || c.tuner_seconds < best->tuner_seconds)) best = &c;
  }
  if (best != nullptr) best->nccl_auto = true;
  return pl;
}

}  // namespace

NcclParams nccl_params(const Tuning& tuning) {
  NcclParams p = kDefaults;
  for (const ParamRef& r : kParamRefs) {
    auto it = tuning.nccl_model.find(r.name);
    if (it != tuning.nccl_model.end()) p.*(r.field) = it->second;
  }
  return p;
}

std::vector<std::pair<std::string, double>> nccl_param_values(const Tuning& tuning) {
  const NcclParams p = nccl_params(tuning);
  std::vector<std::pair<std::string, double>> v;
  for (const ParamRef& r : kParamRefs) v.emplace_back(r.name, p.*(r.field));
  return v;
}

std::vector<std::string> nccl_param_names() {
  std::vector<std::string> v;
  for (const ParamRef& r : kParamRefs) v.push_back(r.name);
  return v;
}

NcclPath nccl_path(const Topology& t, const Layout& lay) {
  const Graph g = graph_of(t, lay, 0);
  NcclPath p;
  // Across nodes the transport is its own kind: EFA and TCP differ from verbs in latency and in what reaches the
  // wire, and the published verbs systems say nothing about them.
  const std::string net = g.net_transport == "efa" || g.net_transport == "tcp" ? "net_" + g.net_transport : "net";
  p.kind = g.N > 1 ? net : g.nvswitch ? "nvswitch" : g.nvlink ? "nvlink" : g.shm ? "shm" : "pcie_p2p";
  p.cc = g.cc;
  p.local = g.L;
  p.nodes = g.N;
  return p;
}

std::vector<Candidate> nccl_candidates(const Topology& t, const Layout& lay, algo::Coll coll, double nbytes,
                                       const std::string& dtype, int nccl_version, const Tuning& tuning) {
  std::vector<Candidate> out = plan(t, lay, coll, nbytes, dtype, nccl_version, tuning).out;
  const std::string sure = nccl_confidence(t, lay);
  std::string why;
  const double spread = lay.nranks() > 1 ? nccl_spread(nccl_path(t, lay), nbytes, tuning, &why) : 0;
  for (Candidate& c : out) {
    c.confidence = sure;
    if (c.usable) c.spread = spread, c.spread_why = why;
  }
  // Sends and receives (all_to_all, gather, scatter): NCCL's P2P path, priced as the ring's Simple protocol would
  // move the same bytes: (P-1)/P of the message through each rank's link.
  if (coll == algo::Coll::kAllToAll || coll == algo::Coll::kGather || coll == algo::Coll::kScatter) {
    const Graph g = graph_of(t, lay, nccl_version);
    const NcclParams prm = nccl_params(tuning);
    Candidate c;
    c.backend = "nccl";
    c.algorithm = "direct";
    c.protocol = "Simple";
    c.link_class = g.N > 1 ? "NET" : g.nvlink ? "NVL" : g.shm ? "SHM" : "PCI";
    c.confidence = sure;
    c.spread = spread;
    c.spread_why = why;
    if (lay.nranks() < 2) {
      c.reason = "one rank: nothing to exchange";
    } else {
      const double eta = prm.eta_net * (g.net_transport == "efa" ? prm.eta_efa : 1.0);
      double bw = (g.N > 1 ? std::min(g.intra, g.net * eta) : g.intra) * prm.eta_simple;
      if (g.shm_both) bw = std::min(bw, shm_host_cap(kSimple, prm));
      c.usable = c.nccl_auto = true;
      c.steps = lay.nranks() - 1;
      c.bytes = nbytes * (lay.nranks() - 1) / lay.nranks();
      c.seconds = prm.t0_s + kBaseLat[kRing][kSimple] * 1e-6 + c.bytes / bw;
      c.tuner_seconds = c.seconds;
      c.model = "NCCL send/recv, fitted execution";
    }
    out.push_back(c);
  }
  return out;
}

NetTerms nccl_net_terms(const Topology& t, const Layout& lay, algo::Coll coll, double nbytes, const std::string& dtype,
                        int nccl_version, const Tuning& tuning) {
  const Plan pl = plan(t, lay, coll, nbytes, dtype, nccl_version, tuning);
  NetTerms r;
  for (size_t i = 0; i < pl.out.size(); ++i) {
    if (!pl.out[i].nccl_auto) continue;
    const Timed& tm = pl.timing[i].second;
    r.algorithm = pl.out[i].algorithm;
    r.protocol = pl.out[i].protocol;
    r.base_s = lay.nodes > 1 ? tm.base_s : tm.seconds;
    r.net_steps = tm.net_steps;
    r.net_s = tm.net_s;
  }
  return r;
}

std::string nccl_confidence(const Topology& t, const Layout& lay) {
  const Graph g = graph_of(t, lay, 0);
  std::string cls;
  if (lay.nranks() < 2) return "n/a (one rank)";
  if (g.N > 1) cls = "multi-node";
  else if (g.nvswitch) cls = "single-node NVSwitch";
  else if (g.nvlink) cls = "NVLink without NVSwitch";
  else cls = g.shm ? "PCIe without P2P (host-staged)" : "PCIe P2P";
  // Which system classes the published data covers (tests/fixtures/published/nccl_allreduce.json) and how
  // the model did on the points it was not fitted to (tests/topo/test_published_nccl.py prints the table).
  const char* arch = g.cc >= 100 ? "sm_100" : g.cc >= 90 ? "sm_90" : g.cc >= 80 ? "sm_80" : "sm_70";
  std::string status = "extrapolated", why;
  if (g.N > 1) {
    const bool known_net = g.net_note.empty() && g.net_transport != "efa" && g.net_transport != "tcp";
    status = g.cc >= 80 && g.cc < 100 && known_net ? "calibrated" : "extrapolated";
    why = known_net ? "IB/RoCE, A100/H100 2-4 nodes" : !g.net_note.empty() ? g.net_note : g.net_transport + " transport";
  } else if (g.nvswitch) {
    status = g.cc >= 80 && g.cc < 100 ? "calibrated" : g.cc >= 100 ? "validated" : "extrapolated";
    why = "8x A100 / 8x H100-H200 / 4x GB200 published curves";
  } else if (g.nvlink) {
    status = g.cc >= 80 && g.cc < 100 && g.L == 2 ? "validated" : "extrapolated";
    why = "one published NVLink-bridge pair (2x A100 PCIe NV12)";
  } else if (g.shm) {
    status = g.L == 2 ? "calibrated" : "extrapolated";
    why = "two published pairs (2x RTX 2080 Ti PCIe gen 3, 2x A40 gen 4), no P2P";
  } else {
    why = "no published PCIe P2P point";
  }
  return status + ": " + cls + " " + arch + " (" + why + ")";
}

}  // namespace gpucoll::topo
