// Internals of gpucoll's NCCL stand-in (libnccl-emu.so): a library with NCCL's C ABI that runs on the emulated CUDA
// device, so that gpucoll's NCCL communicator (csrc/backends/nccl/cuda/) and the Python NCCL backend execute without a
// GPU. It stands for NCCL only: the code under test is gpucoll's, loaded through gpucoll's normal NCCL loader.
//
// Map of the library:
//   api_comm.cc   communicator life cycle: version, errors, unique id, init (blocking and not), split, finalize,
//                 destroy, abort, asynchronous errors, the fault-injection entry point
//   api_ops.cc    argument checks, groups, collectives, send/recv, premul-sum ops, and the launch of a group's work
//                 onto the caller's streams (cudaLaunchHostFunc)
//   bootstrap.cc  the unique id and the rendezvous of the ranks (served by the process that made the id, as NCCL's
//                 bootstrap root: an abstract Unix socket for its own host, TCP for the others)
//   net.cc        the network between hosts: interface choice, a TCP connection per pair of ranks on different
//                 hosts, with the mailbox channel's semantics (NCCL's socket transport)
//   transport.cc  per-rank mailboxes in IPC-shared device memory, one FIFO channel per ordered pair of ranks, and the
//                 engine that runs a group's collectives and send/recv through them on the stream's own thread
//   arith.cc      NCCL's arithmetic per dtype x op (fp16/bf16/fp8 rounding, integer avg as sum then divide)
//   faults.cc     NCCL_EMU_FAULT / ncclEmuInjectFault: a rank that never arrives, an asynchronous error at operation N
//
// Semantics followed (NCCL 2.23+): a non-blocking communicator runs init, split, finalize and every group launch on a
// thread of its own and reports ncclInProgress until that thread finished (polled with ncclCommGetAsyncError); a call
// on a communicator still in progress is ncclInvalidArgument; an argument error is returned at once and, for a
// non-blocking communicator, kept as its asynchronous error. Operations of one communicator execute in the order they
// were issued, whatever stream they are on (NCCL orders its kernels the same way). ncclCommAbort ends work that waits
// for peers. Data between ranks of one host moves only through device memory they mapped with CUDA IPC, as NCCL's P2P
// transport does; between hosts only over TCP, as its socket transport does.
#pragma once

#include <cuda_runtime_api.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "backends/nccl/nccl_api.h"

#define NCCLEMU_API extern "C" __attribute__((visibility("default")))

// Every entry point of gpucoll's function table, declared with the table's own types (nccl_api.h, which
// tests/nccl/test_nccl_abi.py checks against the real nccl.h): a definition here whose signature drifts is a
// conflicting declaration of a C function, a compile error.
#define NCCLEMU_DECLARE(name, required) NCCLEMU_API std::remove_pointer_t<gpucoll::PFN_##name> name;
GPUCOLL_NCCL_FUNCTIONS(NCCLEMU_DECLARE)
#undef NCCLEMU_DECLARE

