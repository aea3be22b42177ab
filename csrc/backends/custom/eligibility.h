// Whether one allreduce can run on gpucoll's own kernels, as a pure function of facts the caller gathered (so
// the CPU tests cover every decline and its message). Every "no" carries the reason the backend logs before
// falling back to NCCL.
//
// Every fact here is the same on every rank for the same call (node layout, the P2P matrix every rank
// agreed on, dtype, op, count, whether the input buffer was registered collectively), except the pointers'
// alignment: a misaligned pointer on one rank only would split the ranks between two backends, so the
// caller treats an alignment decline as an argument error (see gpucoll/backends/custom.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/types.h"

namespace gpucoll::custom {

struct Facts {
  int nranks = 0;
  // Hostname of every rank (same node: all equal).
  std::vector<std::string> hosts;
  // p2p[i * nranks + j]: rank i read rank j's buffer with a real copy (1) or not (0).
  std::vector<uint8_t> p2p;
  DType dtype = DType::kF32;
  RedOp op = RedOp::kSum;
  bool premul = false;  // gpucoll.premul_sum(...)
  size_t count = 0;
  uintptr_t in_ptr = 0;
  uintptr_t out_ptr = 0;
  // Registered (zero-copy) input: bytes registered from in_ptr on. Unregistered inputs are staged.
  bool registered = false;
  size_t registered_bytes = 0;
};

struct Decision {
  bool ok = false;
  std::string reason;  // empty when ok
  bool alignment = false;  // declined for the pointers' alignment (a per-rank fact)
};

// The dtypes and ops the kernels are instantiated for.
bool dtype_supported(DType t);
bool op_supported(RedOp op);

// Checks in order: rank count, same node, P2P, dtype, op, alignment, registered size.
Decision check_eligibility(const Facts& f);

// The first two halves of that order. Placement (rank count, nodes, P2P) is fixed for a communicator's life, so
// CustomComm checks it once at set-up and only the call's half on each call.
std::string placement_problem(int nranks, const std::vector<std::string>& hosts, const std::vector<uint8_t>& p2p);
Decision check_call(const Facts& f);  // reads dtype, op, premul, count, the pointers and registration only

// The first (i, j) pair whose P2P check failed, as "rank i cannot read rank j's memory"; empty when all work.
std::string p2p_problem(int nranks, const std::vector<uint8_t>& p2p);

}  // namespace gpucoll::custom
