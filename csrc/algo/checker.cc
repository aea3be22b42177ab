#include "algo/checker.h"

#include <algorithm>
#include <sstream>

namespace gpucoll::algo {

namespace {

// A set of contributions as a bitset over (origin rank, origin chunk).
class Contrib {
 public:
  Contrib() = default;
  explicit Contrib(int bits) : words_((bits + 63) / 64, 0) {}
  void add(int bit) { words_[bit / 64] |= uint64_t{1} << (bit % 64); }
  bool empty() const {
    return std::all_of(words_.begin(), words_.end(), [](uint64_t w) { return w == 0; });
  }
  bool overlaps(const Contrib& o) const {
    for (size_t i = 0; i < words_.size(); ++i)
      if (words_[i] & o.words_[i]) return true;
    return false;
  }
  void unite(const Contrib& o) {
    for (size_t i = 0; i < words_.size(); ++i) words_[i] |= o.words_[i];
  }
  bool operator==(const Contrib& o) const { return words_ == o.words_; }

 private:
  std::vector<uint64_t> words_;
};

struct State {
  int P, C;
  std::vector<Contrib> work, out;  // [rank * C + chunk]
  Contrib& w(int r, int c) { return work[static_cast<size_t>(r * C + c)]; }
  Contrib& o(int r, int c) { return out[static_cast<size_t>(r * C + c)]; }
};

std::string describe(const Op& op) {
  std::ostringstream os;
  os << (op.action == Action::kCopy ? "copy" : "reduce") << " work[" << op.peer << "][" << op.src_chunk << "] -> "
     << (op.dst == Space::kWork ? "work" : "out") << "[" << op.dst_chunk << "]";
  return os.str();
}

}  // namespace

int64_t CheckResult::max_bytes_sent() const {
  return bytes_sent.empty() ? 0 : *std::max_element(bytes_sent.begin(), bytes_sent.end());
}
int64_t CheckResult::max_bytes_recv() const {
  return bytes_recv.empty() ? 0 : *std::max_element(bytes_recv.begin(), bytes_recv.end());
}

CheckResult check_schedule(const Algorithm& algorithm, const Params& p, int64_t nbytes) {
  CheckResult res;
  const int P = p.nranks;
  res.bytes_sent.assign(static_cast<size_t>(P), 0);
  res.bytes_recv.assign(static_cast<size_t>(P), 0);
  res.active_steps.assign(static_cast<size_t>(P), 0);
  auto fail = [&](const std::string& msg) {
    res.ok = false;
    res.error = msg;
    return res;
  };
  if (!algorithm.supports(p.coll)) return fail(std::string(algorithm.name) + " does not support " + coll_name(p.coll));
  if (const char* why = algorithm.unusable(p)) return fail(std::string("unusable: ") + why);
  const Shape shape = algorithm.shape(p);
  const int C = shape.nchunks;
  res.nsteps = shape.nsteps;
  res.nchunks = C;
  const bool blocked = coll_is_blocked(p.coll);
  if (C < 1) return fail("nchunks must be >= 1");
  if (blocked && C != P) return fail("blocked collectives need nchunks == nranks");
  auto chunk_len = [&](int c) -> int64_t {
    if (blocked) return nbytes / P;
    return chunk_begin(nbytes, C, c + 1) - chunk_begin(nbytes, C, c);
  };

  State s{P, C, std::vector<Contrib>(static_cast<size_t>(P * C), Contrib(P * C)),
          std::vector<Contrib>(static_cast<size_t>(P * C), Contrib(P * C))};
  auto token = [&](int rank, int chunk) { return rank * C + chunk; };
  const Coll coll = p.coll;
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c < C; ++c) {
      bool seeded = false;
      switch (coll) {
        case Coll::kAllReduce:
        case Coll::kReduce:
        case Coll::kReduceScatter:
        case Coll::kAllToAll:
          seeded = true;
          break;
        case Coll::kBroadcast:
        case Coll::kScatter:
          seeded = r == p.root;
          break;
        case Coll::kAllGather:
        case Coll::kGather:
          seeded = c == r;
          break;
      }
      if (seeded) s.w(r, c).add(token(r, c));
    }
  }

  std::vector<Op> ops(static_cast<size_t>(std::max(shape.max_ops, 1)));
  for (int t = 0; t < shape.nsteps; ++t) {
    const std::vector<Contrib> snapshot = s.work;
    std::vector<char> written(static_cast<size_t>(P * C), 0), read_remote(static_cast<size_t>(P * C), 0);
    for (int r = 0; r < P; ++r) {
      const int n = algorithm.step_ops(p, r, t, ops.data());
      if (n < 0 || n > shape.max_ops) {
        return fail("rank " + std::to_string(r) + " step " + std::to_string(t) + ": " + std::to_string(n) +
                    " ops exceed max_ops " + std::to_string(shape.max_ops));
      }
      bool active = false;
      for (int i = 0; i < n; ++i) {
        const Op& op = ops[static_cast<size_t>(i)];
        const std::string where = "rank " + std::to_string(r) + " step " + std::to_string(t) + " (" + describe(op) + ")";
        if (op.peer < 0 || op.peer >= P || op.src_chunk < 0 || op.src_chunk >= C || op.dst_chunk < 0 ||
            op.dst_chunk >= C) {
          return fail(where + ": index out of range");
        }
        if (!blocked && op.src_chunk != op.dst_chunk) return fail(where + ": chunk positions differ");
        // Peers are read as they were after the previous step; a rank sees its own earlier ops of this step.
        const Contrib& src = op.peer == r ? s.w(r, op.src_chunk) : snapshot[static_cast<size_t>(op.peer * C + op.src_chunk)];
        Contrib& dst = op.dst == Space::kWork ? s.w(r, op.dst_chunk) : s.o(r, op.dst_chunk);
        if (src.empty()) return fail(where + ": reads a chunk that holds no data yet");
        if (op.action == Action::kCopy) {
          dst = src;
        } else {
          if (dst.empty()) return fail(where + ": reduces into a chunk that holds no data yet");
          if (dst.overlaps(src)) return fail(where + ": a contribution would be counted twice");
          dst.unite(src);
        }
        if (op.dst == Space::kWork) written[static_cast<size_t>(r * C + op.dst_chunk)] = 1;
        if (op.peer != r) {
          read_remote[static_cast<size_t>(op.peer * C + op.src_chunk)] = 1;
          res.bytes_sent[static_cast<size_t>(op.peer)] += chunk_len(op.src_chunk);
          res.bytes_recv[static_cast<size_t>(r)] += chunk_len(op.src_chunk);
          active = true;
        }
      }
      if (active) ++res.active_steps[static_cast<size_t>(r)];
    }
    for (int i = 0; i < P * C; ++i) {
      if (written[static_cast<size_t>(i)] && read_remote[static_cast<size_t>(i)]) {
        return fail("step " + std::to_string(t) + ": rank " + std::to_string(i / C) + " writes chunk " +
                    std::to_string(i % C) + " while a peer reads it");
      }
    }
  }

  auto result = [&](int r, int c) -> Contrib& { return shape.result == Space::kWork ? s.w(r, c) : s.o(r, c); };
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c < C; ++c) {
      Contrib want(P * C);
      bool check = true;
      switch (coll) {
        case Coll::kAllReduce:
          for (int q = 0; q < P; ++q) want.add(token(q, c));
          break;
        case Coll::kReduce:
          check = r == p.root;
          for (int q = 0; q < P; ++q) want.add(token(q, c));
          break;
        case Coll::kReduceScatter:
          check = c == r;
          for (int q = 0; q < P; ++q) want.add(token(q, c));
          break;
        case Coll::kBroadcast:
          want.add(token(p.root, c));
          break;
        case Coll::kAllGather:
          want.add(token(c, c));
          break;
        case Coll::kGather:
          check = r == p.root;
          want.add(token(c, c));
          break;
        case Coll::kScatter:
          check = c == r;
          want.add(token(p.root, c));
          break;
        case Coll::kAllToAll:
          want.add(token(c, r));
          break;
      }
      if (check && !(result(r, c) == want)) {
        return fail(std::string(coll_name(coll)) + " with " + algorithm.name + ": rank " + std::to_string(r) +
                    " chunk " + std::to_string(c) + " does not hold the expected contributions at the end");
      }
    }
  }
  res.ok = true;
  return res;
}

}  // namespace gpucoll::algo