namespace ncclemu {

using gpucoll::ncclConfig_t;
using gpucoll::ncclDataType_t;
using gpucoll::ncclRedOp_t;
using gpucoll::ncclResult_t;
using gpucoll::ncclUniqueId;

// ---- api_comm.cc -------------------------------------------------------------------------------------------------
// The NCCL version this library reports: NCCL_EMU_VERSION (a version code such as 22800), else 2.32.3.
int version();
// Records `text` as the process's last error (ncclGetLastError) and, with NCCL_DEBUG set, prints it. Returns `r`.
ncclResult_t warn(ncclResult_t r, const std::string& text);
void info(const std::string& text);

// ---- arith.cc ----------------------------------------------------------------------------------------------------
// A reduction as the device runs it (NCCL's ncclDevRedOpFull): min/max, sum, prod, a pre-multiplied sum (ncclAvg on
// floating types and user premul ops) or a sum divided afterwards (ncclAvg on integer types).
struct DevOp {
  enum Kind { kSum, kProd, kMin, kMax, kPreMulSum, kSumPostDiv } kind = kSum;
  uint64_t scalar = 0;             // the premul factor's bits in the element type, or the divisor
  const void* scalar_ptr = nullptr;  // ncclScalarDevice: read when the operation runs
};
size_t type_size(ncclDataType_t t);  // 0 for an invalid type
bool is_fp8(ncclDataType_t t);
// The device form of `op` on `t` for `nranks` ranks; false for ops this function does not know (user ops).
bool builtin_op(ncclRedOp_t op, ncclDataType_t t, int nranks, DevOp* out);
// The bits of a host-immediate premul scalar of type `t` (copied from `scalar`).
uint64_t scalar_bits(const void* scalar, ncclDataType_t t);
// dst[i] = reduce over r in 0..n-1 of srcs[r][i] (rank order), with NCCL's pre- and post-operations. dst may alias
// any source element for element.
void reduce(ncclDataType_t t, const DevOp& op, const void* const* srcs, int n, void* dst, size_t count);

// ---- faults.cc ---------------------------------------------------------------------------------------------------
struct Fault {
  enum Kind { kNone, kInitHang, kHang, kError } kind = kNone;
  int op = 0;    // 1-based operation the fault fires at (kHang, kError)
  int rank = -1; // only communicators where this process has this rank; -1: any
  ncclResult_t code = gpucoll::ncclRemoteError;
};
// Whether this process's rank `rank` should never arrive at its init (one-shot).
bool fault_at_init(int rank);
// The fault for the operation being launched now on a communicator where this process has `rank` (one-shot).
Fault::Kind fault_at_launch(int rank, ncclResult_t* code, int* op);

// ---- the communicator --------------------------------------------------------------------------------------------
struct Comm;
struct NetLink;

// A user-created reduction op (ncclRedOpCreatePreMulSum).
struct UserOp {
  bool live = false;
  ncclDataType_t type = gpucoll::ncclFloat32;
  DevOp op;
};

enum class Coll { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter, kAllToAll, kGather, kScatter, kSend,
                  kRecv };
const char* coll_name(Coll c);

// One call, checked and with its op resolved (a premul op may be destroyed before its group ends).
struct Task {
  Coll coll = Coll::kAllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements: per rank-block for the blocked collectives, as in NCCL's API
  ncclDataType_t type = gpucoll::ncclFloat32;
  DevOp op;
  int root = 0;  // root, or the peer of send/recv
  cudaStream_t stream = nullptr;
};

// What one launch runs on one communicator: the tasks a group issued on it (one task outside groups).
struct Plan {
  std::shared_ptr<Comm> comm;
  std::vector<Task> tasks;
  bool captured = false;  // a host node of a graph: replays run it again, so it is never freed
  uint64_t ticket = 0;    // its place in the communicator's execution order (eager plans)
  Fault::Kind fault = Fault::kNone;
  ncclResult_t fault_code = gpucoll::ncclSuccess;
  int fault_op = 0;
};

// The work of a non-blocking call running on a thread of its own; the first ncclCommGetAsyncError that finds the
// communicator no longer in progress joins it.
struct Job {
  std::thread thread;
  std::atomic<bool> done{false};
  // Nobody may have joined it: async_state joins only a job it finds done, and a later job replaces it on its
  // communicator, so the last reference can go with the job's own lambda, on its own thread, when the thread ends.
  // A joinable std::thread destroyed is std::terminate ("terminate called without an active exception", seen under
  // load at the end of DDP runs and in NCCL init).
  ~Job() {
    if (!thread.joinable()) return;
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();
    } else {
      thread.join();
    }
  }
};

// Peer state as the bootstrap exchanges it.
struct RankInfo {
  uint64_t magic = 0;
  int32_t rank = -1, nranks = 0, device = -1, pid = 0;
  int32_t version = 0, multi_rank_ok = 0;
  int32_t color = 0, key = 0;        // ncclCommSplit
  uint64_t mailbox = 0;              // the mailbox's address in its own process (peers in the same process use it)
  uint64_t mailbox_bytes = 0;
  uint64_t chunk = 0;                // channel slot size (NCCL_EMU_CHUNK_BYTES), equal on every rank
  cudaIpcMemHandle_t handle{};
  char host[64] = {};                // gethostname(): ranks of one host share mailboxes, others the network
  uint8_t net_addr[28] = {};         // the sockaddr this rank's communicator listens on (net.cc)
  uint32_t net_addr_len = 0;
  uint64_t net_token = 0;            // what a connecting peer must present to that listener
};

