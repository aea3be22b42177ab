// The communicator's life cycle with NCCL's entry points and semantics: version, error strings, the unique id, init
// (blocking, or non-blocking on a thread of its own, reporting ncclInProgress until done), finalize, destroy, abort
// (which ends work waiting for peers) and the asynchronous state. Split and shrink: api_split.cc.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "nccl_emu.h"

namespace ncclemu {

using namespace gpucoll;  // NCCL's enum values (nccl_api.h)

namespace {

std::mutex g_err_mu;
std::string g_last_error;  // ncclGetLastError: NCCL keeps one for the process
thread_local std::string t_error_copy;
std::atomic<uint64_t> g_next_id{1};

int debug_level() {
  static const int level = [] {
    const char* env = std::getenv("NCCL_DEBUG");
    if (env == nullptr) return 0;
    const std::string v(env);
    if (v == "WARN") return 1;
    if (v == "INFO" || v == "TRACE") return 2;
    return 0;
  }();
  return level;
}

void log_line(const char* level, const std::string& text) {
  std::fprintf(stderr, "pid %d NCCL-EMU %s %s\n", static_cast<int>(::getpid()), level, text.c_str());
}

// The parts of ncclConfig_t this library reads; false (with `error`) for a config not made by NCCL_CONFIG_INITIALIZER.
}  // namespace

bool read_config(const ncclConfig_t* config, int fallback_blocking, int* blocking, std::string* error) {
  *blocking = fallback_blocking;
  if (config == nullptr) return true;
  ncclConfig_t c{};
  std::memcpy(&c.size, &config->size, sizeof(c.size));
  if (c.size < offsetof(ncclConfig_t, blocking) + sizeof(int)) {
    *error = "ncclConfig_t has size " + std::to_string(c.size) + "; initialize it with NCCL_CONFIG_INITIALIZER";
    return false;
  }
  std::memcpy(&c, config, std::min(c.size, sizeof(c)));
  if (c.magic != kNcclApiMagic) {
    *error = "ncclConfig_t was not initialized with NCCL_CONFIG_INITIALIZER (bad magic)";
    return false;
  }
  if (c.blocking != kNcclConfigUndefInt && c.blocking != 0 && c.blocking != 1) {
    *error = "ncclConfig_t.blocking must be 0 or 1; got " + std::to_string(c.blocking);
    return false;
  }
  if (c.blocking != kNcclConfigUndefInt) *blocking = c.blocking;
  return true;
}

// Whether this process lets ranks share a GPU: NCCL >= 2.30 with its NCCL_MULTI_RANK_GPU_ENABLE=1.
static bool multi_rank_ok() {
  const char* env = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  return version() >= 23000 && env != nullptr && std::string(env) == "1";
}

static void wait_for_abort(Comm& c) {
  while (!c.aborted.load(std::memory_order_acquire)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

RankInfo my_info(const Comm& c) {
  RankInfo i;
  i.rank = c.rank;
  i.nranks = c.nranks;
  i.device = c.device;
  i.pid = static_cast<int32_t>(::getpid());
  i.version = version();
  i.multi_rank_ok = multi_rank_ok() ? 1 : 0;
  return i;
}

static ncclResult_t check_gpus(const Comm& c, const std::vector<RankInfo>& all, std::string* error) {
  const RankInfo& me = all[static_cast<size_t>(c.rank)];
  for (const RankInfo& other : all) {
    // A GPU is one host's: device 0 of another host is another GPU (NCCL compares host hash and bus id).
    if (other.rank == c.rank || other.device != c.device || std::strncmp(other.host, me.host, sizeof(me.host)) != 0) {
      continue;
    }
    if (!multi_rank_ok()) {
      *error = "Duplicate GPU detected: rank " + std::to_string(c.rank) + " and rank " + std::to_string(other.rank) +
               " both on CUDA device " + std::to_string(c.device) +
               (version() >= 23000 ? " (NCCL_MULTI_RANK_GPU_ENABLE=1 lets ranks share a GPU)"
                                   : " (ranks share a GPU from NCCL 2.30 on)");
      return ncclInvalidUsage;
    }
  }
  return ncclSuccess;
}

ncclResult_t finish_setup(Comm& c, std::string* error) {
  cudaError_t e = cudaEventCreateWithFlags(&c.fork_event, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c.join_event, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *error = std::string("cudaEventCreate: ") + cudaGetErrorString(e);
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

static void init_job(const std::shared_ptr<Comm>& cp, ncclUniqueId id) {
  Comm& c = *cp;
  DeviceScope scope(c.device);
  if (fault_at_init(c.rank)) {
    info("injected fault: rank " + std::to_string(c.rank) + " never arrives at its init");
    wait_for_abort(c);
    return;
  }
  RankInfo mine = my_info(c);
  std::string error;
  std::vector<RankInfo> all;
  ncclResult_t r = transport_alloc(c, &mine, &error);
  if (r == ncclSuccess) r = rendezvous(id, mine, c.aborted, &all, &error);
  if (c.aborted.load()) return;
  if (r == ncclSuccess) r = check_gpus(c, all, &error);
  if (r == ncclSuccess) r = transport_connect(c, all, &error);
  if (r == ncclSuccess) r = finish_setup(c, &error);
  set_async(c, r, r == ncclSuccess ? "" : "init of rank " + std::to_string(c.rank) + ": " + error);
}

void start_job(Comm& c, std::function<void()> body) {
  auto job = std::make_shared<Job>();
  std::lock_guard<std::mutex> lock(c.mu);
  c.job = job;
  job->thread = std::thread([job, body = std::move(body)] {
    body();
    job->done.store(true, std::memory_order_release);
  });
}

static void join_job(Comm& c) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    job.swap(c.job);
  }
  if (job && job->thread.joinable()) job->thread.join();
}

std::shared_ptr<Comm> new_comm(int rank, int nranks, int device, int blocking) {
  auto c = std::make_shared<Comm>();
  c->id = g_next_id.fetch_add(1);
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  c->blocking = blocking != 0;
  cudaDeviceGetAttribute(&c->cc_major, cudaDevAttrComputeCapabilityMajor, device);
  return c;
}

int version() {
  static const int v = [] {
    const char* env = std::getenv("NCCL_EMU_VERSION");
    const long code = env != nullptr ? std::strtol(env, nullptr, 10) : 0;
    return code > 0 ? static_cast<int>(code) : 23203;  // 2.32.3, the nvidia-nccl-cu13 wheel gpucoll's ABI is checked on
  }();
  return v;
}

ncclResult_t warn(ncclResult_t r, const std::string& text) {
  {
    std::lock_guard<std::mutex> lock(g_err_mu);
    g_last_error = text;
  }
  if (debug_level() >= 1) log_line("WARN", text);
  return r;
}

void info(const std::string& text) {
  if (debug_level() >= 2) log_line("INFO", text);
}

DeviceScope::DeviceScope(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) cudaSetDevice(device);
  cudaThreadExchangeStreamCaptureMode(&mode_);
  cudaGetLastError();
}

DeviceScope::~DeviceScope() {
  cudaThreadExchangeStreamCaptureMode(&mode_);
  if (previous_ >= 0) {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  cudaGetLastError();
}

void set_async(Comm& c, ncclResult_t r, const std::string& text) {
  int cur = c.async.load();
  for (;;) {
    if (cur != ncclSuccess && cur != ncclInProgress) return;  // the first error stays
    if (c.async.compare_exchange_weak(cur, r)) break;
  }
  if (r != ncclSuccess && r != ncclInProgress && !text.empty()) {
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.error = text;
    }
    warn(r, text);
  }
}

ncclResult_t async_state(Comm& c) {
  const auto s = static_cast<ncclResult_t>(c.async.load());
  if (s != ncclInProgress) {
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.job && c.job->done.load(std::memory_order_acquire)) job.swap(c.job);
    }
    if (job && job->thread.joinable()) job->thread.join();
  }
  return s;
}

