// Point-to-point transfers and GPUCOLL_DEBUG_CHECKS for the host backend (HostComm members).
//
// p2p uses per-pair channels in the region (region.h): two slots per ordered pair and two counters, `sent`
// (written by the sender) and `acked` (written by the receiver), both counting pieces over the pair's
// lifetime. A batch (a group) progresses all its transfers together, piece by piece, so any order of matching
// sends and receives completes.
#include <sched.h>

#include <algorithm>
#include <cstring>

#include "backends/host/host_comm.h"
#include "backends/host/region.h"
#include "core/error.h"

namespace gpucoll::host {

namespace {
constexpr int32_t kPremulOpId = 1000;  // the op of a premul_sum in the debug descriptor (not a RedOp value)
}  // namespace

void HostComm::debug_check(const CollArgs& a) {
  // Publish this op's descriptor, make it a step (so every rank's descriptor is visible after it), then
  // compare. All ranks read the same table and so raise the same error. Two slots alternate by op parity:
  // the slot of op k+2 is written only after every rank passed op k+1's check step, i.e. finished reading k.
  OpDesc& mine = ctl(opt_.rank)->desc[op_seq_ % 2];
  mine.coll = static_cast<int32_t>(a.coll);
  mine.dtype = static_cast<int32_t>(a.dtype);
  mine.op = !algo::coll_reduces(a.coll) ? -1 : a.premul ? kPremulOpId : static_cast<int32_t>(a.op);
  mine.root = algo::coll_is_rooted(a.coll) ? a.root : -1;
  mine.count = a.count;
  mine.seq = op_seq_;
  complete_sync_step();
  for (int q = 0; q < opt_.nranks; ++q) {
    if (q != opt_.rank) wait_done(q, done_);
  }
  bool same = true;
  for (int q = 0; q < opt_.nranks && same; ++q) {
    const OpDesc& d = ctl(q)->desc[op_seq_ % 2];
    same = d.coll == mine.coll && d.dtype == mine.dtype && d.op == mine.op && d.root == mine.root &&
           d.count == mine.count && d.seq == mine.seq;
  }
  if (same) return;
  std::string table;
  for (int q = 0; q < opt_.nranks; ++q) {
    const OpDesc& d = ctl(q)->desc[op_seq_ % 2];
    table += "\n  rank " + std::to_string(q) + ": " + algo::coll_name(static_cast<algo::Coll>(d.coll)) + " #" +
             std::to_string(d.seq) + " dtype=" + dtype_name(static_cast<DType>(d.dtype)) +
             " count=" + std::to_string(d.count) +
             (d.op == kPremulOpId ? std::string(" op=premul_sum")
              : d.op >= 0    ? std::string(" op=") + redop_name(static_cast<RedOp>(d.op))
                             : std::string()) +
             (d.root >= 0 ? " root=" + std::to_string(d.root) : std::string());
  }
  // Everyone raises; nobody touched data, so the communicator stays usable.
  throw Error(ErrorCode::kInvalidArgument,
              "GPUCOLL_DEBUG_CHECKS: ranks disagree on collective #" + std::to_string(op_seq_) + ":" + table,
              "debug_check", __FILE__, __LINE__);
}

void HostComm::p2p(const std::vector<P2POp>& ops) {
  begin_op(ops.size() == 1 ? (ops[0].send ? "send" : "recv") : "group");
  struct Progress {
    const P2POp* op;
    uint64_t first_piece;  // the pair counter value of this message's first piece
    uint64_t npieces;
    uint64_t next = 0;     // pieces done
  };
  std::vector<Progress> todo;
  todo.reserve(ops.size());
  for (const P2POp& op : ops) {
    GPUCOLL_CHECK_ARG(op.peer >= 0 && op.peer < opt_.nranks && op.peer != opt_.rank, "peer must be in [0, ",
                      opt_.nranks, ") and not this rank (", opt_.rank, "), got ", op.peer);
    const uint64_t n = op.bytes == 0 ? 1 : (static_cast<uint64_t>(op.bytes) + slot_bytes_ - 1) / slot_bytes_;
    uint32_t& counter = op.send ? p2p_sent_[static_cast<size_t>(op.peer)] : p2p_recvd_[static_cast<size_t>(op.peer)];
    todo.push_back(Progress{&op, counter, n});
    counter += static_cast<uint32_t>(n);  // later messages to the same peer queue behind this one, in order
  }
  try {
    size_t remaining = todo.size();
    int idle_rounds = 0;
    std::vector<char> pair_busy(static_cast<size_t>(opt_.nranks) * 2);
    while (remaining > 0) {
      bool progressed = false;
      const Progress* blocked = nullptr;
      // A pair's counters and slots carry pieces strictly in order, so of several messages between the same
      // two ranks in one direction only the oldest unfinished one may move; the others wait their turn.
      std::fill(pair_busy.begin(), pair_busy.end(), 0);
      for (Progress& pr : todo) {
        if (pr.next == pr.npieces) continue;
        const P2POp& op = *pr.op;
        char& busy = pair_busy[static_cast<size_t>(op.peer) * 2 + (op.send ? 1 : 0)];
        if (busy) continue;
        busy = 1;
        const uint64_t piece = pr.first_piece + pr.next;
        const uint64_t off = pr.next * slot_bytes_;
        const uint64_t len = std::min<uint64_t>(slot_bytes_, static_cast<uint64_t>(op.bytes) - std::min<uint64_t>(off, op.bytes));
        if (op.send) {
          PairCtl* pc = pair(opt_.rank, op.peer);
          // The slot is free once the receiver acknowledged the piece that used it kP2PSlots pieces ago.
          if (!reached(pc->acked.value.load(std::memory_order_acquire), static_cast<uint32_t>(piece + 1 - kP2PSlots))) {
            blocked = &pr;
            continue;
          }
          char* s = slot(opt_.rank, op.peer, piece);
          auto* hdr = reinterpret_cast<SlotHeader*>(s);
          hdr->message_bytes = static_cast<uint64_t>(op.bytes);
          hdr->piece_bytes = len;
          if (len > 0) std::memcpy(s + kSlotHeaderBytes, static_cast<const char*>(op.buf) + off, len);
          publish(&pc->sent, static_cast<uint32_t>(piece + 1));
        } else {
          PairCtl* pc = pair(op.peer, opt_.rank);
          if (!reached(pc->sent.value.load(std::memory_order_acquire), static_cast<uint32_t>(piece + 1))) {
            blocked = &pr;
            continue;
          }
          const char* s = slot(op.peer, opt_.rank, piece);
          const auto* hdr = reinterpret_cast<const SlotHeader*>(s);
          if (hdr->message_bytes != static_cast<uint64_t>(op.bytes)) {
            GPUCOLL_INVALID_ARG("recv from rank ", op.peer, " expected ", op.bytes, " bytes but rank ", op.peer,
                                " sent ", hdr->message_bytes, " bytes (sizes and dtypes of matching send/recv must "
                                "agree)");
          }
          if (len > 0) std::memcpy(static_cast<char*>(op.buf) + off, s + kSlotHeaderBytes, len);
          publish(&pc->acked, static_cast<uint32_t>(piece + 1));
        }
        ++pr.next;
        progressed = true;
        if (pr.next == pr.npieces) --remaining;
      }
      if (progressed) {
        idle_rounds = 0;
      } else if (blocked != nullptr) {
        // Nothing could move. Sleep briefly on one blocked transfer's counter, then rescan all of them: another
        // transfer of the batch may become ready first, and only rescanning avoids waiting on the wrong one.
        const P2POp& op = *blocked->op;
        WaitWord* w = op.send ? &pair(opt_.rank, op.peer)->acked : &pair(op.peer, opt_.rank)->sent;
        if (++idle_rounds < 64) {
          cpu_relax();
          if (idle_rounds % 8 == 0) sched_yield();
        } else {
          w->sleepers.fetch_add(1, std::memory_order_seq_cst);
          const uint32_t v = w->value.load(std::memory_order_seq_cst);
          const uint64_t piece = blocked->first_piece + blocked->next;
          const uint32_t target = static_cast<uint32_t>(op.send ? piece + 1 - kP2PSlots : piece + 1);
          if (!reached(v, target)) futex_wait(&w->value, v, std::min<int64_t>(deadline_ns_ - now_ns(), 2'000'000));
          w->sleepers.fetch_sub(1, std::memory_order_seq_cst);
          if (ctl(op.peer)->broken.load(std::memory_order_acquire) != 0) raise_peer_failed(op.peer);
          if (now_ns() >= deadline_ns_ || peer_dead(op.peer)) raise_timeout(op.peer);
        }
      }
    }
  } catch (const Error& e) {
    fail(current_, &e);
    throw;
  } catch (...) {
    fail(current_, nullptr);
    throw;
  }
}

}  // namespace gpucoll::host
