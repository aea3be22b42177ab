// Cross-rank synchronisation of the custom kernels: epoch flags in the signal area (custom_allreduce.h).
//
// The protocol, per block b and barrier k of the call numbered `calls` (the same on every rank):
//   value = calls * kBarrierStride + k + 1
//   1. __syncthreads(): every thread of the block has finished its loads and stores of the step.
//   2. thread q (q < P) stores `value` into flag[b][rank] of rank q's signal area with st.release.sys.
//   3. thread q spins with ld.acquire.sys on flag[b][q] of this rank's own area until it is >= value.
//   4. __syncthreads(): the rest of the block proceeds only after all P acquires.
//
// Why each fence is where it is:
// - (1)+(2): the release is what makes this block's data writes (its slice of the staging buffer) visible to
//   rank q before q can see the flag. The writes were made by other threads of the block; the bar.sync orders
//   them before thread q's st.release in causality order, and PTX release is cumulative at the scope given,
//   so `.sys` covers readers on other GPUs and in other processes. The same release also orders this block's
//   earlier LOADS of peers' memory before the flag: a peer that sees the flag may overwrite what we read
//   (write-after-read across ranks), which is what the end barrier of one-shot relies on.
// - (3)+(4): the acquire pairs with the peer's release; bar.sync extends it to every thread of the block, so
//   all later loads of peer data observe the peer's writes. Peer data is then loaded with ld.global.cg
//   (peer_ops.cuh): it bypasses L1, which is not coherent, so no line cached by an earlier call can be stale.
// - No __threadfence_system() is needed on top: st.release.sys = fence.acq_rel.sys + store, and ld.acquire.sys
//   = load + fence, both at system scope (sm_70 and newer).
//
// Why epochs instead of set/reset flags: a flag that is set by the peer and reset by the waiter has two
// writers, and a reset can race the next call's set (back-to-back calls, CUDA graph replays). Epoch values
// only grow, each word has one writer, and "value >= expected" tolerates a peer that is already one barrier
// ahead (it cannot be further ahead: it would need our arrival at the next barrier).
// Why 64-bit words: the grid size varies with the message, so flag row b is only written by calls that have a
// block b; a row left alone while small calls run keeps an old value. With 32-bit epochs and a wrap-tolerant
// signed comparison, a row untouched for 2^31 / kBarrierStride = 33.5M calls (hours of small allreduces in
// tensor-parallel inference) would compare as AHEAD of the current epoch and let block b read peer data that
// is not there yet. 64-bit epochs do not wrap in any lifetime (2^58 calls).
//
// `calls` lives in device memory (Signals::calls) and is bumped by the last block of each kernel, so CUDA
// graph replays advance it exactly like eager launches (a host-side counter would be frozen into the graph).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/custom/kernels/custom_allreduce.h"
#include "backends/custom/kernels/sync_primitives.cuh"

