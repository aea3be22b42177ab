// P virtual ranks of gpucoll's custom allreduce kernels in one process on the emulated device, through the same
// CustomComm (connect_local) and launchers as gpucoll.testing.virtual_ranks, checked element by element against
// the host backend's own arithmetic (backends/host/kernels.h). Built by tests/emulation/:
//   * plainly, from csrc/ or from a mutated copy of it (the seeded-bug check: a broken kernel must fail here);
//   * with -fsanitize=thread (the data-race check: the real protocol must be clean, and one built with
//     GPUCOLL_EMU_TEST_WEAK_RELEASE must not be).
//
//   vranks_harness [--ranks=2,3,8] [--algos=oneshot,twoshot,ring,tree] [--quick|--tsan] [--dtypes=LIST|all]
//                  [--shuffle=SEED] [--sms=N] [--bps=N]
// --quick: float32 and bfloat16, sum and avg, fewer sizes. --tsan: float32 sum only, one size per path (one piece,
// several pieces, several blocks): what ThreadSanitizer needs to see every synchronisation, in bounded time.
//   vranks_harness --missing-peer      one rank calls, its peer never does: the kernel must time out
// Prints one line per failure and a summary; exits 1 on any wrong element, timed-out kernel or error.
//
// Inputs are distinct per element and rank, small integers (every sum, avg and extreme exact in every dtype; avg:
// see fill_host), and outputs start as a sentinel, so a kernel that skips, shifts or double-counts any element is caught.
#include <cuda_runtime.h>
#include <gpucoll_emu/api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backends/custom/eligibility.h"
#include "backends/custom/cuda/custom_comm.h"
#include "backends/custom/cuda/stream_graph.h"
#include "backends/host/kernels.h"
#include "core/dispatch.h"
#include "core/types.h"

namespace {

using gpucoll::DType;
using gpucoll::RedOp;
using gpucoll::custom::Algo;
using gpucoll::cuda::custom::CustomComm;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

// Element i of rank r: an integer in [-30, 30] that differs between neighbouring elements and between ranks.
double value(int r, size_t i, RedOp op) {
  const long v = static_cast<long>((i * 7 + static_cast<size_t>(r) * 13 + (i / 61) * 3) % 61) - 30;
  if ((op == RedOp::kMin || op == RedOp::kMax) && v == 0) return 31;  // no signed zeros to order
  return static_cast<double>(v);
}

// avg on floating types pre-multiplies every input by 1/n (NCCL's ncclAvg), rounding each product: the kernels then
// sum the products in their own order (ring, tree) and the rounding of an inexact sum would depend on it. So an avg
// input is k * n, whose product is exactly k (checked here through the host backend's own premul), and every sum of
// products is an exact small integer in any order.
void fill_host(std::vector<char>& buf, DType dt, int r, size_t count, RedOp op, int P) {
  const size_t es = gpucoll::dtype_size(dt);
  buf.resize(count * es);
  unsigned char scale[8];
  const bool pre = op == RedOp::kAvg && gpucoll::host::avg_scalar_bytes(dt, P, scale);
  gpucoll::dispatch_dtype(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = typename gpucoll::Acc<T>::type;
    T* p = reinterpret_cast<T*>(buf.data());
    for (size_t i = 0; i < count; ++i) {
      const double k = value(r, i, op);
      p[i] = gpucoll::Acc<T>::store(static_cast<A>(pre ? k * P : k));
      T product;
      if (pre) gpucoll::host::premul_copy(&product, &p[i], 1, dt, scale);
      if (pre && static_cast<double>(gpucoll::Acc<T>::load(product)) != k) {
        std::fprintf(stderr, "fill_host: %g * %d times 1/%d is not exactly %g in %s\n", k, P, P, k,
                     gpucoll::dtype_name(dt));
        std::exit(2);
      }
    }
    return 0;
  });
}

// One element as a number, for failure messages.
std::string shown(const void* p, DType dt) {
  double v = 0;
  gpucoll::dispatch_dtype(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T x;
    std::memcpy(&x, p, sizeof(T));
    v = static_cast<double>(gpucoll::Acc<T>::load(x));
    return 0;
  });
  std::ostringstream s;
  s << v;
  return s.str();
}

