// The algorithm registry: one line per algorithm in registry.cc. Host code finds schedules here by name;
// device code instantiates the algorithm structs (csrc/algo/<name>.h) directly as template arguments.
#pragma once

#include <string>
#include <vector>

#include "algo/schedule.h"

namespace gpucoll::algo {

struct Algorithm {
  const char* name;
  const char* summary;
  bool (*supports)(Coll);
  // nullptr when the schedule can serve these params, else a sentence saying why not.
  const char* (*unusable)(const Params&);
  Shape (*shape)(const Params&);
  int (*step_ops)(const Params&, int32_t rank, int32_t step, Op* out);
};

const std::vector<const Algorithm*>& algorithms();
// nullptr when no algorithm has that name.
const Algorithm* find_algorithm(const std::string& name);

const char* coll_name(Coll c);
bool parse_coll(const std::string& name, Coll* out);

// Adapts an algorithm struct (static supports/unusable/shape/step_ops) to a registry entry.
template <class A>
const Algorithm* algorithm_entry() {
  static const Algorithm entry = {A::kName, A::kSummary, &A::supports, &A::unusable, &A::shape, &A::step_ops};
  return &entry;
}

}  // namespace gpucoll::algo