Comm* checked(ncclComm_t h, const char* op, ncclResult_t* error) {
  if (h == nullptr) {
    *error = warn(ncclInvalidArgument, std::string(op) + " : comm argument is NULL");
    return nullptr;
  }
  if (h->magic != gpucoll::ncclComm::kMagic) {
    *error = warn(ncclInvalidArgument, std::string(op) + " : corrupted comm object");
    return nullptr;
  }
  if (h->gone.load(std::memory_order_acquire)) {
    *error = warn(ncclInvalidArgument, std::string(op) + " : the communicator was destroyed or aborted");
    return nullptr;
  }
  *error = ncclSuccess;
  return h->comm.get();
}

ncclResult_t ensure_ready(Comm& c, const char* op) {
  if (c.finalized.load()) {
    return warn(ncclInvalidUsage, std::string(op) + " : the communicator was finalized (ncclCommFinalize)");
  }
  const ncclResult_t s = async_state(c);
  if (s == ncclInProgress) {
    return warn(ncclInvalidArgument, std::string(op) +
                                         " : attempt to use the communicator before the previous operation returned "
                                         "ncclSuccess (poll ncclCommGetAsyncError)");
  }
  return s;
}

bool wait_turn(Comm& c, uint64_t ticket) {
  std::unique_lock<std::mutex> lock(c.turn_mu);
  c.turn_cv.wait(lock, [&] { return c.turn == ticket || c.aborted.load(); });
  return !c.aborted.load();
}