struct Case {
  Algo algo;
  DType dtype;
  RedOp op;
  size_t count;
  size_t misalign;  // elements: inputs and outputs start this far into their allocations
  bool registered;
  bool in_place;
};

std::string describe(const Case& c, int P) {
  std::ostringstream s;
  s << gpucoll::custom::algo_name(c.algo) << " " << gpucoll::dtype_name(c.dtype) << " "
    << gpucoll::redop_name(c.op) << " P=" << P << " count=" << c.count << " misalign=" << c.misalign
    << (c.registered ? " registered" : "") << (c.in_place ? " in-place" : "");
  return s.str();
}

class World {
 public:
  World(int P, size_t half_bytes, double timeout_s) : P_(P) {
    for (int r = 0; r < P; ++r) comms_.push_back(std::make_unique<CustomComm>(r, P, 0, half_bytes, timeout_s));
    std::vector<CustomComm*> raw;
    for (auto& c : comms_) raw.push_back(c.get());
    for (auto& c : comms_) c->connect_local(raw);
    for (int r = 0; r < P; ++r) streams_.push_back(std::make_unique<gpucoll::cuda::Stream>(0));
  }
  // After a device fault every CUDA call fails (the sticky error), the ones cleanup makes included: the failure was
  // reported where it happened, and a destructor must not throw.
  ~World() {
    for (auto& c : comms_) {
      try {
        c->synchronize();
      } catch (const std::exception&) {
      }
    }
    for (auto& c : comms_) {
      try {
        c->close();
      } catch (const std::exception&) {
      }
    }
  }

  // Rank 0 alone calls (its peers never arrive): every block of its kernel must give up after the timeout and
  // set timed_out instead of hanging. Returns failure descriptions.
  std::vector<std::string> run_missing_peers(size_t count) {
    void* in = alloc(count * 4, false);
    check(cudaMemset(in, 0, count * 4));
    comms_[0]->all_reduce(in, in, count, DType::kF32, RedOp::kSum, Algo::kOneShot, streams_[0]->get());
    streams_[0]->synchronize();
    std::vector<std::string> fails;
    if (comms_[0]->timed_out() == 0) fails.push_back("rank 0 did not time out");
    free_buffer(in);
    return fails;
  }

