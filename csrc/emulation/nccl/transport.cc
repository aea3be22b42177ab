// Data movement between ranks, as NCCL's P2P transport does it on one node: each rank allocates a mailbox in its
// own device memory and the ranks map each other's with CUDA IPC at init. A mailbox holds one inbound FIFO channel per
// peer: kSlots slots of `chunk` bytes with a tail (chunks the sender wrote) and a head (chunks the receiver consumed).
// The sender copies a chunk into the receiver's slot and publishes it with a release store of the tail; the receiver
// reads the slot after an acquire load of the tail and frees it with a release store of the head. Both counters live
// in the receiver's mailbox; each side keeps its own copy of the counter it writes.
//
// Waiting. A rank that can make no progress sleeps on the doorbell word of its own mailbox (a futex on shared memory,
// so it works across processes); whoever moves a counter it may wait for bumps that doorbell and wakes it. The sleep
// is bounded (kSleep), so an abort, which only sets a flag in this process, is seen within that time.
//
// Engine. A launch runs its collectives one after another, then all its send/recv at once, each as a phase: a set of
// outbound byte streams (one queue per peer, in call order), inbound ones (the same) and at most one reduction, which
// consumes chunk k of every peer together and combines them in rank order, so every rank computes the same bits. All
// streams of a phase progress together, so a group's sends and receives never wait on each other (NCCL's group
// semantics) and the channels' bounded size cannot deadlock a phase. A reduction writes chunk k of its output only
// after this rank sent chunk k of its input to every peer (the output may be the input: in-place operations).
//
// Peers on other hosts. Their channels are TCP connections with the same FIFO semantics (net.cc); a phase moves
// them in the same loop, and waits in poll() on their sockets, at most 1 ms at a time so that mailbox peers of a
// mixed communicator (whose doorbells a poll cannot see) still progress. A failed connection fails the phase with
// ncclRemoteError naming the peer as soon as the phase needs data that will not come, or has data for it.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <optional>
#include <thread>

#include "nccl_emu.h"

