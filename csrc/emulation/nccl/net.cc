// The network between hosts, as NCCL's socket transport (NCCL_NET=Socket) and its bootstrap use it: the interface is
// chosen as NCCL chooses it (NCCL_SOCKET_IFNAME, else the first up interface that is not loopback or docker, else
// loopback); every communicator listens on it, and each pair of ranks on different hosts shares one TCP connection,
// made at init or split by the lower rank. Ranks of one host keep the IPC mailboxes (transport.cc) unless NCCL's
// NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 leave them nothing but the network, as in NCCL.
//
// Channel. A connection carries, in each direction, the same FIFO of chunks a mailbox channel does: frames of an
// 8-byte length and the chunk. The receiver reads frames into kSlots slots of its own and reads the socket only while
// a slot is free, so a fast sender is held back by TCP's window, as a mailbox's full ring holds it back: the channel
// is bounded and the engine's phases, which move every stream at once, cannot deadlock on it. A frame is written
// straight from the source (no copy) and counts as sent only once whole, so an in-place reduction never overwrites a
// chunk still on its way out.
//
// Failures. A peer that exits closes its end (FIN or RST): the next read needing it names it at once. A peer that
// aborts a failed communicator first sends each peer still connected a last frame with its reason (a length word
// with kGoodbye set), so that its healthy peers report the failure it saw (a lost host and its ranks) rather than
// only that it went away. A cut link or a
// dead host says nothing; TCP keepalives (1 s idle, 1 s apart) and TCP_USER_TIMEOUT (NCCL_EMU_NET_TIMEOUT_MS, default
// 5000) make the kernel fail the connection with ETIMEDOUT once nothing was acknowledged for that long, so a link down
// for less than that (a flap) is survived and one down longer is named. NCCL itself would wait for TCP's own give-up
// (minutes); gpucoll's watchdog would then time out first and could not say which host went away.
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "nccl_emu.h"

namespace ncclemu {

using gpucoll::ncclRemoteError;
using gpucoll::ncclSuccess;
using gpucoll::ncclSystemError;

namespace {

constexpr int kNetSlots = 4;
constexpr uint64_t kGoodbye = 1ull << 63;  // in a frame's length word: the sender's last words, not a chunk
constexpr size_t kGoodbyeMax = 2048;
constexpr int kGoodbyeMs = 200;            // the most an abort waits to say goodbye to a peer that does not read
constexpr int kConnectTimeoutMs = 30000;  // a peer that never connects at init: the other ranks give up

int net_timeout_ms() {
  static const int ms = [] {
    const char* env = std::getenv("NCCL_EMU_NET_TIMEOUT_MS");
    const long v = env != nullptr ? std::strtol(env, nullptr, 10) : 0;
    return v > 0 ? static_cast<int>(v) : 5000;
  }();
  return ms;
}

bool env_is_one(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == "1";
}

// NCCL_SOCKET_IFNAME's grammar: a comma list of prefixes; '^' first excludes them, '=' first matches names exactly.
bool if_matches(const std::string& name, std::string spec) {
  bool exclude = false, exact = false;
  if (!spec.empty() && spec[0] == '^') exclude = true, spec.erase(0, 1);
  if (!spec.empty() && spec[0] == '=') exact = true, spec.erase(0, 1);
  bool hit = false;
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t end = std::min(spec.find(',', start), spec.size());
    const std::string item = spec.substr(start, end - start);
    if (!item.empty() && (exact ? name == item : name.compare(0, item.size(), item) == 0)) hit = true;
    start = end + 1;
  }
  return exclude ? !hit : hit;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Keepalives and the user timeout: the kernel fails a connection to a host that stopped answering (see the top).
void tune(int fd) {
  const int one = 1, idle = 1, interval = 1, timeout = net_timeout_ms();
  const int count = timeout / 1000 + 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout, sizeof(timeout));
}

struct Hello {  // the connecting rank's first bytes: whose listener it meant, and who it is
  uint64_t token;
  int32_t rank;
  int32_t pad;
};

}  // namespace

