// The signature of a collective call: what every rank must agree on for its calls to be one collective.
//
// Ranks pair their calls by counting (the k-th collective of each rank is one collective), so nothing in a
// schedule notices when ranks make different calls: a different count runs a different number of pieces, a
// different algorithm or root waits on different peers, and the step counters go out of step for every later
// call. Each executor therefore carries the signature in the synchronisation its schedule already does and
// compares the signatures of every rank before it moves data:
//  * host backend (csrc/backends/host/): written next to the step counter that the copy-in step publishes;
//    every rank waits for every rank's copy-in step of the first piece, then compares (host_comm.cc).
//  * custom kernels (backends/custom/kernels/peer_sync.cuh, open_call): the host builds the signature of the whole
//    call (its total count, not a piece's) and passes it in the kernel's arguments. Every block's barrier 0
//    carries it: thread q stores it into rank q's sig[b][calls & 1][rank] before its release of the flag, and
//    compares rank q's after its acquire. Blocks b > 0 also give up waiting when block 0 found a mismatch (a mismatched count may give the
//    peer fewer blocks), so a matched call waits for nothing more than before. On a mismatch no block touches
//    peer data or the output, every block goes to end_call (the call still counts once, so epochs stay in step),
//    later pieces of the call are skipped whole, and block 0 records the P signatures for the host, which raises
//    call_mismatch_message() where it reads timed_out (CustomComm::check_calls).
//  * NCCL (GPUCOLL_DEBUG_CHECKS, gpucoll/_call_check.py): NCCL's kernels cannot carry it; the signatures go
//    through the rendezvous store before each call instead, which costs a round trip, so it is off by default.
// A mismatch is found by every rank from the same table, before any rank touched user memory or advanced past
// the first step, so every rank raises the same InvalidArgument and the communicator stays usable.
//
// Plain data, no STL: it is built on the host, copied into shared or peer memory and compared in device code.
// Matching calls produce the same bytes on every rank except `flags`, which only annotates the message.
#pragma once

#include <cstdint>

#include "algo/schedule.h"
#include "core/macros.h"

namespace gpucoll::algo {

constexpr uint8_t kSigNone = 0xFF;      // field not part of this call (op of a broadcast, algo under NCCL)
constexpr uint8_t kSigBarrier = 0x0F;   // `coll` of a barrier (past every Coll)
constexpr uint8_t kSigPremulSum = 0xFE; // `op` of a premul_sum (a sum, but not interchangeable with one)
constexpr uint8_t kSigAutoAlgo = 1;     // flags: the algorithm was chosen by 'auto' (said in the message)

struct CallSig {
  int64_t count;        // elements: the vector (all_reduce, broadcast, reduce), the per-rank block otherwise
  uint32_t seq;         // the call's number among the communicator's collectives (low 32 bits)
  int32_t root;         // -1: not a rooted collective
  uint8_t coll;         // Coll, or kSigBarrier
  uint8_t dtype;        // DType; kSigNone for a barrier
  uint8_t op;           // RedOp or kSigPremulSum; kSigNone where the collective does not reduce
  uint8_t algo;         // index in algorithms() (registry.h); kSigNone where the backend picks (NCCL)
  uint16_t local_size;  // node size of hierarchical schedules; 0 where the algorithm ignores it
  uint8_t flags;        // kSigAutoAlgo; not compared
  uint8_t wire;         // Wire (core/quant.h): all_reduce(compress=...)'s format, 0 without
};
static_assert(sizeof(CallSig) == 24, "CallSig travels as three 64-bit words");

// Fields that do not apply to the collective are normalised (an all_gather's op is kSigNone whatever the caller
// passed), so that only differences that change the result count as mismatches.
GPUCOLL_HD inline CallSig make_call_sig(uint32_t seq, int32_t coll, int32_t dtype, int32_t op, int32_t root,
                                        int64_t count, int32_t algo, int32_t local_size, bool auto_algo) {
  CallSig s{};
  s.seq = seq;
  s.coll = static_cast<uint8_t>(coll);
  const bool barrier = coll == kSigBarrier;
  const Coll c = static_cast<Coll>(coll);
  s.count = barrier ? 0 : count;
  s.dtype = barrier ? kSigNone : static_cast<uint8_t>(dtype);
  s.op = !barrier && coll_reduces(c) ? static_cast<uint8_t>(op) : kSigNone;
  s.root = !barrier && coll_is_rooted(c) ? root : -1;
  s.algo = algo < 0 ? kSigNone : static_cast<uint8_t>(algo);
  s.local_size = static_cast<uint16_t>(local_size);
  s.flags = auto_algo ? kSigAutoAlgo : 0;
  s.wire = 0;
  return s;
}

GPUCOLL_HD inline bool call_sig_equal(const CallSig& a, const CallSig& b) {
  return a.count == b.count && a.seq == b.seq && a.root == b.root && a.coll == b.coll && a.dtype == b.dtype &&
         a.op == b.op && a.algo == b.algo && a.local_size == b.local_size && a.wire == b.wire;
}

}  // namespace gpucoll::algo