namespace ncclemu {
namespace {

using gpucoll::ncclInternalError;
using gpucoll::ncclRemoteError;
using gpucoll::ncclSuccess;
using gpucoll::ncclUnhandledCudaError;

constexpr int kSlots = 4;
constexpr size_t kLine = 64;
constexpr long kSleepNs = 2'000'000;  // the longest a waiting rank sleeps before it looks at the abort flag again

// NCCL_EMU_CHUNK_BYTES (default 256 KiB, a multiple of 64): small values make tests cover many-chunk messages.
size_t chunk_bytes() {
  static const size_t bytes = [] {
    const char* env = std::getenv("NCCL_EMU_CHUNK_BYTES");
    const long long v = env != nullptr ? std::atoll(env) : 0;
    if (v >= 64 && v % 64 == 0) return static_cast<size_t>(v);
    return static_cast<size_t>(256 << 10);
  }();
  return bytes;
}

struct Ctl {  // the channel from peer q into this mailbox
  uint64_t tail;
  char pad0[kLine - 8];
  uint64_t head;
  char pad1[kLine - 8];
};
struct SlotHeader {
  uint64_t bytes;
  char pad[kLine - 8];
};

uint32_t* doorbell(char* mailbox) { return reinterpret_cast<uint32_t*>(mailbox); }
Ctl* ctl(char* mailbox, int from) { return reinterpret_cast<Ctl*>(mailbox + kLine) + from; }
size_t slot_stride() { return sizeof(SlotHeader) + chunk_bytes(); }
SlotHeader* slot(char* mailbox, int nranks, int from, uint64_t index) {
  char* slots = mailbox + kLine + static_cast<size_t>(nranks) * sizeof(Ctl);
  const size_t i = static_cast<size_t>(from) * kSlots + static_cast<size_t>(index % kSlots);
  return reinterpret_cast<SlotHeader*>(slots + i * slot_stride());
}
char* slot_data(SlotHeader* s) { return reinterpret_cast<char*>(s) + sizeof(SlotHeader); }

uint64_t load_acquire(uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void ring(char* mailbox) {
  __atomic_fetch_add(doorbell(mailbox), 1u, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, doorbell(mailbox), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void sleep_on(char* mailbox, uint32_t seen) {
  timespec ts{0, kSleepNs};
  syscall(SYS_futex, doorbell(mailbox), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

struct Out {
  const char* src;
  size_t bytes;
  size_t sent = 0;
};
struct In {
  char* dst;
  size_t bytes;
  size_t got = 0;
};
struct Red {
  const char* self;
  char* dst;
  size_t count;
  size_t done = 0;  // elements
  ncclDataType_t type;
  DevOp op;
};

class Phase {
 public:
  Phase(Comm& c, std::string* error) : c_(c), outs_(c.nranks), ins_(c.nranks), error_(error) {}

  void send(int peer, const void* src, size_t bytes) {
    if (bytes > 0) outs_[peer].push_back(Out{static_cast<const char*>(src), bytes});
  }
  void recv(int peer, void* dst, size_t bytes) {
    if (bytes > 0) ins_[peer].push_back(In{static_cast<char*>(dst), bytes});
  }
  void copy(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }
  // Every rank's `count` elements reduced into dst; this rank's come from `self`, the peers' through the channels.
  void reduce(const void* self, void* dst, size_t count, ncclDataType_t t, const DevOp& op) {
    red_ = Red{static_cast<const char*>(self), static_cast<char*>(dst), count, 0, t, op};
  }

  ncclResult_t run() {
    int idle = 0;
    for (;;) {
      const uint32_t seen = __atomic_load_n(doorbell(c_.mailbox), __ATOMIC_SEQ_CST);
      bool progress = false;
      bool pending = false;
      for (int p = 0; p < c_.nranks; ++p) {
        progress |= pump_out(p);
        progress |= pump_in(p);
        pending |= !outs_[p].empty() || !ins_[p].empty();
      }
      if (red_) {
        progress |= pump_reduce();
        pending |= red_->done < red_->count;
      }
      if (error_->empty()) check_links();
      if (!error_->empty()) return code_;
      if (!pending) return ncclSuccess;
      if (c_.aborted.load(std::memory_order_acquire)) return ncclSuccess;
      if (progress) {
        idle = 0;
      } else if (++idle < 16) {
        std::this_thread::yield();
      } else if (!c_.links.empty()) {
        std::vector<bool> sending(static_cast<size_t>(c_.nranks));
        for (int p = 0; p < c_.nranks; ++p) sending[static_cast<size_t>(p)] = !outs_[p].empty();
        net_wait(c_, sending, 1);
      } else {
        sleep_on(c_.mailbox, seen);
      }
    }
  }

 private:
  // A failed connection whose peer this phase still needs: data to send, or more chunks to receive than arrived
  // before the failure (a peer that finished its part and closed leaves them all). A peer whose communicator failed
  // fails this one at once, whatever this phase needs: nothing on it can complete any more (ncclRemoteError).
  void check_links() {
    for (int p = 0; p < c_.nranks; ++p) {
      NetLink* l = net_link(c_, p);
      if (l == nullptr || net_failure(*l).empty()) continue;
      size_t needed = 0;
      for (const In& in : ins_[p]) needed += (in.bytes - in.got + chunk_bytes() - 1) / chunk_bytes();
      if (red_) {
        const size_t per_chunk = chunk_bytes() / type_size(red_->type);
        needed += (red_->count - red_->done + per_chunk - 1) / per_chunk;
      }
      if (net_gave_up(*l) || !outs_[p].empty() || needed > net_buffered(*l)) {
        *error_ = net_failure(*l);
        code_ = ncclRemoteError;
        return;
      }
    }
  }

  bool pump_out(int peer) {
    bool progress = false;
    if (NetLink* l = net_link(c_, peer)) {
      while (!outs_[peer].empty()) {
        Out& o = outs_[peer].front();
        const size_t n = std::min(chunk_bytes(), o.bytes - o.sent);
        if (!net_push(*l, o.src + o.sent, n)) break;
        o.sent += n;
        progress = true;
        if (o.sent == o.bytes) outs_[peer].pop_front();
      }
      return progress;
    }
    while (!outs_[peer].empty()) {
      Out& o = outs_[peer].front();
      char* box = c_.peer_mailbox[peer];
      Ctl* k = ctl(box, c_.rank);
      uint64_t& tail = c_.send_tail[peer];
      if (tail - load_acquire(&k->head) >= kSlots) break;
      const size_t n = std::min(chunk_bytes(), o.bytes - o.sent);
      SlotHeader* s = slot(box, c_.nranks, c_.rank, tail);
      s->bytes = n;
      std::memcpy(slot_data(s), o.src + o.sent, n);
      store_release(&k->tail, ++tail);
      ring(box);
      o.sent += n;
      progress = true;
      if (o.sent == o.bytes) outs_[peer].pop_front();
    }
    return progress;
  }

  // The next chunk from `peer`, or null; checks it holds `want` bytes.
  const char* arrived(int peer, size_t want) {
    size_t bytes = 0;
    const char* data = nullptr;
    if (NetLink* l = net_link(c_, peer)) {
      data = net_front(*l, &bytes);
      if (data == nullptr && net_pull(*l)) data = net_front(*l, &bytes);
      if (data == nullptr) return nullptr;
    } else {
      Ctl* k = ctl(c_.mailbox, peer);
      const uint64_t head = c_.recv_head[peer];
      if (load_acquire(&k->tail) == head) return nullptr;
      SlotHeader* s = slot(c_.mailbox, c_.nranks, peer, head);
      bytes = s->bytes;
      data = slot_data(s);
    }
    if (bytes != want && error_->empty()) {
      *error_ = "rank " + std::to_string(peer) + " sent a chunk of " + std::to_string(bytes) + " bytes where rank " +
                std::to_string(c_.rank) + " expected " + std::to_string(want) +
                ": the ranks issued different operations or counts";
    }
    return data;
  }

  void consumed(int peer) {
    if (NetLink* l = net_link(c_, peer)) {
      net_pop(*l);
      return;
    }
    store_release(&ctl(c_.mailbox, peer)->head, ++c_.recv_head[peer]);
    ring(c_.peer_mailbox[peer]);
  }

  bool pump_in(int peer) {
    bool progress = false;
    while (!ins_[peer].empty() && error_->empty()) {
      In& in = ins_[peer].front();
      const size_t n = std::min(chunk_bytes(), in.bytes - in.got);
      const char* s = arrived(peer, n);
      if (s == nullptr || !error_->empty()) break;
      std::memcpy(in.dst + in.got, s, n);
      consumed(peer);
      in.got += n;
      progress = true;
      if (in.got == in.bytes) ins_[peer].pop_front();
    }
    return progress;
  }

  bool pump_reduce() {
    Red& r = *red_;
    const size_t es = type_size(r.type);
    const size_t per_chunk = chunk_bytes() / es;
    bool progress = false;
    while (r.done < r.count && error_->empty()) {
      const size_t n = std::min(per_chunk, r.count - r.done);
      const size_t end_byte = (r.done + n) * es;
      // In place: chunk k of the output may be chunk k of an input still to be sent.
      for (int p = 0; p < c_.nranks; ++p) {
        for (const Out& o : outs_[p]) {
          if (o.src == r.self && o.sent < std::min(end_byte, o.bytes)) return progress;
        }
      }
      std::vector<const void*> srcs(static_cast<size_t>(c_.nranks));
      for (int p = 0; p < c_.nranks; ++p) {
        if (p == c_.rank) {
          srcs[p] = r.self + r.done * es;
          continue;
        }
        const char* s = arrived(p, n * es);
        if (s == nullptr || !error_->empty()) return progress;
        srcs[p] = s;
      }
      ncclemu::reduce(r.type, r.op, srcs.data(), c_.nranks, r.dst + r.done * es, n);
      for (int p = 0; p < c_.nranks; ++p) {
        if (p != c_.rank) consumed(p);
      }
      r.done += n;
      progress = true;
    }
    return progress;
  }

  Comm& c_;
  std::vector<std::deque<Out>> outs_;
  std::vector<std::deque<In>> ins_;
  std::optional<Red> red_;
  std::string* error_;
  ncclResult_t code_ = ncclInternalError;
};

const char* at(const void* p, size_t off) { return static_cast<const char*>(p) + off; }
char* at(void* p, size_t off) { return static_cast<char*>(p) + off; }

ncclResult_t run_collective(Comm& c, const Task& t, std::string* error) {
  const size_t es = type_size(t.type);
  const size_t bytes = t.count * es;
  const int P = c.nranks, me = c.rank;
  Phase ph(c, error);
  switch (t.coll) {
    case Coll::kAllReduce:
      for (int p = 0; p < P; ++p) {
        if (p != me) ph.send(p, t.send, bytes);
      }
      ph.reduce(t.send, t.recv, t.count, t.type, t.op);
      break;
    case Coll::kReduce:
      if (me == t.root) {
        ph.reduce(t.send, t.recv, t.count, t.type, t.op);
      } else {
        ph.send(t.root, t.send, bytes);
      }
      break;
    case Coll::kBroadcast:
      if (me == t.root) {
        ph.copy(t.recv, t.send, bytes);
        for (int p = 0; p < P; ++p) {
          if (p != me) ph.send(p, t.send, bytes);
        }
      } else {
        ph.recv(t.root, t.recv, bytes);
      }
      break;
    case Coll::kAllGather:
      ph.copy(at(t.recv, me * bytes), t.send, bytes);
      for (int p = 0; p < P; ++p) {
        if (p == me) continue;
        ph.send(p, t.send, bytes);
        ph.recv(p, at(t.recv, p * bytes), bytes);
      }
      break;
    case Coll::kReduceScatter:
      for (int p = 0; p < P; ++p) {
        if (p != me) ph.send(p, at(t.send, p * bytes), bytes);
      }
      ph.reduce(at(t.send, me * bytes), t.recv, t.count, t.type, t.op);
      break;
    case Coll::kAllToAll:
      ph.copy(at(t.recv, me * bytes), at(t.send, me * bytes), bytes);
      for (int p = 0; p < P; ++p) {
        if (p == me) continue;
        ph.send(p, at(t.send, p * bytes), bytes);
        ph.recv(p, at(t.recv, p * bytes), bytes);
      }
      break;
    case Coll::kGather:
      if (me == t.root) {
        ph.copy(at(t.recv, me * bytes), t.send, bytes);
        for (int p = 0; p < P; ++p) {
          if (p != me) ph.recv(p, at(t.recv, p * bytes), bytes);
        }
      } else {
        ph.send(t.root, t.send, bytes);
      }
      break;
    case Coll::kScatter:
      if (me == t.root) {
        ph.copy(t.recv, at(t.send, me * bytes), bytes);
        for (int p = 0; p < P; ++p) {
          if (p != me) ph.send(p, at(t.send, p * bytes), bytes);
        }
      } else {
        ph.recv(t.root, t.recv, bytes);
      }
      break;
    case Coll::kSend:
    case Coll::kRecv:
      break;
  }
  return ph.run();
}

// A group's sends and receives, all progressing at once. Operations with oneself pair up in call order.
ncclResult_t run_p2p(Comm& c, const std::vector<const Task*>& ops, std::string* error) {
  Phase ph(c, error);
  std::deque<const Task*> self_sends, self_recvs;
  for (const Task* t : ops) {
    const size_t bytes = t->count * type_size(t->type);
    if (t->root == c.rank) {
      (t->coll == Coll::kSend ? self_sends : self_recvs).push_back(t);
    } else if (t->coll == Coll::kSend) {
      ph.send(t->root, t->send, bytes);
    } else {
      ph.recv(t->root, t->recv, bytes);
    }
  }
  while (!self_sends.empty() && !self_recvs.empty()) {
    const Task* s = self_sends.front();
    const Task* r = self_recvs.front();
    const size_t sb = s->count * type_size(s->type), rb = r->count * type_size(r->type);
    if (sb != rb) {
      *error = "a send of " + std::to_string(sb) + " bytes to itself met a receive of " + std::to_string(rb) + " bytes";
      return ncclInternalError;
    }
    ph.copy(r->recv, s->send, sb);
    self_sends.pop_front();
    self_recvs.pop_front();
  }
  if (!self_sends.empty() || !self_recvs.empty()) {
    *error = "rank " + std::to_string(c.rank) + " posted a send or receive with itself that has no counterpart";
    return ncclInternalError;
  }
  return ph.run();
}

}  // namespace

size_t mailbox_bytes(int nranks) {
  return kLine + static_cast<size_t>(nranks) * sizeof(Ctl) + static_cast<size_t>(nranks) * kSlots * slot_stride();
}

ncclResult_t transport_alloc(Comm& c, RankInfo* info, std::string* error) {
  c.mailbox_bytes = mailbox_bytes(c.nranks);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, c.mailbox_bytes);
  if (e == cudaSuccess) e = cudaMemset(p, 0, c.mailbox_bytes);  // counters start at zero; cudaMalloc does not clear
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&info->handle, p);
  if (e != cudaSuccess) {
    if (p != nullptr) cudaFree(p);
    cudaGetLastError();
    *error = std::string("mailbox allocation: ") + cudaGetErrorString(e);
    return ncclUnhandledCudaError;
  }
  c.mailbox = static_cast<char*>(p);
  info->mailbox = reinterpret_cast<uint64_t>(p);
  info->mailbox_bytes = c.mailbox_bytes;
  info->chunk = chunk_bytes();
  return net_listen(c, info, error);
}

ncclResult_t transport_connect(Comm& c, const std::vector<RankInfo>& all, std::string* error) {
  const size_t P = static_cast<size_t>(c.nranks);
  c.peer_mailbox.assign(P, nullptr);
  c.peer_ipc.assign(P, false);
  c.send_tail.assign(P, 0);
  c.recv_head.assign(P, 0);
  for (size_t r = 0; r < P; ++r) {
    const RankInfo& info = all[r];
    if (info.chunk != chunk_bytes() || info.mailbox_bytes != c.mailbox_bytes) {
      *error = "rank " + std::to_string(r) + " uses another channel size (NCCL_EMU_CHUNK_BYTES differs between ranks)";
      return gpucoll::ncclInvalidUsage;
    }
    if (static_cast<int>(r) == c.rank) {
      c.peer_mailbox[r] = c.mailbox;
    } else if (!same_host(all[static_cast<size_t>(c.rank)], info)) {
      continue;  // over the network only (net_connect below), even where IPC would reach it
    } else if (info.pid == static_cast<int32_t>(::getpid())) {
      c.peer_mailbox[r] = reinterpret_cast<char*>(info.mailbox);  // a rank of this process: its pointer is ours
    } else {
      // Opened on the mailbox's own device: NCCL without P2P between two GPUs still connects them (through host
      // memory, its SHM transport), and the stand-in's host functions read the mapping from the host, so the
      // mapping must not depend on peer access the way a kernel's would.
      void* p = nullptr;
      int current = 0;
      cudaGetDevice(&current);
      cudaError_t e = cudaSetDevice(info.device);
      if (e == cudaSuccess) e = cudaIpcOpenMemHandle(&p, info.handle, cudaIpcMemLazyEnablePeerAccess);
      cudaSetDevice(current);
      if (e != cudaSuccess) {
        cudaGetLastError();
        *error = "cannot map rank " + std::to_string(r) + "'s mailbox: " + cudaGetErrorString(e);
        return ncclUnhandledCudaError;
      }
      c.peer_mailbox[r] = static_cast<char*>(p);
      c.peer_ipc[r] = true;
    }
  }
  return net_connect(c, all, error);
}

ncclResult_t execute(Comm& c, const std::vector<Task>& tasks, std::string* error) {
  std::vector<const Task*> p2p;
  for (const Task& t : tasks) {
    if (c.aborted.load(std::memory_order_acquire)) return ncclSuccess;
    if (t.coll == Coll::kSend || t.coll == Coll::kRecv) {
      p2p.push_back(&t);
      continue;
    }
    const ncclResult_t r = run_collective(c, t, error);
    if (r != ncclSuccess) return r;
  }
  return p2p.empty() ? ncclSuccess : run_p2p(c, p2p, error);
}

}  // namespace ncclemu
