// The unique id and the ranks' rendezvous, in the shape of NCCL's bootstrap: ncclGetUniqueId starts a root in the
// calling process and writes its address into the id; every rank's init sends the root its record and gets back
// everyone's, in rank order. The root is a thread that serves one communicator and exits. It listens on an abstract
// Unix socket (Linux; nothing on the file system, gone with the process), which ranks on its own host use, and on a
// TCP socket on the interface NCCL would pick (net.cc), which ranks on other hosts use, as NCCL's bootstrap does: the
// id holds both addresses and a hash of the root's hostname to choose between them.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "nccl_emu.h"

namespace ncclemu {
namespace {

using gpucoll::ncclInvalidArgument;
using gpucoll::ncclInvalidUsage;
using gpucoll::ncclSuccess;
using gpucoll::ncclSystemError;

constexpr char kIdMagic[8] = {'N', 'C', 'C', 'L', '-', 'E', 'M', 'U'};

struct IdLayout {
  char magic[8];
  uint64_t nonce;
  uint64_t host_hash;  // of the root's hostname
  char name[48];       // the Unix socket's abstract name (without the leading NUL)
  uint8_t tcp[28];     // the TCP listener's sockaddr
  uint32_t tcp_len;
};
static_assert(sizeof(IdLayout) <= sizeof(ncclUniqueId), "the id layout must fit NCCL's 128 bytes");

// The root's answer: a status, then (on success) `n` records.
struct Reply {
  int32_t status;
  int32_t n;
  char message[248];
};

sockaddr_un address(const char* name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = strnlen(name, sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name, n);  // sun_path[0] == '\0': the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

bool send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Reads exactly n bytes; gives up after `timeout_ms` without data or when `abort` is set.
bool recv_all(int fd, void* data, size_t n, int timeout_ms, const std::atomic<bool>* abort) {
  char* p = static_cast<char*>(data);
  int waited = 0;
  while (n > 0) {
    if (abort != nullptr && abort->load(std::memory_order_acquire)) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, 20);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) {
      waited += 20;
      if (timeout_ms >= 0 && waited >= timeout_ms) return false;
      continue;
    }
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void reply_error(int fd, ncclResult_t status, const std::string& text) {
  Reply r{};
  r.status = status;
  std::strncpy(r.message, text.c_str(), sizeof(r.message) - 1);
  send_all(fd, &r, sizeof(r));
}

uint64_t host_hash() {
  char host[64];
  my_host(host, sizeof(host));
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < sizeof(host) && host[i] != '\0'; ++i) {
    h = (h ^ static_cast<unsigned char>(host[i])) * 1099511628211ull;
  }
  return h;
}

// Serves one communicator: waits for every rank's record, checks that they agree, sends each rank the table.
void root_main(int unix_fd, int tcp_fd, uint64_t nonce) {
  std::vector<int> conns;
  std::vector<RankInfo> infos;
  int nranks = -1, joined = 0;
  while (nranks < 0 || joined < nranks) {
    pollfd pfd[2] = {{unix_fd, POLLIN, 0}, {tcp_fd, POLLIN, 0}};
    if (::poll(pfd, tcp_fd >= 0 ? 2 : 1, 1000) <= 0) continue;
    const int from = (pfd[0].revents & POLLIN) ? unix_fd : tcp_fd;
    const int fd = ::accept4(from, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    RankInfo info;
    if (!recv_all(fd, &info, sizeof(info), 10000, nullptr) || info.magic != nonce) {
      reply_error(fd, ncclInvalidArgument, "this unique id belongs to another communicator");
      ::close(fd);
      continue;
    }
    if (nranks < 0) {
      nranks = info.nranks;
      conns.assign(static_cast<size_t>(nranks), -1);
      infos.resize(static_cast<size_t>(nranks));
    }
    std::string bad;
    if (info.nranks != nranks) {
      bad = "rank " + std::to_string(info.rank) + " called init with nranks " + std::to_string(info.nranks) +
            ", another rank with " + std::to_string(nranks);
    } else if (info.rank < 0 || info.rank >= nranks) {
      bad = "rank " + std::to_string(info.rank) + " is outside [0, " + std::to_string(nranks) + ")";
    } else if (conns[static_cast<size_t>(info.rank)] >= 0) {
      bad = "two ranks called init as rank " + std::to_string(info.rank);
    }
    if (!bad.empty()) {
      reply_error(fd, ncclInvalidUsage, bad);
      ::close(fd);
      continue;
    }
    conns[static_cast<size_t>(info.rank)] = fd;
    infos[static_cast<size_t>(info.rank)] = info;
    ++joined;
  }
  Reply ok{};
  ok.status = ncclSuccess;
  ok.n = nranks;
  for (int fd : conns) {
    if (send_all(fd, &ok, sizeof(ok))) send_all(fd, infos.data(), infos.size() * sizeof(RankInfo));
    ::close(fd);
  }
  ::close(unix_fd);
  if (tcp_fd >= 0) ::close(tcp_fd);
}

}  // namespace

ncclResult_t make_unique_id(ncclUniqueId* id) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (counter.fetch_add(1) << 48);
  IdLayout layout{};
  std::memcpy(layout.magic, kIdMagic, sizeof(kIdMagic));
  layout.nonce = nonce;
  std::snprintf(layout.name, sizeof(layout.name), "gpucoll-nccl-emu/%d/%llu", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(nonce));
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return warn(ncclSystemError, std::string("ncclGetUniqueId: socket: ") + std::strerror(errno));
  socklen_t len = 0;
  const sockaddr_un a = address(layout.name, &len);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0 || ::listen(fd, 1024) != 0) {
    const int e = errno;
    ::close(fd);
    return warn(ncclSystemError, std::string("ncclGetUniqueId: bootstrap root: ") + std::strerror(e));
  }
  sockaddr_storage tcp{};
  socklen_t tcp_len = sizeof(tcp);
  std::string error;
  const int tcp_fd = net_listen_on(&tcp, &tcp_len, &error);
  if (tcp_fd < 0) {
    ::close(fd);
    return warn(ncclSystemError, "ncclGetUniqueId: bootstrap root: " + error);
  }
  layout.host_hash = host_hash();
  std::memcpy(layout.tcp, &tcp, std::min<size_t>(tcp_len, sizeof(layout.tcp)));
  layout.tcp_len = tcp_len;
  info("bootstrap root listening on " + address_text(&tcp, tcp_len) + " and on this host's abstract socket");
  std::thread(root_main, fd, tcp_fd, nonce).detach();
  std::memset(id, 0, sizeof(*id));
  std::memcpy(id->internal, &layout, sizeof(layout));
  return ncclSuccess;
}