// One connection to a rank on another host, and the inbound slots its frames land in.
struct NetLink {
  int fd = -1;
  int peer = -1;
  std::string who;          // "rank 3 (host node1, 10.203.0.2:41234)", for messages
  std::string host_ranks;   // "host node1 (ranks 2, 3)": every rank an unreachable host takes with it
  std::string failure;      // why the connection is unusable; empty while it is fine
  // Outbound: the frame being written, and how many of its bytes (length word included) went out.
  uint64_t out_len = 0;
  size_t out_done = 0;
  // Inbound: kNetSlots frames; `tail` complete ones arrived, `head` consumed, `fill` bytes of the next one read.
  std::vector<char> slots;
  uint64_t tail = 0, head = 0;
  size_t fill = 0;
  uint64_t in_len = 0;
  char bye[kGoodbyeMax] = {};  // a goodbye frame's text as it arrives
  // The peer closed while every slot was full (so its last frames wait in the kernel): the chunks still there, and
  // what its goodbye (or its end of file) says. Learned once, by peeking.
  bool peeked = false;
  bool gave_up = false;  // its goodbye arrived: its communicator failed, so this one cannot complete anything either
  size_t closed_frames = 0;
  std::string closed_why;
  uint64_t lens[kNetSlots] = {};  // each slot's frame length
  size_t chunk = 0;

  char* slot(uint64_t i) { return slots.data() + (i % kNetSlots) * chunk; }

  ~NetLink() {
    if (fd >= 0) ::close(fd);
  }
};

bool net_forced() {
  static const bool forced = env_is_one("NCCL_P2P_DISABLE") && env_is_one("NCCL_SHM_DISABLE");
  return forced;
}

bool same_host(const RankInfo& a, const RankInfo& b) {
  return !net_forced() && std::strncmp(a.host, b.host, sizeof(a.host)) == 0;
}

void my_host(char* out, size_t n) {
  std::memset(out, 0, n);
  if (::gethostname(out, n - 1) != 0) std::strncpy(out, "?", n - 1);
}

bool net_interface(sockaddr_storage* addr, socklen_t* len, std::string* name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  const char* env = std::getenv("NCCL_SOCKET_IFNAME");
  const std::string spec = env != nullptr && *env != '\0' ? env : "";
  bool found = false;
  // Pass 0: what NCCL_SOCKET_IFNAME names, or NCCL's default (not loopback, not docker); pass 1: loopback. IPv4
  // before IPv6 in each, and no link-local IPv6 (it would need a scope id in the unique id).
  for (int pass = 0; pass < 2 && !found; ++pass) {
    for (int family : {AF_INET, AF_INET6}) {
      for (ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
        if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != family || !(i->ifa_flags & IFF_UP)) continue;
        const std::string n = i->ifa_name;
        const bool loop = (i->ifa_flags & IFF_LOOPBACK) != 0;
        if (family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr)) {
          continue;
        }
        const bool ok = !spec.empty() ? pass == 0 && if_matches(n, spec)
                                      : (pass == 0 ? !loop && n.compare(0, 6, "docker") != 0 : loop);
        if (!ok) continue;
        *len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
        std::memset(addr, 0, sizeof(*addr));
        std::memcpy(addr, i->ifa_addr, *len);
        *name = n;
        found = true;
      }
      if (found) break;
    }
  }
  ::freeifaddrs(list);
  return found;
}

