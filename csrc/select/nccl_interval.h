// How far a prediction of the NCCL model may be off, from how far it was off on published systems it had not
// seen (leave-one-system-out, gpucoll/_loso.py) and how far this call's inputs lie from theirs.
#pragma once

#include <string>
#include <vector>

#include "select/cost.h"

namespace gpucoll::topo {

// The path a layout's NCCL call takes, in the terms the evidence is kept in: kind is "nvswitch" (one node, every
// hop through NVSwitch), "nvlink" (NVLink without a switch: bridges, meshes), "pcie_p2p", "shm" (no P2P: staged
// through host memory) or "net" (several nodes).
struct NcclPath {
  std::string kind;
  int cc = 0;     // the lowest compute capability of the layout's GPUs, 80 for sm_80
  int local = 0;  // ranks per node
  int nodes = 0;
};

// The evidence compiled in (nccl_evidence.inc, written by bench/published/accuracy.py --write-table).
const std::vector<NcclEvidence>& shipped_nccl_evidence();

// The interval's half-width in log space for a call of `nbytes` on `path` (the truth expected within
// prediction * e^(+-spread) about 80% of the time), and what widened it.
double nccl_spread(const NcclPath& path, double nbytes, const Tuning& tuning, std::string* why);

}  // namespace gpucoll::topo