ncclResult_t rendezvous(const ncclUniqueId& id, const RankInfo& mine_in, const std::atomic<bool>& abort,
                        std::vector<RankInfo>* all, std::string* error) {
  IdLayout layout;
  std::memcpy(&layout, id.internal, sizeof(layout));
  if (std::memcmp(layout.magic, kIdMagic, sizeof(kIdMagic)) != 0) {
    *error = "the unique id was not made by ncclGetUniqueId of this library";
    return ncclInvalidArgument;
  }
  layout.name[sizeof(layout.name) - 1] = '\0';
  RankInfo mine = mine_in;
  mine.magic = layout.nonce;
  if (mine.host[0] == '\0') my_host(mine.host, sizeof(mine.host));
  // The root's own host: its Unix socket, as before the network existed; any other host: TCP.
  const bool local = layout.host_hash == host_hash() && !net_forced();
  sockaddr_storage tcp{};
  std::memcpy(&tcp, layout.tcp, std::min<size_t>(layout.tcp_len, sizeof(tcp)));
  int fd = -1, e = 0;
  if (local) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *error = std::string("socket: ") + std::strerror(errno);
      return ncclSystemError;
    }
    socklen_t len = 0;
    const sockaddr_un a = address(layout.name, &len);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
      e = errno;
      ::close(fd);
      fd = -1;
    }
  } else {
    fd = net_dial(layout.tcp, layout.tcp_len, abort, &e);
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // send_all below blocks
  }
  if (fd < 0) {
    *error = std::string("cannot reach the bootstrap root at ") +
             (local ? "this host's abstract socket" : address_text(&tcp, layout.tcp_len)) + " (" + std::strerror(e) +
             "): the process that called ncclGetUniqueId exited, or this id was already used";
    return gpucoll::ncclRemoteError;
  }
  Reply reply{};
  if (!send_all(fd, &mine, sizeof(mine)) || !recv_all(fd, &reply, sizeof(reply), -1, &abort)) {
    *error = abort.load() ? "aborted while waiting for the other ranks" : "lost the bootstrap root";
    ::close(fd);
    return abort.load() ? gpucoll::ncclInternalError : gpucoll::ncclRemoteError;
  }
  if (reply.status != ncclSuccess) {
    reply.message[sizeof(reply.message) - 1] = '\0';
    *error = reply.message;
    ::close(fd);
    return static_cast<ncclResult_t>(reply.status);
  }
  all->assign(static_cast<size_t>(reply.n), RankInfo{});
  const bool ok = recv_all(fd, all->data(), all->size() * sizeof(RankInfo), 10000, &abort);
  ::close(fd);
  if (!ok) {
    *error = "lost the bootstrap root while reading the ranks' records";
    return gpucoll::ncclRemoteError;
  }
  return ncclSuccess;
}

}  // namespace ncclemu