  // One call of `c` on every rank; returns failure descriptions.
  std::vector<std::string> run(const Case& c) {
    const size_t es = gpucoll::dtype_size(c.dtype);
    const size_t bytes = (c.count + c.misalign) * es;
    std::vector<std::vector<char>> host(P_);
    std::vector<void*> in(P_), out(P_);
    for (int r = 0; r < P_; ++r) {
      fill_host(host[r], c.dtype, r, c.count, c.op, P_);
      in[r] = alloc(bytes, c.registered);
      out[r] = c.in_place ? in[r] : alloc(bytes, false);
      char* pin = static_cast<char*>(in[r]) + c.misalign * es;
      check(cudaMemset(out[r], 0xa7, bytes));  // sentinel everywhere, the head included
      check(cudaMemcpy(pin, host[r].data(), c.count * es, cudaMemcpyHostToDevice));
    }
    if (c.registered) {
      std::vector<uintptr_t> ptrs;
      for (int r = 0; r < P_; ++r) ptrs.push_back(reinterpret_cast<uintptr_t>(in[r]) + c.misalign * es);
      for (int r = 0; r < P_; ++r) comms_[r]->register_local(ptrs[r], c.count * es, ptrs);
    }
    // Piece i of every rank before piece i + 1 of any (as gpucoll.testing.VirtualRanks does).
    size_t pieces = 1;
    for (size_t piece = 0; piece < pieces; ++piece) {
      for (int r = 0; r < P_; ++r) {
        const char* pin = static_cast<const char*>(in[r]) + c.misalign * es;
        char* pout = static_cast<char*>(out[r]) + c.misalign * es;
        pieces = comms_[r]->all_reduce(pin, pout, c.count, c.dtype, c.op, c.algo, streams_[r]->get(), 0,
                                       static_cast<int64_t>(piece));
      }
    }
    for (auto& s : streams_) s->synchronize();
    std::vector<std::string> fails;
    for (int r = 0; r < P_; ++r) {
      if (comms_[r]->timed_out() != 0) fails.push_back("rank " + std::to_string(r) + " timed out");
    }
    // The reference: the host backend's arithmetic. avg as NCCL's: floating inputs pre-multiplied by 1/n (the host
    // backend's copy-in), summed, integer sums divided.
    std::vector<char> want(c.count * es);
    std::vector<std::vector<char>> scaled(P_);
    std::vector<const void*> srcs;
    unsigned char scale[8];
    const bool pre = c.op == RedOp::kAvg && gpucoll::host::avg_scalar_bytes(c.dtype, P_, scale);
    for (int r = 0; r < P_; ++r) {
      if (pre) {
        scaled[r].resize(c.count * es);
        gpucoll::host::premul_copy(scaled[r].data(), host[r].data(), static_cast<int64_t>(c.count), c.dtype, scale);
      }
      srcs.push_back(pre ? scaled[r].data() : host[r].data());
    }
    gpucoll::host::reduce_multi(want.data(), srcs.data(), P_, false, static_cast<int64_t>(c.count), c.dtype, c.op);
    if (c.op == RedOp::kAvg) gpucoll::host::avg_divide(want.data(), static_cast<int64_t>(c.count), c.dtype, P_);
    std::vector<char> got(bytes);
    for (int r = 0; r < P_ && fails.empty(); ++r) {
      check(cudaMemcpy(got.data(), out[r], bytes, cudaMemcpyDeviceToHost));
      // The bytes before the output (misaligned start) must still hold the sentinel... unless in place, where
      // they are the input's untouched head.
      for (size_t b = 0; b < c.misalign * es && !c.in_place; ++b) {
        if (static_cast<unsigned char>(got[b]) != 0xa7) {
          fails.push_back("rank " + std::to_string(r) + " wrote before its output");
          break;
        }
      }
      for (size_t i = 0; i < c.count; ++i) {
        if (std::memcmp(got.data() + (c.misalign + i) * es, want.data() + i * es, es) != 0) {
          fails.push_back("rank " + std::to_string(r) + " element " + std::to_string(i) + " of " +
                          std::to_string(c.count) + " is wrong: " +
                          shown(got.data() + (c.misalign + i) * es, c.dtype) + " instead of " +
                          shown(want.data() + i * es, c.dtype));
          break;
        }
      }
    }
    for (int r = 0; r < P_; ++r) {
      if (!c.registered) free_buffer(in[r]);  // registered buffers stay alive (registration is by address)
      if (!c.in_place) free_buffer(out[r]);
    }
    return fails;
  }