void finish_turn(Comm& c, uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(c.turn_mu);
    if (c.turn <= ticket) c.turn = ticket + 1;
  }
  c.turn_cv.notify_all();
}

bool drain(Comm& c) {
  uint64_t last = 0;
  {
    std::lock_guard<std::mutex> lock(c.launch_mu);
    last = c.next_ticket;
  }
  std::unique_lock<std::mutex> lock(c.turn_mu);
  c.turn_cv.wait(lock, [&] { return c.turn >= last || c.aborted.load(); });
  return !c.aborted.load();
}

void release(Comm& c) {
  // No host function may be inside the engine when the mailboxes go: they see the abort within one sleep.
  while (c.running.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  std::lock_guard<std::mutex> lock(c.release_mu);
  if (c.released) return;
  c.released = true;
  DeviceScope scope(c.device);
  for (size_t r = 0; r < c.peer_mailbox.size(); ++r) {
    if (c.peer_ipc[r]) cudaIpcCloseMemHandle(c.peer_mailbox[r]);
  }
  c.peer_mailbox.clear();
  std::string reason;
  if (c.async.load() != ncclSuccess && c.async.load() != ncclInProgress) {
    std::lock_guard<std::mutex> lock(c.mu);
    reason = c.error;
  }
  net_close(c, reason);
  if (c.mailbox != nullptr) cudaFree(c.mailbox);
  c.mailbox = nullptr;
  if (c.fork_event != nullptr) cudaEventDestroy(c.fork_event);
  if (c.join_event != nullptr) cudaEventDestroy(c.join_event);
  c.fork_event = c.join_event = nullptr;
  cudaGetLastError();
}

}  // namespace ncclemu

using namespace ncclemu;

NCCLEMU_API ncclResult_t ncclGetVersion(int* v) {
  if (v == nullptr) return warn(ncclInvalidArgument, "ncclGetVersion : version argument is NULL");
  *v = version();
  return ncclSuccess;
}

NCCLEMU_API const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (NCCL stand-in on the emulated device; see ncclGetLastError)";
    case ncclSystemError:
      return "unhandled system error (NCCL stand-in; see ncclGetLastError)";
    case ncclInternalError:
      return "internal error (NCCL stand-in; see ncclGetLastError)";
    case ncclInvalidArgument:
      return "invalid argument (NCCL stand-in; see ncclGetLastError)";
    case ncclInvalidUsage:
      return "invalid usage (NCCL stand-in; see ncclGetLastError)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    case ncclTimeout:
      return "operation timed out";
    default:
      return "unknown result code";
  }
}

NCCLEMU_API const char* ncclGetLastError(ncclComm_t h) {
  if (h != nullptr && h->magic == gpucoll::ncclComm::kMagic && h->comm) {
    std::lock_guard<std::mutex> lock(h->comm->mu);
    if (!h->comm->error.empty()) {
      t_error_copy = h->comm->error;
      return t_error_copy.c_str();
    }
  }
  std::lock_guard<std::mutex> lock(g_err_mu);
  t_error_copy = g_last_error;
  return t_error_copy.c_str();
}

NCCLEMU_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return warn(ncclInvalidArgument, "ncclGetUniqueId : uniqueId argument is NULL");
  return make_unique_id(id);
}

