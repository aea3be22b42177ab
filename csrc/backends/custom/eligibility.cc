#include "backends/custom/eligibility.h"

#include "backends/custom/launch_shape.h"
#include "core/error.h"

namespace gpucoll::custom {

bool dtype_supported(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || t == DType::kF64 || t == DType::kI32;
}

bool op_supported(RedOp op) {
  return op == RedOp::kSum || op == RedOp::kMin || op == RedOp::kMax || op == RedOp::kAvg;
}

std::string p2p_problem(int nranks, const std::vector<uint8_t>& p2p) {
  if (p2p.size() != static_cast<size_t>(nranks) * static_cast<size_t>(nranks)) {
    return detail::concat("the P2P check has ", p2p.size(), " entries for ", nranks, " ranks (it did not run)");
  }
  for (int i = 0; i < nranks; ++i) {
    for (int j = 0; j < nranks; ++j) {
      if (p2p[static_cast<size_t>(i) * nranks + j] == 0) {
        return detail::concat("rank ", i, " cannot read rank ", j,
                              "'s memory (a test copy through the peer mapping failed or returned wrong bytes)");
      }
    }
  }
  return {};
}

std::string placement_problem(int nranks, const std::vector<std::string>& hosts, const std::vector<uint8_t>& p2p) {
  if (nranks < 1 || nranks > kMaxRanks) {
    return detail::concat("the custom kernels serve 1 to ", kMaxRanks, " ranks; this communicator has ", nranks);
  }
  for (size_t r = 1; r < hosts.size(); ++r) {
    if (hosts[r] != hosts[0]) {
      return detail::concat("ranks are on different nodes (rank 0 on '", hosts[0], "', rank ", r, " on '", hosts[r],
                            "'); peer memory only reaches GPUs of one node");
    }
  }
  return p2p_problem(nranks, p2p);
}

Decision check_call(const Facts& f) {
  Decision d;
  auto no = [&d](std::string why) {
    d.reason = std::move(why);
    return d;
  };
  if (!dtype_supported(f.dtype)) {
    return no(detail::concat("dtype ", dtype_name(f.dtype),
                             " has no custom kernel (float32, float16, bfloat16, float64, int32)"));
  }
  if (f.premul) return no("premul_sum has no custom kernel (sum, min, max, avg)");
  if (!op_supported(f.op)) return no(detail::concat("op ", redop_name(f.op), " has no custom kernel (sum, min, max, avg)"));
  const size_t esize = dtype_size(f.dtype);
  if (f.in_ptr % esize != 0 || f.out_ptr % esize != 0) {
    d.alignment = true;
    return no(detail::concat("x or out is not aligned to its element size (", esize, " bytes)"));
  }
  if (f.registered && f.count * esize > f.registered_bytes) {
    return no(detail::concat("the message (", f.count * esize, " bytes) exceeds the registered buffer (",
                             f.registered_bytes, " bytes from x on)"));
  }
  d.ok = true;
  return d;
}

Decision check_eligibility(const Facts& f) {
  std::string placement = placement_problem(f.nranks, f.hosts, f.p2p);
  if (!placement.empty()) {
    Decision d;
    d.reason = std::move(placement);
    return d;
  }
  return check_call(f);
}

}  // namespace gpucoll::custom