std::string address_text(const void* addr, size_t len) {
  sockaddr_storage s{};
  std::memcpy(&s, addr, std::min(len, sizeof(s)));
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (s.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&s);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (s.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&s);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

int net_listen_on(sockaddr_storage* addr, socklen_t* len, std::string* error) {
  std::string ifname;
  if (!net_interface(addr, len, &ifname)) {
    *error = "no usable network interface (NCCL_SOCKET_IFNAME=" +
             std::string(std::getenv("NCCL_SOCKET_IFNAME") ? std::getenv("NCCL_SOCKET_IFNAME") : "") + ")";
    return -1;
  }
  const int fd = ::socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = std::string("socket: ") + std::strerror(errno);
    return -1;
  }
  if (addr->ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(addr)->sin_port = 0;
  if (addr->ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(addr)->sin6_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(addr), *len) != 0 || ::listen(fd, 1024) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(addr), len) != 0) {
    *error = "listening on " + ifname + " (" + address_text(addr, *len) + "): " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  return fd;
}

ncclResult_t net_listen(Comm& c, RankInfo* info, std::string* error) {
  my_host(info->host, sizeof(info->host));
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  const int fd = net_listen_on(&a, &len, error);
  if (fd < 0) return ncclSystemError;
  c.listen_fd = fd;
  std::random_device rd;
  c.net_token = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  info->net_token = c.net_token;
  std::memcpy(info->net_addr, &a, std::min<size_t>(len, sizeof(info->net_addr)));
  info->net_addr_len = len;
  return ncclSuccess;
}

int net_dial(const void* addr, socklen_t len, const std::atomic<bool>& abort, int* err) {
  sockaddr_storage a{};
  std::memcpy(&a, addr, std::min<size_t>(len, sizeof(a)));
  const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  tune(fd);
  int e = ::connect(fd, reinterpret_cast<sockaddr*>(&a), len) == 0 ? 0 : errno;
  if (e == EINPROGRESS) {  // polled, so that an abort (or the deadline) ends a dial to a host that never answers
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kConnectTimeoutMs);
    e = ETIMEDOUT;
    while (!abort.load() && std::chrono::steady_clock::now() < deadline) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, 20) <= 0) continue;
      socklen_t l = sizeof(e);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l);
      break;
    }
  }
  if (e != 0) {
    ::close(fd);
    *err = e;
    return -1;
  }
  return fd;
}