 private:
  static void check(cudaError_t e) {
    if (e != cudaSuccess) {
      std::fprintf(stderr, "CUDA error %s\n", cudaGetErrorName(e));
      std::exit(2);
    }
  }
  void* alloc(size_t bytes, bool keep) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes));
    if (keep) kept_.push_back(p);
    return p;
  }
  void free_buffer(void* p) { check(cudaFree(p)); }

  int P_;
  std::vector<std::unique_ptr<CustomComm>> comms_;
  std::vector<std::unique_ptr<gpucoll::cuda::Stream>> streams_;
  std::vector<void*> kept_;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ranks = {2, 3, 4, 5, 8};
  std::vector<Algo> algos = {Algo::kOneShot, Algo::kTwoShot, Algo::kRing, Algo::kTree};
  bool quick = false, tsan = false, missing_peer = false;
  std::vector<DType> only_dtypes;  // --dtypes=float32,bfloat16,... (or "all"): in place of the mode's own
  // 4 SMs x 4 blocks by default: kernels of several blocks per rank up to P=4. Staging halves of 1 KiB (pieces
  // from 256 float32 elements up): messages of several pieces, and stale flag rows when the grid changes.
  gpucoll_emu_config cfg;
  gpucoll_emu_default_config(&cfg);
  cfg.sms = 4;
  cfg.blocks_per_sm = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--ranks=", 0) == 0) {
      ranks.clear();
      for (const auto& s : split(a.substr(8))) ranks.push_back(std::atoi(s.c_str()));
    } else if (a.rfind("--algos=", 0) == 0) {
      algos.clear();
      for (const auto& s : split(a.substr(8))) {
        Algo x;
        if (!gpucoll::custom::parse_algo(s, &x)) return 2;
        algos.push_back(x);
      }
    } else if (a.rfind("--dtypes=", 0) == 0) {
      const std::string list = a.substr(9) == "all" ? "float32,float16,bfloat16,float64,int32" : a.substr(9);
      for (const auto& s : split(list)) {
        DType x;
        if (!gpucoll::parse_dtype(s.c_str(), &x)) return 2;
        only_dtypes.push_back(x);
      }
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--tsan") {
      tsan = true;
    } else if (a == "--missing-peer") {
      missing_peer = true;
    } else if (a.rfind("--shuffle=", 0) == 0) {  // seeded thread order (GPUCOLL_EMU_SHUFFLE_THREADS), this seed
      cfg.shuffle_threads = 1;
      cfg.seed = std::strtoull(a.c_str() + 10, nullptr, 10);
    } else if (a.rfind("--sms=", 0) == 0) {
      cfg.sms = std::atoi(a.c_str() + 6);
    } else if (a.rfind("--bps=", 0) == 0) {
      cfg.blocks_per_sm = std::atoi(a.c_str() + 6);
    }
  }
  if (gpucoll_emu_configure(&cfg) != cudaSuccess) return 2;
  if (missing_peer) {
    World w(2, 256 << 10, 0.3);
    const std::vector<std::string> fails = w.run_missing_peers(40009);  // several blocks
    for (const std::string& f : fails) std::printf("FAIL missing peer: %s\n", f.c_str());
    std::printf("missing peer: %s\n", fails.empty() ? "timed out as it must" : "FAILED");
    return fails.empty() ? 0 : 1;
  }
  const std::vector<DType> dtypes =
      !only_dtypes.empty() ? only_dtypes
      : tsan ? std::vector<DType>{DType::kF32}
      : quick ? std::vector<DType>{DType::kF32, DType::kBF16}
            : std::vector<DType>{DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI32};
  const std::vector<RedOp> ops =
      tsan ? std::vector<RedOp>{RedOp::kSum}
      : quick ? std::vector<RedOp>{RedOp::kSum, RedOp::kAvg}
            : std::vector<RedOp>{RedOp::kSum, RedOp::kMin, RedOp::kMax, RedOp::kAvg};
  // Two staging sizes per world size: 1 KiB halves (every message but the smallest runs in pieces of one block)
  // and 256 KiB halves (messages up to 256 KiB in one kernel of several blocks: rows of flags, end_call's count).
  struct Sizes {
    size_t half_bytes;
    std::vector<size_t> counts;
  };
  const std::vector<Sizes> sizes =
      tsan ? std::vector<Sizes>{{1024, {37, 1001}}, {256 << 10, {40009}}}
      : quick ? std::vector<Sizes>{{1024, {1, 37, 1001}}, {256 << 10, {4099, 40009}}}
            : std::vector<Sizes>{{1024, {1, 5, 37, 1001, 4099}}, {256 << 10, {4099, 16411, 40009}}};
  int cases = 0, failed = 0;
  try {
    for (int P : ranks) {
      for (const Sizes& sz : sizes) {
        World w(P, sz.half_bytes, 20.0);
        for (Algo algo : algos) {
          const bool can_register = algo == Algo::kOneShot || algo == Algo::kTwoShot;
          for (DType dt : dtypes) {
            for (RedOp op : ops) {
              for (size_t count : sz.counts) {
                for (int variant = 0; variant < 4; ++variant) {
                  Case c{algo, dt, op, count, variant == 1 ? size_t{3} : 0, variant >= 2 && can_register,
                         variant == 3 || (variant == 0 && count % 2 == 1)};
                  if (variant >= 2 && !can_register) continue;
                  if (quick && variant == 1) continue;
                  ++cases;
                  for (const std::string& f : w.run(c)) {
                    ++failed;
                    std::printf("FAIL %s: %s\n", describe(c, P).c_str(), f.c_str());
                  }
                }
              }
            }
          }
        }
      }
    }
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d cases, %d failures\n", cases, failed);
  return failed == 0 ? 0 : 1;
}
