// Point-to-point transfers for the host backend (HostComm members).
//
// p2p uses per-pair channels in the region (region.h): two slots per ordered pair and two counters, `sent`
// (written by the sender) and `acked` (written by the receiver), both counting pieces over the pair's
// lifetime. A batch (a group) progresses all its transfers together, piece by piece, so any order of matching
// sends and receives completes. Point-to-point calls are numbered apart from collectives and never touch the
// step counters: ranks that send and receive between some of them stay in step for the collectives of all.
#include <sched.h>

#include <algorithm>
#include <cstring>

#include "backends/host/host_comm.h"
#include "backends/host/kernels.h"
#include "backends/host/region.h"
#include "core/error.h"

namespace gpucoll::host {

void HostComm::p2p(const std::vector<P2POp>& ops) {
  in_order();
  begin_p2p(ops.size() == 1 ? (ops[0].send ? "send" : "recv") : "group", ops);
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
          if (len > 0) copy_bytes(s + kSlotHeaderBytes, static_cast<const char*>(op.buf) + off, len);
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
          if (len > 0) copy_bytes(static_cast<char*>(op.buf) + off, s + kSlotHeaderBytes, len);
          publish(&pc->acked, static_cast<uint32_t>(piece + 1));
        }
        ++pr.next;
        progressed = true;
        if (pr.next == pr.npieces) --remaining;
      }
      if (progressed) {
        if (idle_rounds >= 64) ctl(opt_.rank)->waiting.store(0, std::memory_order_relaxed);
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
          const int64_t now = note_awake(now_ns());
          ctl(opt_.rank)->waiting.store((static_cast<uint64_t>(op.peer) + 1) << 32 | kP2PWait,
                                        std::memory_order_relaxed);
          w->sleepers.fetch_add(1, std::memory_order_seq_cst);
          const uint32_t v = w->value.load(std::memory_order_seq_cst);
          const uint64_t piece = blocked->first_piece + blocked->next;
          const uint32_t target = static_cast<uint32_t>(op.send ? piece + 1 - kP2PSlots : piece + 1);
          if (!reached(v, target)) futex_wait(&w->value, v, std::min<int64_t>(deadline_ns_ - now, 2'000'000));
          w->sleepers.fetch_sub(1, std::memory_order_seq_cst);
          // Evidence against the peer only while what this rank waits for is still missing (a peer may send and
          // then close), and not right after this process was stopped (note_awake accounts for that first).
          if (!reached(w->value.load(std::memory_order_acquire), target) && now_ns() - awake_ns_ <= 1'000'000'000) {
            check_peer(op.peer);
          }
        }
      }
    }
    ctl(opt_.rank)->waiting.store(0, std::memory_order_relaxed);
    trace_.end(trace_id_, TraceState::kDone, now_ns());
    ctl(opt_.rank)->p2p_done.store(p2p_seq_, std::memory_order_release);
  } catch (const Error& e) {
    fail(current_, &e);
    throw;
  } catch (...) {
    fail(current_, nullptr);
    throw;
  }
}

}  // namespace gpucoll::host