NCCLEMU_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                                ncclConfig_t* config) {
  if (out == nullptr) return warn(ncclInvalidArgument, "ncclCommInitRank : newcomm argument is NULL");
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return warn(ncclInvalidArgument, "ncclCommInitRank : invalid rank " + std::to_string(rank) + " of " +
                                         std::to_string(nranks) + " ranks");
  }
  int blocking = 1;
  std::string error;
  if (!read_config(config, 1, &blocking, &error)) return warn(ncclInvalidArgument, "ncclCommInitRank : " + error);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return warn(ncclUnhandledCudaError, "ncclCommInitRank : cudaGetDevice failed");
  }
  std::shared_ptr<Comm> c = new_comm(rank, nranks, device, blocking);
  auto* h = new gpucoll::ncclComm();
  h->comm = c;
  info("init rank " + std::to_string(rank) + "/" + std::to_string(nranks) + " on device " + std::to_string(device) +
       (blocking ? " (blocking)" : " (non-blocking)"));
  if (blocking) {
    init_job(c, id);
    const auto r = static_cast<ncclResult_t>(c->async.load());
    if (r != ncclSuccess) {
      release(*c);
      h->gone = true;
      return r;
    }
    *out = h;
    return ncclSuccess;
  }
  c->async = ncclInProgress;
  *out = h;
  start_job(*c, [c, id] { init_job(c, id); });
  return ncclInProgress;
}

NCCLEMU_API ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

NCCLEMU_API ncclResult_t ncclCommGetAsyncError(ncclComm_t h, ncclResult_t* state) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommGetAsyncError", &err);
  if (c == nullptr) return err;
  if (state == nullptr) return warn(ncclInvalidArgument, "ncclCommGetAsyncError : asyncError argument is NULL");
  *state = async_state(*c);
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclCommFinalize(ncclComm_t h) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommFinalize", &err);
  if (c == nullptr) return err;
  if (const ncclResult_t r = ensure_ready(*c, "ncclCommFinalize")) return r;
  c->finalized = true;
  std::shared_ptr<Comm> cp = h->comm;
  if (c->blocking) {
    return drain(*c) ? ncclSuccess : warn(ncclInvalidUsage, "ncclCommFinalize : the communicator was aborted");
  }
  c->async = ncclInProgress;
  start_job(*c, [cp] {
    if (drain(*cp)) set_async(*cp, ncclSuccess);
  });
  return ncclInProgress;
}

NCCLEMU_API ncclResult_t ncclCommDestroy(ncclComm_t h) {
  if (h == nullptr) return ncclSuccess;
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommDestroy", &err);
  if (c == nullptr) return err;
  if (!c->finalized.load()) drain(*c);  // destroy without finalize flushes first, as NCCL's does
  join_job(*c);
  release(*c);
  h->gone = true;
  info("destroyed communicator rank " + std::to_string(c->rank) + "/" + std::to_string(c->nranks));
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclCommAbort(ncclComm_t h) {
  if (h == nullptr) return ncclSuccess;
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommAbort", &err);
  if (c == nullptr) return err;
  {
    std::lock_guard<std::mutex> lock(c->turn_mu);
    c->aborted = true;
  }
  c->turn_cv.notify_all();
  join_job(*c);  // every job's waits look at the abort flag
  release(*c);
  h->gone = true;
  info("aborted communicator rank " + std::to_string(c->rank) + "/" + std::to_string(c->nranks));
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclCommCount(const ncclComm_t h, int* count) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommCount", &err);
  if (c == nullptr) return err;
  if (count == nullptr) return warn(ncclInvalidArgument, "ncclCommCount : count argument is NULL");
  *count = c->nranks;
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclCommCuDevice(const ncclComm_t h, int* device) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommCuDevice", &err);
  if (c == nullptr) return err;
  if (device == nullptr) return warn(ncclInvalidArgument, "ncclCommCuDevice : device argument is NULL");
  *device = c->device;
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclCommUserRank(const ncclComm_t h, int* rank) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclCommUserRank", &err);
  if (c == nullptr) return err;
  if (rank == nullptr) return warn(ncclInvalidArgument, "ncclCommUserRank : rank argument is NULL");
  *rank = c->rank;
  return ncclSuccess;
}