namespace {

std::string who(const RankInfo& r) {
  return "rank " + std::to_string(r.rank) + " (host " + std::string(r.host, strnlen(r.host, sizeof(r.host))) + ", " +
         address_text(r.net_addr, r.net_addr_len) + ")";
}

// Blocking write/read of a handshake with a deadline; false on timeout, abort or error.
bool exchange_io(int fd, void* data, size_t n, bool write, int timeout_ms, const std::atomic<bool>& abort) {
  char* p = static_cast<char*>(data);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (n > 0) {
    if (abort.load(std::memory_order_acquire) || std::chrono::steady_clock::now() > deadline) return false;
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    if (::poll(&pfd, 1, 20) <= 0) continue;
    const ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

int connect_to(const RankInfo& r, const std::atomic<bool>& abort, std::string* error) {
  int e = 0;
  const int fd = net_dial(r.net_addr, r.net_addr_len, abort, &e);
  if (fd < 0) *error = "cannot connect to " + who(r) + ": " + std::strerror(e);
  return fd;
}

}  // namespace

ncclResult_t net_connect(Comm& c, const std::vector<RankInfo>& all, std::string* error) {
  const int P = c.nranks;
  c.links.assign(static_cast<size_t>(P), nullptr);
  const RankInfo& me = all[static_cast<size_t>(c.rank)];
  int expected = 0;
  for (int r = 0; r < P; ++r) {
    const RankInfo& info = all[static_cast<size_t>(r)];
    if (r == c.rank || same_host(me, info)) continue;
    auto link = std::make_shared<NetLink>();
    link->peer = r;
    link->who = who(info);
    std::string ranks;
    for (const RankInfo& other : all) {
      if (std::strncmp(other.host, info.host, sizeof(info.host)) == 0) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(other.rank);
      }
    }
    link->host_ranks = "host " + std::string(info.host, strnlen(info.host, sizeof(info.host))) +
                       (ranks.find(',') == std::string::npos ? " (rank " : " (ranks ") + ranks + ")";
    link->chunk = static_cast<size_t>(me.chunk);
    link->slots.resize(kNetSlots * link->chunk);
    c.links[static_cast<size_t>(r)] = link;
    if (r < c.rank) {
      ++expected;
      continue;  // the lower rank connects
    }
    link->fd = connect_to(info, c.aborted, error);
    if (link->fd < 0) return ncclRemoteError;
    Hello h{info.net_token, c.rank, 0};
    if (!exchange_io(link->fd, &h, sizeof(h), true, kConnectTimeoutMs, c.aborted)) {
      *error = "cannot greet " + link->who + ": " + std::strerror(errno);
      return ncclRemoteError;
    }
  }
  // Connections from lower ranks wait in the listener's backlog: connect completes without accept, so no order of
  // the ranks' calls deadlocks here.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kConnectTimeoutMs);
  while (expected > 0) {
    if (c.aborted.load()) return ncclSuccess;
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      for (int r = 0; r < c.rank; ++r) {
        if (c.links[static_cast<size_t>(r)] && c.links[static_cast<size_t>(r)]->fd < 0) {
          missing += (missing.empty() ? "" : ", ") + c.links[static_cast<size_t>(r)]->who;
        }
      }
      *error = "no connection within " + std::to_string(kConnectTimeoutMs / 1000) + " s from " + missing;
      return ncclRemoteError;
    }
    pollfd pfd{c.listen_fd, POLLIN, 0};
    if (::poll(&pfd, 1, 20) <= 0) continue;
    const int fd = ::accept4(c.listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    Hello h{};
    if (!exchange_io(fd, &h, sizeof(h), false, 5000, c.aborted) || h.token != c.net_token || h.rank < 0 ||
        h.rank >= c.rank || !c.links[static_cast<size_t>(h.rank)] || c.links[static_cast<size_t>(h.rank)]->fd >= 0) {
      ::close(fd);  // not one of this communicator's peers (a stray connection, or a duplicate)
      continue;
    }
    tune(fd);
    c.links[static_cast<size_t>(h.rank)]->fd = fd;
    --expected;
  }
  std::string peers;
  for (const auto& link : c.links) {
    if (!link) continue;
    set_nonblocking(link->fd);
    peers += (peers.empty() ? "" : ", ") + link->who;
  }
  if (!peers.empty()) info("rank " + std::to_string(c.rank) + " reaches over the network: " + peers);
  return ncclSuccess;
}

namespace {

// Writes all of data[0..n) unless the peer does not take it before `deadline`.
bool send_by(int fd, const char* data, size_t n, std::chrono::steady_clock::time_point deadline) {
  while (n > 0 && std::chrono::steady_clock::now() < deadline) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd pfd{fd, POLLOUT, 0};
      ::poll(&pfd, 1, 10);
      continue;
    }
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return n == 0;
}

void say_goodbye(NetLink& l, const std::string& reason) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kGoodbyeMs);
  // A frame cut short by the failure is finished with zeros: the peer must find the goodbye at a frame boundary, and
  // the chunk's source may be gone. Its contents do not matter any more: the communicator failed.
  if (l.out_done > 0) {
    const std::vector<char> zeros(sizeof(l.out_len) + l.out_len - l.out_done, 0);
    if (!send_by(l.fd, zeros.data(), zeros.size(), deadline)) return;
  }
  const std::string text = reason.substr(0, kGoodbyeMax);
  const uint64_t len = kGoodbye | text.size();
  if (send_by(l.fd, reinterpret_cast<const char*>(&len), sizeof(len), deadline)) {
    send_by(l.fd, text.data(), text.size(), deadline);
  }
}

}  // namespace

