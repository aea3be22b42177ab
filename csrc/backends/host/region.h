// Layout of the host backend's shared-memory region (private to csrc/backends/host/).
//
//   Header | Ctl[P] | PairCtl[P*P] | work buffers [P] | p2p slots [P*P][2]
//
// Control words sit on their own cache lines: each is written by exactly one rank, and sharing a line would
// make every write invalidate its neighbours' readers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "backends/host/sync.h"

namespace gpucoll::host {

constexpr uint64_t kRegionMagic = 0x67707563'6f6c6c32ull;  // "gpucoll2"
constexpr size_t kPageAlign = 4096;
constexpr int kP2PSlots = 2;  // double buffering: the sender fills one slot while the receiver drains the other

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct RegionHeader {
  uint64_t magic;
  int32_t nranks;
  int32_t reserved;
  uint64_t buffer_bytes;
  uint64_t slot_bytes;
  std::atomic<uint32_t> attached;  // ranks attached so far
};

// Descriptor of a collective for GPUCOLL_DEBUG_CHECKS: ranks compare these before running it.
struct OpDesc {
  int32_t coll;
  int32_t dtype;
  int32_t op;
  int32_t root;
  int64_t count;
  uint64_t seq;
};

struct Ctl {
  WaitWord done;  // schedule steps completed; peers wait on it
  alignas(64) std::atomic<uint64_t> op_seq;  // collectives entered, for "who had not reached it" reports
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> broken;  // this rank abandoned a collective: peers fail fast instead of timing out
  // Why it did, written before `broken` is set: the error code and the rank it blamed (-1: none). A rank that
  // waits on a broken peer reports that root cause, so a dead rank is named by every survivor, not only by
  // its neighbours.
  std::atomic<int32_t> fail_code;
  std::atomic<int32_t> fail_rank;
  OpDesc desc[2];                // GPUCOLL_DEBUG_CHECKS, alternating by op parity
};

// One per ordered pair (src -> dst). `sent` is written only by src, `acked` only by dst; both count pieces
// over the pair's lifetime, so neither side needs to reset anything between messages.
struct PairCtl {
  WaitWord sent;
  WaitWord acked;
};

// Header of a p2p slot, written by the sender before it publishes the piece.
struct SlotHeader {
  uint64_t message_bytes;  // total bytes of the message this piece belongs to
  uint64_t piece_bytes;
};
constexpr size_t kSlotHeaderBytes = 64;

struct RegionLayout {
  size_t ctl_offset, pair_offset, work_offset, slot_offset, total;
  RegionLayout(int nranks, size_t buffer_bytes, size_t slot_bytes) {
    const size_t P = static_cast<size_t>(nranks);
    ctl_offset = align_up(sizeof(RegionHeader), 128);
    pair_offset = align_up(ctl_offset + sizeof(Ctl) * P, 128);
    work_offset = align_up(pair_offset + sizeof(PairCtl) * P * P, kPageAlign);
    slot_offset = work_offset + buffer_bytes * P;
    total = slot_offset + (kSlotHeaderBytes + slot_bytes) * kP2PSlots * P * P;
  }
};

}  // namespace gpucoll::host