struct Comm {
  uint64_t id = 0;  // for messages
  int rank = 0, nranks = 1, device = 0, cc_major = 0;
  bool blocking = true;
  // ncclSuccess, ncclInProgress (a launch, init, split or finalize still running) or a sticky error.
  std::atomic<int> async{gpucoll::ncclSuccess};
  std::atomic<bool> aborted{false};
  std::atomic<bool> finalized{false};
  std::atomic<int> running{0};  // host functions of this communicator inside the engine
  std::mutex mu;                // job, error text, user ops, pending tasks
  std::shared_ptr<Job> job;
  std::string error;            // text of the asynchronous error
  std::vector<UserOp> user_ops;
  std::vector<Task> pending;    // tasks of the calling thread's open group

  // Execution order: eager plans take a ticket at launch and run when `turn` reaches it; every plan (captured ones
  // too) runs under exec_mu, so the channels see one plan at a time.
  std::mutex launch_mu;
  uint64_t next_ticket = 0;     // guarded by launch_mu
  std::mutex turn_mu;
  std::condition_variable turn_cv;
  uint64_t turn = 0;            // guarded by turn_mu
  std::mutex exec_mu;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;  // joining the streams of a multi-stream group

  // Transport (transport.cc).
  char* mailbox = nullptr;              // this rank's, in its own device memory
  size_t mailbox_bytes = 0;
  std::vector<char*> peer_mailbox;      // every rank's mailbox as mapped here (own at rank)
  std::vector<bool> peer_ipc;           // whether peer_mailbox[r] came from cudaIpcOpenMemHandle
  std::vector<uint64_t> send_tail;      // chunks sent to each peer (the sender's copy of that channel's tail)
  std::vector<uint64_t> recv_head;      // chunks consumed from each peer
  std::mutex release_mu;
  bool released = false;                // guarded by release_mu

  // Network (net.cc): a connection per peer on another host (null for the others), and this rank's listener.
  std::vector<std::shared_ptr<NetLink>> links;
  int listen_fd = -1;
  uint64_t net_token = 0;
};

// ncclConfig_t's blocking field (`fallback_blocking` where unset); false with `error` for a malformed config.
bool read_config(const ncclConfig_t* config, int fallback_blocking, int* blocking, std::string* error);
// This process's record for the rendezvous and splits (rank, device, pid, version; transport fields unset).
RankInfo my_info(const Comm& c);
// A communicator's state before its transport exists; its events once the transport is connected.
std::shared_ptr<Comm> new_comm(int rank, int nranks, int device, int blocking);
ncclResult_t finish_setup(Comm& c, std::string* error);
// Runs `body` as the communicator's job: on a thread of its own, joined by async_state, abort or destroy.
void start_job(Comm& c, std::function<void()> body);
// Sets the communicator's asynchronous state; an error already there stays (NCCL keeps the first).
void set_async(Comm& c, ncclResult_t r, const std::string& text = "");
// Waits, checking abort, until every plan launched so far executed; false when aborted meanwhile.
bool drain(Comm& c);
// Frees the transport (mailbox, peer mappings, events) once no host function uses it. Idempotent.
void release(Comm& c);
// The communicator behind a handle, or an error (ncclInvalidArgument) naming `op`.
Comm* checked(gpucoll::ncclComm_t h, const char* op, ncclResult_t* error);
// NCCL's ncclCommEnsureReady: ncclInvalidArgument while a previous non-blocking call is in progress, the kept error
// after an asynchronous one, ncclInvalidUsage after ncclCommFinalize.
ncclResult_t ensure_ready(Comm& c, const char* op);
// ncclCommGetAsyncError's read: joins a finished job.
ncclResult_t async_state(Comm& c);
// The scalar result of waiting for `turn` to reach `ticket`; false when aborted.
bool wait_turn(Comm& c, uint64_t ticket);
void finish_turn(Comm& c, uint64_t ticket);