void net_close(Comm& c, const std::string& reason) {
  if (!reason.empty()) {
    for (const auto& link : c.links) {
      if (link && link->fd >= 0 && link->failure.empty()) say_goodbye(*link, reason);
    }
  }
  c.links.clear();
  if (c.listen_fd >= 0) ::close(c.listen_fd);
  c.listen_fd = -1;
}

namespace {

void fail(NetLink& l, const std::string& why) {
  if (l.failure.empty()) l.failure = why;
}

std::string os_failure(NetLink& l, int e) {
  // A host that stopped answering takes all its ranks: name them, not only the peer whose connection noticed first.
  if (e == ETIMEDOUT) {
    return l.who + " is unreachable: nothing acknowledged for " + std::to_string(net_timeout_ms()) +
           " ms (NCCL_EMU_NET_TIMEOUT_MS; a cut link or a dead host): lost " + l.host_ranks;
  }
  if (e == ECONNRESET || e == EPIPE || e == 0) {  // 0: an orderly end of file
    return l.who + " closed its connection: its process exited or aborted its communicator";
  }
  if (e == EHOSTUNREACH || e == ENETUNREACH || e == ENETDOWN) {
    return l.who + " is unreachable (" + std::strerror(e) + "): lost " + l.host_ranks;
  }
  return "the connection to " + l.who + " failed: " + std::strerror(e);
}

}  // namespace

NetLink* net_link(Comm& c, int peer) { return c.links.empty() ? nullptr : c.links[static_cast<size_t>(peer)].get(); }


