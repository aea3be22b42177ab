#include "backends/custom/launch_shape.h"

#include "core/error.h"

namespace gpucoll::custom {

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kOneShot:
      return "oneshot";
    case Algo::kTwoShot:
      return "twoshot";
    case Algo::kRing:
      return "ring";
    case Algo::kTree:
      return "tree";
  }
  return "?";
}

bool parse_algo(const std::string& name, Algo* out) {
  if (name == "oneshot") *out = Algo::kOneShot;
  else if (name == "twoshot") *out = Algo::kTwoShot;
  else if (name == "ring") *out = Algo::kRing;
  else if (name == "tree" || name == "dbt") *out = Algo::kTree;
  else return false;
  return true;
}

// Where the auto thresholds come from: NOT measured on a GPU yet. They are the crossover points vLLM's custom
// allreduce ships for NVLink machines (one-shot up to 512 KiB at 2-4 ranks and 256 KiB at 8; two-shot above),
// which fit the cost model of algo/one_shot.h and algo/two_shot.h: one-shot pulls (P-1)N bytes in one step,
// two-shot 2(P-1)/P*N in two, so one-shot's window shrinks as P grows. Ring and tree are never chosen
// automatically: on an all-to-all fabric two-shot moves the ring's volume with 2 synchronisations instead of
// 2(P-1), and the tree moves more. They exist to run the schedules of algo/ on the GPU and are picked by name.
Algo choose_algo(size_t bytes, int nranks) {
  const size_t one_shot_max = nranks <= 2 ? (size_t{1} << 20) : nranks <= 4 ? (size_t{512} << 10) : (size_t{256} << 10);
  return bytes <= one_shot_max ? Algo::kOneShot : Algo::kTwoShot;
}

// Launch shape. None of this is measured yet (no GPU where it was written); it follows the hardware:
// - 512 threads: each thread moves 16-byte packs, so a block covers 8 KiB per pass; vLLM's custom allreduce
//   uses the same block size on A100/H100. Fewer, fuller blocks also mean fewer flags per barrier.
// - blocks: one per 8 KiB pass of the bytes a block row touches (the whole message for one-shot, one chunk per
//   step for the others), at least 1, at most min(kMaxBlocks, SM count, max_blocks). One block per SM at most:
//   blocks spin on flags, and two spinning blocks on one SM only share its load/store path. The per-call cap
//   for virtual ranks comes from max_blocks_per_rank.
// A small message gets one block: its cost is the barrier round trip (a few microseconds), not bandwidth.
LaunchShape choose_launch_shape(Algo algo, size_t bytes, int nranks, int sms, int max_blocks) {
  LaunchShape s;
  s.threads = kThreads;
  const size_t per_pass = static_cast<size_t>(kThreads) * 16;
  const int P = nranks > 0 ? nranks : 1;
  size_t row_bytes = bytes;  // bytes one block row moves per step
  switch (algo) {
    case Algo::kOneShot:
      break;
    case Algo::kTwoShot:
    case Algo::kRing:
      row_bytes = bytes / static_cast<size_t>(P);
      break;
    case Algo::kTree:
      row_bytes = bytes / 2;
      break;
  }
  size_t want = (row_bytes + per_pass - 1) / per_pass;
  size_t cap = kMaxBlocks;
  if (sms > 0 && static_cast<size_t>(sms) < cap) cap = static_cast<size_t>(sms);
  if (max_blocks > 0 && static_cast<size_t>(max_blocks) < cap) cap = static_cast<size_t>(max_blocks);
  if (want > cap) want = cap;
  s.blocks = want < 1 ? 1 : static_cast<int>(want);
  return s;
}

int max_blocks_per_rank(int co_resident_ranks, int sms, int blocks_per_sm) {
  if (co_resident_ranks < 1 || sms < 1 || blocks_per_sm < 1) return 0;
  const int64_t total = static_cast<int64_t>(sms) * blocks_per_sm;
  const int64_t each = total / co_resident_ranks;
  return static_cast<int>(each < kMaxBlocks ? each : kMaxBlocks);
}

void check_residency(int nranks, int blocks, int sms, int blocks_per_sm) {
  const int64_t need = static_cast<int64_t>(nranks) * blocks;
  const int64_t have = static_cast<int64_t>(sms) * blocks_per_sm;
  if (need <= have && blocks >= 1) return;
  GPUCOLL_INVALID_ARG(nranks, " virtual ranks x ", blocks, " blocks = ", need,
                      " blocks must all be resident on the GPU at once (they spin on each other's flags), but it "
                      "holds ",
                      have, " (", sms, " SMs x ", blocks_per_sm, " blocks of ", kThreads,
                      " threads per SM); use fewer virtual ranks (at most ", have, ")");
}

size_t piece_elems(size_t half_bytes, size_t elem_size) {
  if (elem_size == 0) return 0;
  const size_t packs = half_bytes / 16;
  return packs * 16 / elem_size;
}

}  // namespace gpucoll::custom
