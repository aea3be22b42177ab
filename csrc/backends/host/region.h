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

#include "check/call_sig.h"
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
  // Random, from the creator; an attaching rank compares it with the token it got through the rendezvous, so a
  // file that merely looks like a region (another job's, a stale fd number) is never used.
  uint64_t token[2];
  std::atomic<uint32_t> attached;  // ranks attached so far
};

// What a rank's failure says to the peers that wait on it (Ctl::fail_how).
enum class Blame : int32_t {
  kNone = 0,     // no rank to blame (an internal error, a local failure)
  kExited = 1,   // fail_rank's process was seen gone (kill(pid, 0) / its /proc state): evidence
  kWaited = 2,   // fail_rank holds the others up: it waits for no rank (or is the rank waited for)
  kClosed = 3,   // fail_rank closed the communicator while this rank was inside a collective
  kStalled = 4,  // fail_rank's wait was over but it did not go on: it is not running (stopped, starved)
};

struct Ctl {
  // The step counter and this rank's call signatures share one cache line: the owner writes the signature of
  // collective k, then publishes the copy-in step of its first piece, and a peer that sees the count reads the
  // signature from the line it has just loaded. Two signatures alternate by parity: the one of k+2 is written
  // only after every rank has passed the check of k+1, i.e. finished reading k's.
  alignas(64) WaitWord done;  // schedule steps completed; peers wait on it
  algo::CallSig sig[2];
  // When this rank entered collective k, in microseconds of CLOCK_MONOTONIC (one clock for every process of the
  // machine) modulo 2^32, in slot k & 1 under the signatures' rule. In the same line, so the straggler window
  // (core/stragglers.h) costs the peers no extra cache-line transfer; differences of 32-bit microseconds stay
  // exact for lateness up to 35 minutes.
  std::atomic<uint32_t> arrived_us[2];
  alignas(64) std::atomic<uint64_t> op_seq;  // collectives entered, for "who had not reached it" reports
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> broken;  // this rank abandoned a collective: peers fail fast instead of timing out
  // Why it did, written before `broken` is set: the error code, the rank it blamed (-1: none) and on what
  // grounds (Blame). A rank that waits on a broken peer reports that root cause, so a dead rank is named by
  // every survivor, not only by its neighbours, and a rank that was late learns that it was the one waited for.
  std::atomic<int32_t> fail_code;
  std::atomic<int32_t> fail_rank;
  std::atomic<int32_t> fail_how;
  // close() was called after this many collectives (0: open). A rank waiting in a later collective on this one
  // names the real cause, ranks that made different numbers of calls, instead of a timeout.
  std::atomic<uint64_t> closed_after;
  std::atomic<uint32_t> closed;
  // While this rank sleeps in a wait: (peer + 1) << 32 | the step count it waits for (kP2PWait: a p2p
  // counter); 0 otherwise. Peers that time out follow these to the rank that holds everyone up.
  std::atomic<uint64_t> waiting;
  // The last collective this rank completed (its number, kind, and when), and the kind of the one it is in (-1: a
  // barrier or none): what a timeout report says of a rank that did not arrive.
  alignas(64) std::atomic<uint64_t> done_seq;
  std::atomic<int64_t> done_ns;
  std::atomic<int32_t> done_coll;
  std::atomic<int32_t> in_coll;
  // Point-to-point batches begun and completed, and of the last one begun its kind (P2PKind), its peer (-2: several)
  // and when: "it is inside recv #3 from rank 0" for a rank that is busy with sends and receives.
  std::atomic<uint64_t> p2p_begun;
  std::atomic<uint64_t> p2p_done;
  std::atomic<int64_t> p2p_ns;
  std::atomic<int32_t> p2p_kind;
  std::atomic<int32_t> p2p_peer;
};
enum class P2PKind : int32_t { kSend = 0, kRecv = 1, kGroup = 2 };
constexpr uint32_t kP2PWait = 0xFFFFFFFFu;
static_assert(offsetof(Ctl, arrived_us) + sizeof(Ctl::arrived_us) <= 64,
              "done, the signatures and the arrival times must share a cache line");

// One per ordered pair (src -> dst). `sent` is written only by src, `acked` only by dst; both count pieces
// over the pair's lifetime, so neither side needs to reset anything between messages.
struct PairCtl {
  alignas(64) WaitWord sent;
  alignas(64) WaitWord acked;
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
