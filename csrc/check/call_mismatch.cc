#include "check/call_mismatch.h"

#include <vector>

#include "algo/registry.h"
#include "core/quant.h"
#include "core/types.h"

namespace gpucoll::algo {

namespace {

std::string coll_text(uint8_t coll) {
  if (coll == kSigBarrier) return "barrier";
  return coll < kNumColls ? coll_name(static_cast<Coll>(coll)) : "collective " + std::to_string(coll);
}

std::string algo_text(uint8_t algo) {
  const auto& all = algorithms();
  return algo < all.size() ? all[algo]->name : "#" + std::to_string(algo);
}

// The fields in which some rank differs from rank 0, in the order the description lists them.
std::string differing_fields(const CallSig* sigs, int nranks) {
  const CallSig& a = sigs[0];
  bool coll = false, count = false, dtype = false, op = false, root = false, algo = false, local = false;
  bool wire = false;
  for (int r = 1; r < nranks; ++r) {
    const CallSig& b = sigs[r];
    coll |= a.coll != b.coll;
    count |= a.count != b.count;
    dtype |= a.dtype != b.dtype;
    op |= a.op != b.op;
    root |= a.root != b.root;
    algo |= a.algo != b.algo;
    local |= a.local_size != b.local_size;
    wire |= a.wire != b.wire;
  }
  if (coll) return "collective";  // the other fields mean different things then
  std::string out;
  auto add = [&](bool differs, const char* name) {
    if (differs) out += (out.empty() ? "" : ", ") + std::string(name);
  };
  add(count, "count");
  add(dtype, "dtype");
  add(op, "op");
  add(root, "root");
  add(algo, "algorithm");
  add(local, "local_size");
  add(wire, "compress");
  return out;
}

}  // namespace

std::string describe_call(const CallSig& s) {
  std::string out = coll_text(s.coll) + "(";
  if (s.coll != kSigBarrier) {
    out += "count=" + std::to_string(s.count);
    out += std::string(", dtype=") + (s.dtype < kNumAllDTypes ? dtype_name(static_cast<DType>(s.dtype)) : "?");
    if (s.op != kSigNone) {
      out += std::string(", op=") + (s.op < kNumRedOps     ? redop_name(static_cast<RedOp>(s.op))
                                      : s.op == kSigPremulSum ? "premul_sum"
                                                              : "?");
    }
    if (s.root >= 0) out += ", root=" + std::to_string(s.root);
    if (s.algo != kSigNone) {
      out += ", algo=" + algo_text(s.algo) + ((s.flags & kSigAutoAlgo) != 0 ? " by auto" : "");
    }
    if (s.local_size != 0) out += ", local_size=" + std::to_string(s.local_size);
    if (s.wire != 0) {
      out += std::string(", compress=") + (s.wire < kNumWires ? wire_name(static_cast<Wire>(s.wire)) : "?");
    }
  }
  return out + ")";
}

bool call_sigs_agree(const CallSig* sigs, int nranks) {
  for (int r = 1; r < nranks; ++r) {
    if (!call_sig_equal(sigs[0], sigs[r])) return false;
  }
  return true;
}

std::string call_mismatch_message(const CallSig* sigs, int nranks) {
  std::string out = "ranks made different calls as collective #" + std::to_string(sigs[0].seq);
  const std::string fields = differing_fields(sigs, nranks);
  if (!fields.empty()) out += " (they differ in " + fields + ")";
  out += "; every rank must make the same collective calls in the same order:";
  // Ranks with the same call share one line, in the order of their first rank.
  std::vector<char> listed(static_cast<size_t>(nranks), 0);
  for (int r = 0; r < nranks; ++r) {
    if (listed[static_cast<size_t>(r)]) continue;
    std::vector<int> group;
    for (int q = r; q < nranks; ++q) {
      if (!listed[static_cast<size_t>(q)] && call_sig_equal(sigs[r], sigs[q])) {
        group.push_back(q);
        listed[static_cast<size_t>(q)] = 1;
      }
    }
    std::string who;
    for (size_t i = 0; i < group.size();) {
      size_t j = i;
      while (j + 1 < group.size() && group[j + 1] == group[j] + 1) ++j;
      who += (who.empty() ? "" : ", ") + std::to_string(group[i]) +
             (j > i ? "-" + std::to_string(group[j]) : std::string());
      i = j + 1;
    }
    out += "\n  rank" + std::string(group.size() > 1 ? "s " : " ") + who + ": " + describe_call(sigs[r]);
  }
  return out;
}

}  // namespace gpucoll::algo
