// Which elements a block of the custom kernels owns: the chunk and slice arithmetic of kernels/peer_ops.cuh, as
// host-and-device functions so that the kernels and the CPU tests (through gpucoll._C.custom_slice) run the very
// same code. The "why" of slices is in peer_ops.cuh.
#pragma once

#include <cstddef>
#include <cstdint>

#include "algo/schedule.h"
#include "core/macros.h"

namespace gpucoll::custom {

struct Range {
  size_t begin;
  size_t count;
};

// Chunk c of `nchunks` over `count` elements: the balanced split of algo/schedule.h (same as the host backend).
GPUCOLL_HD GPUCOLL_INLINE Range chunk_range(size_t count, int nchunks, int c) {
  const size_t b = static_cast<size_t>(algo::chunk_begin(static_cast<int64_t>(count), nchunks, c));
  const size_t e = static_cast<size_t>(algo::chunk_begin(static_cast<int64_t>(count), nchunks, c + 1));
  return Range{b, e - b};
}

// Block b's (of `nblocks`) slice of a chunk: a balanced share in whole packs of `elems_per_pack` elements, the last
// slices taking the remainder (absolute offsets, like the chunk's).
GPUCOLL_HD GPUCOLL_INLINE Range block_slice_of(Range chunk, size_t elems_per_pack, int nblocks, int b) {
  const size_t units = (chunk.count + elems_per_pack - 1) / elems_per_pack;
  const size_t ub = static_cast<size_t>(algo::chunk_begin(static_cast<int64_t>(units), nblocks, b));
  const size_t ue = static_cast<size_t>(algo::chunk_begin(static_cast<int64_t>(units), nblocks, b + 1));
  size_t begin = ub * elems_per_pack, end = ue * elems_per_pack;
  if (begin > chunk.count) begin = chunk.count;
  if (end > chunk.count) end = chunk.count;
  return Range{chunk.begin + begin, end - begin};
}

}  // namespace gpucoll::custom
