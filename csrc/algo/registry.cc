#include "algo/registry.h"

#include "algo/ring.h"
#include "algo/double_binary_tree.h"
#include "algo/one_shot.h"
#include "algo/two_shot.h"
#include "algo/direct.h"
#include "algo/tree.h"
#include "algo/halving_doubling.h"
#include "algo/hierarchical.h"

namespace gpucoll::algo {

const std::vector<const Algorithm*>& algorithms() {
  // One line per algorithm; the order is the order `explain` lists them in.
  static const std::vector<const Algorithm*> all = {
      algorithm_entry<Ring>(),
      algorithm_entry<Tree>(),
      algorithm_entry<HalvingDoubling>(),
      algorithm_entry<Hierarchical>(),
      algorithm_entry<DoubleBinaryTree>(),
      algorithm_entry<OneShot>(),
      algorithm_entry<TwoShot>(),
      algorithm_entry<Direct>(),
  };
  return all;
}

const Algorithm* find_algorithm(const std::string& name) {
  for (const Algorithm* a : algorithms()) {
    if (name == a->name) return a;
  }
  return nullptr;
}

namespace {
const char* const kCollNames[kNumColls] = {"all_reduce", "broadcast",  "reduce",  "all_gather",
                                           "reduce_scatter", "all_to_all", "gather", "scatter"};
}

const char* coll_name(Coll c) {
  const int i = static_cast<int>(c);
  return i >= 0 && i < kNumColls ? kCollNames[i] : "?";
}

bool parse_coll(const std::string& name, Coll* out) {
  for (int i = 0; i < kNumColls; ++i) {
    if (name == kCollNames[i]) {
      *out = static_cast<Coll>(i);
      return true;
    }
  }
  // Spellings of NCCL and of GPUCOLL_ALGO ("allreduce:ring").
  std::string squashed;
  for (char ch : name) {
    if (ch != '_') squashed += ch;
  }
  for (int i = 0; i < kNumColls; ++i) {
    std::string candidate;
    for (const char* p = kCollNames[i]; *p; ++p) {
      if (*p != '_') candidate += *p;
    }
    if (squashed == candidate) {
      *out = static_cast<Coll>(i);
      return true;
    }
  }
  return false;
}

}  // namespace gpucoll::algo
