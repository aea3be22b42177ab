// Algorithm choice: an explicit algo= wins, then GPUCOLL_ALGO, then the a + b*l cost model.
//
// The model prices one piece of the host executor (schedule.h): every schedule step and the copy-in step cost
// a synchronisation `a`, every byte a rank moves - read from peers (the checker's counts, the one source of
// truth for per-algorithm traffic), copied in and copied out - costs `b`. Pieces run back to back. Ranks that
// outnumber cores share them, so both terms grow by P / cores.
#pragma once

#include <cstdint>
#include <string>

#include "algo/registry.h"

namespace gpucoll::algo {

struct CostParams {
  double a_s = 10e-6;             // per-step synchronisation (see host_cost_params for the source)
  double b_s_per_byte = 0.15e-9;  // per byte moved by one rank
  int64_t segment_bytes = 256 << 10;
  int64_t buffer_bytes = 16 << 20;
  int cores = 0;                  // 0: the cores this process may run on
};

struct Prediction {
  bool usable = false;
  std::string reason;  // why not, when !usable
  double seconds = 0;
  int32_t steps = 0;         // schedule steps per piece (without copy-in)
  int64_t pieces = 0;
  int64_t bytes_sent = 0;    // per rank, max over ranks, whole message
  int64_t bytes_recv = 0;
};

// The host backend's cost parameters: defaults measured on the development machine (see selector.cc),
// with segment/buffer sizes from the config registry.
CostParams host_cost_params();

Prediction predict(const Algorithm& a, Coll coll, int nranks, int64_t nbytes, int local_size, const CostParams& cp);

// `requested` is "auto" or an algorithm name. Throws InvalidArgument naming the algorithm and why it cannot
// serve the call (unknown, does not implement the collective, unusable for these ranks).
const Algorithm& select_algorithm(Coll coll, int nranks, int64_t nbytes, int local_size, const std::string& requested);

// The GPUCOLL_ALGO entry for a collective ("" when none): "allreduce:ring,broadcast:tree" or a bare "ring"
// that applies to every collective it implements.
std::string algo_override(Coll coll);

// select_algorithm(..., "auto") with its last answer kept: the cost model prices every registered algorithm, about
// a microsecond, which a loop of like calls would pay on each. The key holds all the answer depends on, the text of
// GPUCOLL_ALGO included (it may change between calls); the cost parameters are read once per process anyway. One
// per communicator, used by one thread at a time, as the communicator is.
class AutoChoice {
 public:
  const Algorithm& choose(Coll coll, int nranks, int64_t nbytes, int local_size);

 private:
  const Algorithm* last_ = nullptr;
  Coll coll_ = Coll::kAllReduce;
  int nranks_ = 0;
  int64_t nbytes_ = -1;
  int local_size_ = 0;
  std::string spec_;
};

}  // namespace gpucoll::algo