bool net_push(NetLink& l, const char* src, size_t n) {
  if (!l.failure.empty()) return false;
  if (l.out_done == 0) l.out_len = n;
  while (l.out_done < sizeof(l.out_len) + n) {
    iovec iov[2];
    int k = 0;
    if (l.out_done < sizeof(l.out_len)) {
      iov[k++] = {reinterpret_cast<char*>(&l.out_len) + l.out_done, sizeof(l.out_len) - l.out_done};
      iov[k++] = {const_cast<char*>(src), n};
    } else {
      const size_t at = l.out_done - sizeof(l.out_len);
      iov[k++] = {const_cast<char*>(src) + at, n - at};
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(k);
    const ssize_t w = ::sendmsg(l.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (w < 0) {
      fail(l, os_failure(l, errno));
      return false;
    }
    l.out_done += static_cast<size_t>(w);
  }
  l.out_done = 0;
  return true;
}

bool net_pull(NetLink& l) {
  bool progress = false;
  while (l.failure.empty() && l.tail - l.head < kNetSlots) {
    char* dst;
    size_t want;
    if (l.fill < sizeof(l.in_len)) {
      dst = reinterpret_cast<char*>(&l.in_len) + l.fill;
      want = sizeof(l.in_len) - l.fill;
    } else if (l.in_len & kGoodbye) {
      dst = l.bye + (l.fill - sizeof(l.in_len));
      want = sizeof(l.in_len) + (l.in_len & ~kGoodbye) - l.fill;
    } else {
      dst = l.slot(l.tail) + (l.fill - sizeof(l.in_len));
      want = sizeof(l.in_len) + l.in_len - l.fill;
    }
    const ssize_t k = ::recv(l.fd, dst, want, MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (k <= 0) {
      fail(l, os_failure(l, k == 0 ? 0 : errno));
      break;
    }
    l.fill += static_cast<size_t>(k);
    if ((l.in_len & kGoodbye) && l.fill == sizeof(l.in_len) + (l.in_len & ~kGoodbye)) {
      fail(l, l.who + " gave up on the communicator: " + std::string(l.bye, l.in_len & ~kGoodbye));
      l.gave_up = true;
      break;
    }
    if (l.fill == sizeof(l.in_len) && (l.in_len & ~kGoodbye) > ((l.in_len & kGoodbye) ? kGoodbyeMax : l.chunk)) {
      fail(l, l.who + " sent a frame of " + std::to_string(l.in_len) + " bytes, more than a chunk (" +
                  std::to_string(l.chunk) + "): NCCL_EMU_CHUNK_BYTES differs or the stream is corrupt");
      break;
    }
    if (l.fill == sizeof(l.in_len) + l.in_len) {
      l.lens[l.tail % kNetSlots] = l.in_len;
      ++l.tail;
      if (l.closed_frames > 0) --l.closed_frames;  // one of those peek_closed counted in the kernel
      l.fill = 0;
      progress = true;
    }
  }
  return progress;
}

const char* net_front(NetLink& l, size_t* bytes) {
  if (l.tail == l.head) return nullptr;
  *bytes = l.lens[l.head % kNetSlots];
  return l.slot(l.head);
}

void net_pop(NetLink& l) { ++l.head; }

bool net_gave_up(const NetLink& l) { return l.gave_up; }

size_t net_buffered(const NetLink& l) { return static_cast<size_t>(l.tail - l.head) + l.closed_frames; }

const std::string& net_failure(const NetLink& l) { return l.failure.empty() ? l.closed_why : l.failure; }

namespace {

// The peer shut its end while this side's slots are full: everything it sent is in the kernel's buffer, behind
// the chunks this phase has yet to consume. Counts the whole chunks there and reads its goodbye, without consuming
// anything, so the phase knows at once whether what it needs will come.
void peek_closed(NetLink& l) {
  l.peeked = true;
  int avail = 0;
  if (::ioctl(l.fd, FIONREAD, &avail) != 0 || avail < 0) return;
  std::vector<char> buf(static_cast<size_t>(avail));
  const ssize_t k = ::recv(l.fd, buf.data(), buf.size(), MSG_PEEK | MSG_DONTWAIT);
  if (k < 0) return;
  size_t at = 0;
  l.closed_why = l.who + " closed its connection: its process exited or aborted its communicator";
  while (at + sizeof(uint64_t) <= static_cast<size_t>(k)) {
    uint64_t len = 0;
    std::memcpy(&len, buf.data() + at, sizeof(len));
    const size_t body = static_cast<size_t>(len & ~kGoodbye);
    if (at + sizeof(len) + body > static_cast<size_t>(k)) break;
    if (len & kGoodbye) {
      l.closed_why = l.who + " gave up on the communicator: " + std::string(buf.data() + at + sizeof(len), body);
      l.gave_up = true;
      break;
    }
    ++l.closed_frames;
    at += sizeof(len) + body;
  }
}

}  // namespace

void net_wait(Comm& c, const std::vector<bool>& sending, int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<NetLink*> of;
  for (const auto& link : c.links) {
    if (!link || !link->failure.empty()) continue;
    short ev = 0;
    if (link->tail - link->head < kNetSlots) ev |= POLLIN | POLLRDHUP;
    if (link->tail - link->head == kNetSlots && !link->peeked) ev |= POLLRDHUP;
    if (sending[static_cast<size_t>(link->peer)]) ev |= POLLOUT;
    if (ev == 0) continue;  // nothing to do with it now; a hang-up it reports would wake every poll at once
    fds.push_back(pollfd{link->fd, ev, 0});
    of.push_back(link.get());
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    const short r = fds[i].revents;
    // Read what came now, whoever it is from: a peer this phase does not wait for yet would otherwise keep the poll
    // returning at once, and its end of file (an exited rank) would go unseen.
    if (r & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) net_pull(*of[i]);
    if ((r & POLLRDHUP) && of[i]->tail - of[i]->head == kNetSlots && !of[i]->peeked) peek_closed(*of[i]);
    if ((r & POLLERR) && of[i]->failure.empty()) {
      int e = 0;
      socklen_t l = sizeof(e);
      ::getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &e, &l);
      if (e != 0) fail(*of[i], os_failure(*of[i], e));
    }
  }
}

}  // namespace ncclemu
