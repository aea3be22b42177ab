// Host-side decisions of gpucoll's own allreduce kernels (kernels/{one_shot,two_shot,ring,tree}.cu beside this
// file): which algorithm, how many blocks x threads, and how many blocks each rank may use when several ranks share
// one GPU. Plain C++ with no CUDA header, so the CPU tests check exactly what the launchers use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpucoll::custom {

enum class Algo : int32_t { kOneShot = 0, kTwoShot = 1, kRing = 2, kTree = 3 };
constexpr int kNumAlgos = 4;

// Limits baked into the device data structures (backends/custom/kernels/custom_allreduce.h mirrors them).
constexpr int kMaxRanks = 8;    // peer tables hold 8 pointers; one-shot reads all P inputs per element
constexpr int kMaxBlocks = 64;  // rows of flags in the signal area, one per block index
constexpr int kThreads = 512;   // threads per block of every custom kernel (see launch_shape.cc)

const char* algo_name(Algo a);
// "oneshot", "twoshot", "ring", "tree" (also "dbt": the tree is the double binary tree of algo/). False when
// unknown.
bool parse_algo(const std::string& name, Algo* out);

struct LaunchShape {
  int blocks = 1;
  int threads = kThreads;
};

// The algorithm `algo="auto"` runs for a message of `bytes` over `nranks` ranks.
Algo choose_algo(size_t bytes, int nranks);

// Blocks x threads for one call. `sms` is the (smallest, across ranks) SM count; `max_blocks` caps the grid,
// e.g. the residency limit of virtual ranks (0: no cap beyond kMaxBlocks and sms). Every rank must compute the
// same shape from the same arguments: the signal flags pair block b of every rank with block b of its peers.
LaunchShape choose_launch_shape(Algo algo, size_t bytes, int nranks, int sms, int max_blocks = 0);

// Several ranks on one GPU, each spinning on flags its peers set: every block of every rank must be resident
// at once, or a spinning block can hold the SM a peer's block needs and nobody progresses. With
// `blocks_per_sm` resident blocks of the kernel per SM (occupancy calculator), `co_resident_ranks` ranks
// may use at most floor(sms * blocks_per_sm / co_resident_ranks) blocks each (never more than kMaxBlocks).
// Returns 0 when not even one block per rank fits.
int max_blocks_per_rank(int co_resident_ranks, int sms, int blocks_per_sm);

// Throws InvalidArgument naming the limit when `nranks` ranks of `blocks` blocks each cannot all be resident on
// one GPU of `sms` SMs holding `blocks_per_sm` blocks of the kernel each.
void check_residency(int nranks, int blocks, int sms, int blocks_per_sm);

// How a message of `count` elements is cut into pieces that fit one half of the staging buffer (`half_bytes`),
// rounded down to whole 16-byte packs so every piece after the first keeps the first one's alignment.
size_t piece_elems(size_t half_bytes, size_t elem_size);

}  // namespace gpucoll::custom