// ---- api_ops.cc --------------------------------------------------------------------------------------------------
// Launches `p` on its tasks' streams (the caller's thread or a job's); the error of the launch.
ncclResult_t launch(std::unique_ptr<Plan> p);
// Makes `device` current and the thread's capture mode relaxed for the scope, as NCCL's own threads and allocations
// do, so that its allocations do not break (or get refused by) a capture another thread runs.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// ---- bootstrap.cc ------------------------------------------------------------------------------------------------
ncclResult_t make_unique_id(ncclUniqueId* id);
// Sends `mine` to the id's root and returns everyone's records (rank order). Waits, checking `abort`, for all ranks.
ncclResult_t rendezvous(const ncclUniqueId& id, const RankInfo& mine, const std::atomic<bool>& abort,
                        std::vector<RankInfo>* all, std::string* error);

// ---- transport.cc ------------------------------------------------------------------------------------------------
size_t mailbox_bytes(int nranks);
// Allocates and zeroes this rank's mailbox and fills the transport fields of `info`.
ncclResult_t transport_alloc(Comm& c, RankInfo* info, std::string* error);
// Maps every peer's mailbox from the exchanged records.
ncclResult_t transport_connect(Comm& c, const std::vector<RankInfo>& all, std::string* error);
// Runs `tasks` (one launch) on the calling thread. ncclSuccess, or ncclInternalError with `error` set for a protocol
// failure (mismatched sizes between ranks); returns early, with ncclSuccess, once the communicator is aborted.
ncclResult_t execute(Comm& c, const std::vector<Task>& tasks, std::string* error);

// ---- net.cc ------------------------------------------------------------------------------------------------------
// NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1: every peer, even on this host, over the network (and the bootstrap too).
bool net_forced();
// Whether two ranks share mailboxes (same hostname, unless NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1).
bool same_host(const RankInfo& a, const RankInfo& b);
// This machine's hostname into out[0..n), NUL-padded.
void my_host(char* out, size_t n);
// A listening TCP socket on the interface NCCL would choose, its address in *addr; -1 with `error`.
int net_listen_on(sockaddr_storage* addr, socklen_t* len, std::string* error);
std::string address_text(const void* addr, size_t len);
// A TCP connection to addr (non-blocking, keepalives on); -1 with *err (errno) on failure, timeout (30 s) or abort.
int net_dial(const void* addr, socklen_t len, const std::atomic<bool>& abort, int* err);
// Fills `info`'s host and listener fields (transport_alloc).
ncclResult_t net_listen(Comm& c, RankInfo* info, std::string* error);
// Connects to every rank on another host (transport_connect); returns early, with ncclSuccess, on abort.
ncclResult_t net_connect(Comm& c, const std::vector<RankInfo>& all, std::string* error);
// Closes every connection; with a `reason` (the communicator failed), sends it to each peer still connected first.
void net_close(Comm& c, const std::string& reason);
// The channel to `peer` over the network, or null when it goes through the mailboxes.
NetLink* net_link(Comm& c, int peer);
// Why the link cannot be used any more (names the peer); empty while it can.
const std::string& net_failure(const NetLink& l);
// Writes what it can of the chunk src[0..n); true once all of it went out. Call again with the same chunk until then.
bool net_push(NetLink& l, const char* src, size_t n);
// Reads arrived chunks into free slots; whether any chunk completed.
bool net_pull(NetLink& l);
// The oldest arrived chunk (its size in *bytes), or null; net_pop frees it.
const char* net_front(NetLink& l, size_t* bytes);
void net_pop(NetLink& l);
size_t net_buffered(const NetLink& l);  // chunks arrived and not yet popped
bool net_gave_up(const NetLink& l);     // the peer's communicator failed (its goodbye arrived)
// Sleeps up to timeout_ms for any link to become readable, writable (peers with sending[p]) or failed.
void net_wait(Comm& c, const std::vector<bool>& sending, int timeout_ms);

}  // namespace ncclemu

// The handle NCCL's API passes around. Handles are never freed: a call on a destroyed or aborted communicator is
// ncclInvalidArgument here, where NCCL's would be a use after free.
struct gpucoll::ncclComm {
  static constexpr uint64_t kMagic = 0x314d45434c43434eull;  // "NCCLCEM1"
  uint64_t magic = kMagic;
  std::shared_ptr<ncclemu::Comm> comm;
  std::atomic<bool> gone{false};
};
