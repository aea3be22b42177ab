// gpucoll's own allreduce kernels over peer memory: the data every kernel reads, and the host launchers
// (one_shot.cu, two_shot.cu, ring.cu, tree.cu). Plain C++ can include this header; it needs the CUDA include
// directory, which linking gpucoll_cuda provides. The host-side choices (algorithm, launch shape, residency)
// are in backends/custom/launch_shape.h; the peer memory and the communicator in backends/custom/cuda/.
//
// Model (the pull model of algo/schedule.h): every rank owns a staging buffer of two halves and a signal area,
// both in its own device memory and mapped into every peer (CUDA IPC, or plain pointers for virtual ranks in
// one process). Kernels only ever WRITE their own rank's memory and READ peers' memory after a flag says it
// is ready; see peer_sync.cuh for the flags and their memory ordering.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "check/call_sig.h"
#include "backends/custom/launch_shape.h"
#include "core/quant.h"
#include "core/types.h"

namespace gpucoll::cuda::custom {

using gpucoll::custom::kMaxBlocks;
using gpucoll::custom::kMaxRanks;
using gpucoll::custom::kThreads;

// One pointer per rank (unused entries null).
struct PeerTable {
  void* ptr[kMaxRanks];
};

// Barriers per call are numbered 0..kBarrierStride-1 (ring at 8 ranks uses 14).
constexpr uint32_t kBarrierStride = 64;
constexpr uint32_t kProbeMagic = 0x6770636cu;  // "gpcl": what the P2P probe expects in a peer's probe word

// A rank's signal area. Every field is a whole, naturally aligned 32- or 64-bit word with exactly one writer, so
// there are no sub-word races (the vLLM #2742/#2760 bug class: byte flags packed into one word, written by
// different ranks, lose each other's updates).
struct alignas(128) Signals {
  // flag[b][q]: written only by rank q's block b (one thread), read by this rank's block b. Values are epoch
  // counters, calls * kBarrierStride + barrier + 1, so they only grow: nothing is ever reset between calls,
  // and a waiter needs "at least my value" (a peer may already have moved one barrier further).
  // 64-bit so that a row some calls leave alone (they have fewer blocks) never looks ahead after a wrap.
  uint64_t flag[kMaxBlocks][kMaxRanks];
  // sig[b][calls & 1][q]: rank q's call signature, written by rank q's block b (thread `rank`) just before its
  // barrier-0 flag and read by this rank's block b after acquiring that flag (peer_sync.cuh, open_call). Two
  // halves by call parity, like the staging buffer, so a fast peer's next call never overwrites one still read.
  algo::CallSig sig[kMaxBlocks][2][kMaxRanks];
  // Local to this rank (peers never touch them):
  uint64_t calls;        // kernels of this communicator completed so far; read by every block at its start
  uint32_t blocks_done;  // blocks of the running kernel that finished; the last one bumps `calls`
  uint32_t timed_out;    // non-zero (1 + the barrier number that gave up) once a wait gave up; read by the host
  uint32_t late_ranks;   // bit q: a wait for rank q's flag gave up (the host names the ranks that never arrived)
  uint32_t probe;        // kProbeMagic ^ rank, written at set-up: peers read it to prove the mapping works
  // Calls whose ranks' signatures differed (open_call): `mismatch` is calls + 1 of the latest one (blocks b > 0
  // poll it while waiting for a peer's block that a mismatched call may not have), `mismatches` counts them, and
  // `bad` holds the P signatures of the latest one, in rank order. Read by the host where it reads timed_out.
  uint64_t mismatch;
  uint64_t mismatches;
  algo::CallSig bad[kMaxRanks];
  // Arrival views, for the straggler report (CallRecord::late_ns). view[calls & 1][q][x]: how long after its own
  // arrival rank q saw rank x's barrier-0 flag at rank q's previous recorded call, whose number + 1 is
  // view_seq[calls & 1][q]; rank q's block 0 (the thread that signals this rank) copies them here from its
  // `my_view` with its signature, before its barrier-0 release, so they arrive ordered by the flag like any staged
  // data. Two halves by kernel parity, as `sig`.
  uint64_t view[2][kMaxRanks][kMaxRanks];
  uint64_t view_seq[2][kMaxRanks];
  // Local: this rank's view of its latest recorded call (written by block 0 after barrier 0, read by the next
  // recorded call's block 0 on the same stream).
  uint64_t my_view[kMaxRanks];
  uint64_t my_view_seq;
};

// One allreduce as the device saw it on this rank: the device half of the flight recorder, in a ring of device
// memory that only this rank's kernels write and that the host copies out only when asked
// (backends/custom/cuda/kernel_trace.h). Slot (signature number) % capacity. Block 0 of a call's first piece opens
// the slot: it fills start_ns and resets the rest, then publishes `seq` behind a fence, so a reader that finds the
// number it expects never reads an older call's fields (the ring holds twice the host recorder's entries: a slot is
// rewritten only after the host has forgotten its previous call). Every later word has one writer and is whole
// alone: arrive_ns[q] (thread q of block 0, after its wait), end_ns and flags (the last block of the last piece),
// late_ns (the next recorded call's block 0).
struct CallRecord {
  uint64_t seq;       // the call's signature number + 1 (0: never opened)
  uint64_t start_ns;  // %globaltimer: block 0 of the first piece began
  uint64_t end_ns;    // ... the last block of the last piece finished (0: not yet)
  uint64_t flags;     // kRecordTimedOut, kRecordMismatch (set with end_ns)
  uint64_t arrive_ns[kMaxRanks];  // when block 0 saw rank q's barrier-0 flag (its own: this rank's arrival); 0: not
  // Rank q's lateness at this call against the first rank to arrive, in ns: the largest of every rank's view (a rank
  // sees q late by how much later than itself q arrived; the first rank to arrive sees everyone's whole lateness, and
  // no rank sees more). Needs no common clock across GPUs. Written when the next recorded call's barrier 0 has
  // brought every rank's view; kNoLateness until then.
  uint64_t late_ns[kMaxRanks];
};
constexpr uint64_t kRecordTimedOut = 1;
constexpr uint64_t kRecordMismatch = 2;
constexpr uint64_t kNoLateness = ~uint64_t{0};

struct AllReduceArgs {
  const void* in = nullptr;  // this rank's input (local)
  void* out = nullptr;       // this rank's output (local); may equal `in`
  size_t count = 0;
  DType dtype = DType::kF32;
  RedOp op = RedOp::kSum;
  int rank = 0;
  int nranks = 1;
  PeerTable bufs{};    // every rank's staging buffer: two halves of half_bytes each
  PeerTable sigs{};    // every rank's Signals
  // Device memory holding every rank's registered input for this call, or null: stage `in` through the
  // staging buffer. A pointer (not a value) so that a table filled after CUDA graph capture is seen by replays.
  const PeerTable* inputs = nullptr;
  size_t in_offset = 0;  // elements: where this call starts in every registered input (pieces of a long one)
  size_t half_bytes = 0;
  uint64_t timeout_ns = 0;  // a barrier wait gives up after this long (0: never) and sets Signals::timed_out
  int blocks = 1;
  int threads = kThreads;
  // The call's signature (whole call: every piece carries the same one), compared across ranks in barrier 0.
  algo::CallSig sig{};
  bool check = true;         // compare signatures (off only to measure what the comparison costs)
  bool continuation = false; // a piece after the first: skipped whole when the first piece was mismatched
  bool last_piece = true;    // the call's last piece: it ends the call's CallRecord
  Wire wire = Wire::kNone;   // launch_compressed: the wire format (core/quant.h)
  CallRecord* records = nullptr;  // this rank's ring of CallRecords (device memory), or null: record nothing
  uint32_t record_capacity = 0;
};

// Enqueue one allreduce on `stream`. count * dtype size must fit half_bytes (every algorithm may stage or hold
// its result there, registered input or not). Returns cudaErrorInvalidValue for a dtype/op without a
// kernel or a bad shape, else the launch's status.
cudaError_t launch_one_shot(const AllReduceArgs& a, cudaStream_t stream);
cudaError_t launch_two_shot(const AllReduceArgs& a, cudaStream_t stream);
cudaError_t launch_ring(const AllReduceArgs& a, cudaStream_t stream);
cudaError_t launch_tree(const AllReduceArgs& a, cudaStream_t stream);
// all_reduce(compress=a.wire) of float32/float16/bfloat16, sum or avg (compressed.cu): count at most
// compressed_piece_elems(half_bytes, wire), a whole number of quant blocks except the call's last piece; always
// staged; kThreads threads.
cudaError_t launch_compressed(const AllReduceArgs& a, cudaStream_t stream);
cudaError_t compressed_blocks_per_sm(DType dtype, int* out);
// Elements of a compressed piece: whole quant blocks whose records (regions A and B) fill a staging half.
inline size_t compressed_piece_elems(size_t half_bytes, Wire w) {
  return half_bytes / (2 * static_cast<size_t>(wire_record_bytes(w))) * static_cast<size_t>(kQuantBlock);
}

// Resident blocks per SM of the kernel that would run (dtype, op) with kThreads threads, for the residency
// limit of virtual ranks (cudaOccupancyMaxActiveBlocksPerMultiprocessor).
cudaError_t one_shot_blocks_per_sm(DType dtype, RedOp op, int* out);
cudaError_t two_shot_blocks_per_sm(DType dtype, RedOp op, int* out);
cudaError_t ring_blocks_per_sm(DType dtype, RedOp op, int* out);
cudaError_t tree_blocks_per_sm(DType dtype, RedOp op, int* out);

// Enqueue a one-thread kernel that stores %globaltimer into *out (device memory): the host brackets it with its own
// clock to place the records' device times on the host's timeline (kernel_trace.cc).
cudaError_t launch_read_global_timer(uint64_t* out, cudaStream_t stream);

}  // namespace gpucoll::cuda::custom