namespace gpucoll::cuda::custom {

// Per-call state of one block.
struct Sync {
  Signals* self;
  PeerTable sigs;
  int rank;
  int nranks;
  uint64_t calls;
  uint64_t timeout_ns;
  bool skip;  // a later piece of a call whose first piece was mismatched: the kernel does nothing at all
  // The flight recorder's device half (CallRecord in custom_allreduce.h): this call's slot, or null when recording
  // is off; the ring, for the previous call's slot; whether this piece opens the record (the first) or ends it.
  CallRecord* rec;
  CallRecord* records;
  uint32_t capacity;
  bool opens, ends;
  uint64_t seq1;  // the call's signature number + 1, as CallRecord::seq holds it
};

// Opens this call's CallRecord (one thread, block 0 of the first piece): the fields first, then the number behind a
// device-scope fence. The host copies the ring with the copy engine, which reads through L2 as the SMs write to it,
// so a fence at GPU scope is what keeps a reader from pairing this number with an older call's fields; it costs
// one thread of one block a wait for its own few stores.
__device__ __forceinline__ void open_record(CallRecord* rec, uint64_t seq1, int nranks) {
  st_relaxed_sys(&rec->start_ns, global_timer_ns());
  st_relaxed_sys(&rec->end_ns, 0);
  st_relaxed_sys(&rec->flags, 0);
  for (int q = 0; q < nranks; ++q) {
    st_relaxed_sys(&rec->arrive_ns[q], 0);
    st_relaxed_sys(&rec->late_ns[q], kNoLateness);
  }
  __threadfence();
  st_relaxed_sys(&rec->seq, seq1);
}

// Reads this communicator's call number. Every block of the kernel reads the same value: the only write, by the
// last block to finish (end_call), happens after every block's read, through end_call's acq_rel count.
// A later piece of a call whose first piece found a mismatch is skipped whole, without a barrier and without
// counting: each rank may have cut the call into a different number of pieces (different counts or dtypes), and
// skipping them is what keeps every rank's `calls` equal afterwards (the first piece counted once everywhere).
__device__ __forceinline__ Sync begin_call(const AllReduceArgs& a) {
  __shared__ uint64_t calls;
  __shared__ bool skip;
  Signals* self = static_cast<Signals*>(a.sigs.ptr[a.rank]);
  // `calls` and `mismatch` are written only by this rank's previous kernels on the same stream, whose writes are
  // visible once they completed.
  const bool recording = a.records != nullptr && a.record_capacity > 0;
  CallRecord* rec = recording ? &a.records[a.sig.seq % a.record_capacity] : nullptr;
  if (threadIdx.x == 0) {
    calls = self->calls;
    skip = a.continuation && ld_relaxed_sys(&self->mismatch) == calls;
    if (recording && !a.continuation && blockIdx.x == 0) open_record(rec, a.sig.seq + 1, a.nranks);
  }
  __syncthreads();
  Sync s;
  s.self = self;
  s.sigs = a.sigs;
  s.rank = a.rank;
  s.nranks = a.nranks;
  s.calls = calls;
  s.timeout_ns = a.timeout_ns;
  s.skip = skip;
  s.rec = rec;
  s.records = a.records;
  s.capacity = a.record_capacity;
  s.opens = recording && !a.continuation;
  s.ends = recording && a.last_piece;
  s.seq1 = a.sig.seq + 1;
  return s;
}

enum class Wait { kArrived, kTimedOut, kMismatch };

// Step (3) of the protocol for one peer: spin until rank q's flag reaches `value`. `poll_mismatch` (barrier 0 of
// blocks b > 0) also gives up when block 0 found this call mismatched: such a call may give rank q fewer blocks,
// so block b's partner may never come, while block 0 exists in every call of every rank.
__device__ __forceinline__ Wait wait_flag(const Sync& s, const uint64_t* mine, uint64_t value, int q, uint32_t k,
                                          bool poll_mismatch) {
  uint64_t start = 0;
  uint32_t spins = 0;
  while (ld_acquire_sys(mine) < value) {
    ++spins;
    // A relaxed load that orders nothing: a block that sees the verdict only leaves, reading no peer data.
    if (poll_mismatch && (spins & 63u) == 0 && ld_relaxed_sys(&s.self->mismatch) == s.calls + 1) {
      return Wait::kMismatch;
    }
    // The timer is read every 1024 spins only: %globaltimer costs about as much as a flag load.
    if (s.timeout_ns != 0 && (spins & 1023u) == 0) {
      const uint64_t now = global_timer_ns();
      // A wait that already gave up (this call or an earlier one) makes every later wait give up at once.
      // A relaxed atomic load, not a volatile one: other blocks write the word (atomicMax) meanwhile, and a
      // plain (volatile) load racing an atomic is a data race in the C++ model, which is how the emulated
      // device checks this code. (Found by ThreadSanitizer, tests/emulation/test_tsan.py.)
      if (ld_relaxed_sys(&s.self->timed_out) != 0) return Wait::kTimedOut;
      if (start == 0) {
        start = now;
      } else if (now - start > s.timeout_ns) {
        // Give up rather than hang: the host finds timed_out set and raises, naming the ranks in late_ranks;
        // the data of this call is garbage.
        atomicOr(&s.self->late_ranks, 1u << q);
        atomicMax(&s.self->timed_out, k + 1);
        return Wait::kTimedOut;
      }
    }
  }
  return Wait::kArrived;
}

__device__ __forceinline__ void barrier(const Sync& s, uint32_t k) {
  const uint64_t value = s.calls * kBarrierStride + k + 1;
  __syncthreads();  // (1) the block's work of the step is done
  const int q = static_cast<int>(threadIdx.x);
  if (q < s.nranks) {
    Signals* peer = static_cast<Signals*>(s.sigs.ptr[q]);
    st_release_sys(&peer->flag[blockIdx.x][s.rank], value);          // (2) publish it to rank q
    wait_flag(s, &s.self->flag[blockIdx.x][q], value, q, k, false);  // (3) wait for rank q
  }
  __syncthreads();  // (4) nobody reads peer data before all P acquires
}

// The straggler report's exchange (CallRecord::late_ns), piggybacked on barrier 0 of block 0: the thread that
// signals rank q also hands it this rank's view of its previous recorded call, before the release that carries
// the signature.
__device__ __forceinline__ void send_view(const Sync& s, Signals* peer, unsigned half) {
  for (int x = 0; x < s.nranks; ++x) peer->view[half][s.rank][x] = s.self->my_view[x];
  peer->view_seq[half][s.rank] = s.self->my_view_seq;
}

// After barrier 0 of block 0 (every rank's view is here, ordered by the flags and extended to the block by (4)):
// thread x settles rank x's lateness at the previous recorded call, the largest lateness any rank saw, into that
// call's record when every rank's view is of the same call; then stores this rank's view of this call, for the
// next one to carry. A rank that timed out leaves no view (its flags never came), so nothing is settled from it.
__device__ __forceinline__ void settle_views(const Sync& s, unsigned half, const uint64_t* seen) {
  const int x = static_cast<int>(threadIdx.x);
  if (x < s.nranks) {
    const uint64_t of = s.self->view_seq[half][0];
    bool same = of != 0;
    uint64_t late = 0;
    for (int r = 0; r < s.nranks; ++r) {
      same = same && s.self->view_seq[half][r] == of;
      late = s.self->view[half][r][x] > late ? s.self->view[half][r][x] : late;
    }
    if (same) {
      CallRecord* prev = &s.records[(of - 1) % s.capacity];
      if (ld_relaxed_sys(&prev->seq) == of) st_relaxed_sys(&prev->late_ns[x], late);
    }
    const uint64_t mine = seen[s.rank];
    s.self->my_view[x] = seen[x] > mine ? seen[x] - mine : 0;
  }
  if (x == 0) {
    bool whole = true;
    for (int q = 0; q < s.nranks; ++q) whole = whole && seen[q] != 0;
    s.self->my_view_seq = whole ? s.seq1 : 0;
  }
}

// Barrier 0, carrying the call's signature (check/call_sig.h): ranks pair calls by counting, so nothing else
// notices that they made different calls, and a different count or algorithm would read and write the wrong
// bytes here and put the flags of every later call out of step. Thread q stores this rank's signature into rank
// q's area before the release of step (2), and compares rank q's (in this rank's area) after the acquire of step
// (3): the flag orders the signature like any staged data. Every block compares all P signatures, so a matched
// call waits for nothing more than a plain barrier 0.
// Returns false when some rank's call differs. Nothing before barrier 0 writes anything but this rank's own
// staging half, so no block of any rank has then touched a peer's data or `out`; the caller goes straight to
// end_call, which keeps every rank's `calls` in step, and the communicator stays usable. Block 0 records the P
// signatures and the verdict for the host (CustomComm::check_calls) and for blocks b > 0 still waiting.
__device__ __forceinline__ bool open_call(const Sync& s, const AllReduceArgs& a) {
  __shared__ uint32_t verdict;  // bit 0: some rank's signature differs; bit 1: released by block 0's verdict
  const uint64_t value = s.calls * kBarrierStride + 1;
  const unsigned b = blockIdx.x;
  const unsigned half = static_cast<unsigned>(s.calls & 1u);
  const int q = static_cast<int>(threadIdx.x);
  __shared__ uint64_t seen[kMaxRanks];  // block 0 of a recorded call: when each rank's flag came (0: never)
  const bool views = b == 0 && s.opens;
  if (q == 0) verdict = 0;
  __syncthreads();  // (1)
  if (q < s.nranks) {
    Signals* peer = static_cast<Signals*>(s.sigs.ptr[q]);
    if (a.check) peer->sig[b][half][s.rank] = a.sig;
    if (views) send_view(s, peer, half);
    st_release_sys(&peer->flag[b][s.rank], value);  // (2)
    const Wait w = wait_flag(s, &s.self->flag[b][q], value, q, 0, a.check && b > 0);  // (3)
    if (views) {
      seen[q] = w == Wait::kArrived ? global_timer_ns() : 0;
      st_relaxed_sys(&s.rec->arrive_ns[q], seen[q]);
    }
    if (w == Wait::kMismatch) {
      atomicOr(&verdict, 2u);
    } else if (w == Wait::kArrived && a.check && !algo::call_sig_equal(s.self->sig[b][half][q], a.sig)) {
      atomicOr(&verdict, 1u);
    }
  }
  __syncthreads();  // (4)
  if (views) settle_views(s, half, seen);
  if (verdict == 0) return true;
  if (b == 0) {
    if (q < s.nranks) s.self->bad[q] = s.self->sig[0][half][q];
    __syncthreads();
    if (q == 0) {
      s.self->mismatches += 1;
      st_relaxed_sys(&s.self->mismatch, s.calls + 1);
    }
  }
  return false;
}

// The last block to finish bumps `calls` for the next kernel, resets the count, and ends the call's record. Plain
// stores suffice for the next kernel (same stream: it starts after this one completed), but not within this kernel:
// other blocks read `calls` in begin_call and incremented blocks_done, and with a relaxed count (atomicAdd) nothing
// orders those accesses before the last block's stores. Under the PTX (and C++) memory model that is a data race on
// both words; in principle a block could even read the bumped `calls` (load buffering). The count is therefore an
// acq_rel read-modify-write at device scope: each block's increment releases its thread 0's earlier accesses (its
// begin_call read included), and the last block's increment acquires every earlier one (they form one release
// sequence), so its stores happen after all of them. (Found by ThreadSanitizer on the emulated device,
// tests/emulation/test_tsan.py.)
__device__ __forceinline__ void end_call(const Sync& s) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t done = fetch_add_acq_rel(&s.self->blocks_done, 1u);
    if (done == gridDim.x - 1) {
      s.self->blocks_done = 0;
      s.self->calls = s.calls + 1;
      // The call ends with its last piece, or with this one when it was found mismatched (its later pieces skip).
      if (s.rec != nullptr) {
        const bool mismatched = ld_relaxed_sys(&s.self->mismatch) == s.calls + 1;
        if (s.ends || mismatched) {
          const uint64_t flags = (ld_relaxed_sys(&s.self->timed_out) != 0 ? kRecordTimedOut : 0) |
                                 (mismatched ? kRecordMismatch : 0);
          st_relaxed_sys(&s.rec->flags, flags);
          st_relaxed_sys(&s.rec->end_ns, global_timer_ns());
        }
      }
    }
  }
}

}  // namespace gpucoll::cuda::custom
