// Operations with NCCL's entry points: argument checks (ncclInvalidArgument, kept as a non-blocking communicator's
// asynchronous error, as ncclEnqueueCheck does), groups, and the launch of a group's work.
//
// Groups. ncclGroupStart/End nest per thread; a call outside a group is a group of one. Calls append checked tasks to
// their communicator; the outermost ncclGroupEnd launches each communicator's tasks as one plan. Blocking
// communicators launch on the calling thread; non-blocking ones on a thread of their own (NCCL >= 2.23), the call
// returning ncclInProgress until that thread enqueued the work. An error inside a group fails its ncclGroupEnd and
// drops the group's tasks.
//
// Launch. A plan becomes one host function (cudaLaunchHostFunc) on the stream of its first task; the other streams
// of the group are joined before it and wait for it after (events), as NCCL's kernel launch joins them. Captured
// streams turn it into a host node that every replay runs again.
#include <gpucoll_emu/api.h>

#include <algorithm>
#include <string>

#include "nccl_emu.h"

namespace ncclemu {

using namespace gpucoll;  // NCCL's enum values (nccl_api.h)

namespace {

struct GroupState {
  int depth = 0;
  std::vector<std::shared_ptr<Comm>> comms;  // communicators with tasks in the open group, by first use
  ncclResult_t error = ncclSuccess;
  int blocking = -1;
};
thread_local GroupState t_group;

std::mutex g_captured_mu;
std::vector<std::unique_ptr<Plan>> g_captured;  // host nodes' data: a graph may replay them at any time

const char* api_name(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "ncclAllReduce";
    case Coll::kBroadcast:
      return "ncclBroadcast";
    case Coll::kReduce:
      return "ncclReduce";
    case Coll::kAllGather:
      return "ncclAllGather";
    case Coll::kReduceScatter:
      return "ncclReduceScatter";
    case Coll::kAllToAll:
      return "ncclAlltoAll";
    case Coll::kGather:
      return "ncclGather";
    case Coll::kScatter:
      return "ncclScatter";
    case Coll::kSend:
      return "ncclSend";
    case Coll::kRecv:
      return "ncclRecv";
  }
  return "?";
}

bool reduces(Coll c) { return c == Coll::kAllReduce || c == Coll::kReduce || c == Coll::kReduceScatter; }

// NCCL's CudaPtrCheck (its NCCL_CHECK_POINTERS mode), always on here, plus the range: on a GPU a host pointer or a
// buffer that leaves its allocation is an illegal address, which the emulated device (host-addressable) would not
// report; a wrong pointer must not pass silently.
ncclResult_t check_buffer(const Comm& c, const void* p, size_t bytes, const char* op, const char* name) {
  if (bytes == 0) return ncclSuccess;
  const std::string what = std::string(op) + " : " + name + " " + std::to_string(reinterpret_cast<uintptr_t>(p));
  if (p == nullptr) return warn(ncclInvalidArgument, std::string(op) + " : " + name + " is NULL");
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return warn(ncclInvalidArgument, what + " is not device memory");
  }
  if (attr.device != c.device) {
    return warn(ncclInvalidArgument, what + " is on CUDA device " + std::to_string(attr.device) +
                                         ", the communicator on " + std::to_string(c.device));
  }
  unsigned long long base = 0;
  size_t size = 0;
  if (cuMemGetAddressRange_v2(&base, &size, reinterpret_cast<unsigned long long>(p)) == 0 &&
      reinterpret_cast<uintptr_t>(p) + bytes > base + size) {
    return warn(ncclInvalidArgument, what + ": " + std::to_string(bytes) + " bytes from it leave its allocation");
  }
  return ncclSuccess;
}

ncclResult_t check_args(Comm& c, Task& t, ncclRedOp_t op) {
  const char* name = api_name(t.coll);
  if (t.root < 0 || t.root >= c.nranks) {
    return warn(ncclInvalidArgument, std::string(name) + " : invalid " + (t.coll == Coll::kSend || t.coll == Coll::kRecv
                                                                              ? "peer "
                                                                              : "root ") +
                                         std::to_string(t.root) + " (should be in 0.." + std::to_string(c.nranks - 1) +
                                         ")");
  }
  if (type_size(t.type) == 0 || (is_fp8(t.type) && version() < 22400)) {
    return warn(ncclInvalidArgument, std::string(name) + " : invalid type " + std::to_string(t.type));
  }
  if (reduces(t.coll)) {
    if (static_cast<int>(op) < 0) {
      return warn(ncclInvalidArgument, std::string(name) + " : invalid reduction operation " + std::to_string(op));
    }
    if (op >= ncclNumOps) {
      const size_t ix = static_cast<size_t>(op - ncclNumOps);
      std::lock_guard<std::mutex> lock(c.mu);
      if (ix >= c.user_ops.size() || !c.user_ops[ix].live) {
        return warn(ncclInvalidArgument, std::string(name) + " : reduction operation " + std::to_string(op) +
                                             " unknown to this communicator");
      }
      if (c.user_ops[ix].type != t.type) {
        return warn(ncclInvalidArgument,
                    std::string(name) + " : data type supplied to user-created ncclRedOp_t does not match type given "
                                        "to reduction operation");
      }
      t.op = c.user_ops[ix].op;
    } else if (!builtin_op(op, t.type, c.nranks, &t.op)) {
      return warn(ncclInvalidArgument, std::string(name) + " : invalid reduction operation " + std::to_string(op));
    }
    if (is_fp8(t.type) && c.cc_major < 9) {
      return warn(ncclInvalidArgument, std::string(name) + " : FP8 reduction support begins with sm90 capable devices");
    }
  }
  const size_t b = t.count * type_size(t.type);
  const size_t P = static_cast<size_t>(c.nranks);
  const bool root = c.rank == t.root;
  size_t send = 0, recv = 0;
  switch (t.coll) {
    case Coll::kAllReduce:
      send = recv = b;
      break;
    case Coll::kBroadcast:
      send = root ? b : 0;
      recv = b;
      break;
    case Coll::kReduce:
      send = b;
      recv = root ? b : 0;
      break;
    case Coll::kAllGather:
      send = b;
      recv = b * P;
      break;
    case Coll::kReduceScatter:
      send = b * P;
      recv = b;
      break;
    case Coll::kAllToAll:
      send = recv = b * P;
      break;
    case Coll::kGather:
      send = b;
      recv = root ? b * P : 0;
      break;
    case Coll::kScatter:
      send = root ? b * P : 0;
      recv = b;
      break;
    case Coll::kSend:
      send = b;
      break;
    case Coll::kRecv:
      recv = b;
      break;
  }
  if (const ncclResult_t r = check_buffer(c, t.send, send, name, t.coll == Coll::kSend ? "buff" : "sendbuff")) return r;
  return check_buffer(c, t.recv, recv, name, t.coll == Coll::kRecv ? "buff" : "recvbuff");
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const bool yes = cudaStreamIsCapturing(s, &st) == cudaSuccess && st == cudaStreamCaptureStatusActive;
  cudaGetLastError();
  return yes;
}

void host_fn(void* data) {
  Plan* p = static_cast<Plan*>(data);
  const std::shared_ptr<Comm> keep = p->comm;
  Comm& c = *keep;
  ++c.running;
  bool go = !c.aborted.load();
  if (go && !p->captured) go = wait_turn(c, p->ticket);
  if (go) {
    std::lock_guard<std::mutex> exec(c.exec_mu);
    if (p->fault == Fault::kError) {
      set_async(c, p->fault_code,
                "injected fault: an asynchronous error (" + std::string(ncclGetErrorString(p->fault_code)) +
                    ") at operation " + std::to_string(p->fault_op) + " on rank " + std::to_string(c.rank));
    }
    if (p->fault != Fault::kNone) {
      info("injected fault: operation " + std::to_string(p->fault_op) + " on rank " + std::to_string(c.rank) +
           " waits for the abort");
      while (!c.aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      std::string error;
      const ncclResult_t r = execute(c, p->tasks, &error);
      if (r != ncclSuccess) set_async(c, r, "rank " + std::to_string(c.rank) + ": " + error);
    }
  }
  if (!p->captured) finish_turn(c, p->ticket);
  --c.running;
  if (!p->captured) delete p;
}

ncclResult_t group_end_outer() {
  GroupState g = std::move(t_group);
  t_group = GroupState{};
  if (g.error != ncclSuccess) {
    for (const auto& c : g.comms) {
      std::lock_guard<std::mutex> lock(c->mu);
      c->pending.clear();
    }
    return g.error;
  }
  std::vector<std::unique_ptr<Plan>> plans;
  for (const auto& c : g.comms) {
    auto p = std::make_unique<Plan>();
    p->comm = c;
    std::lock_guard<std::mutex> lock(c->mu);
    p->tasks.swap(c->pending);
    if (!p->tasks.empty()) plans.push_back(std::move(p));
  }
  if (plans.empty()) return ncclSuccess;
  if (g.blocking != 0 || version() < 22300) {
    for (auto& p : plans) {
      Comm& c = *p->comm;
      const ncclResult_t r = launch(std::move(p));
      if (r != ncclSuccess) {
        if (!c.blocking) set_async(c, r, c.error);
        return r;
      }
    }
    return ncclSuccess;
  }
  // NCCL >= 2.23 hands a non-blocking group to a thread of its own (group.cc, groupLaunchNonBlocking).
  auto job = std::make_shared<Job>();
  std::vector<std::shared_ptr<Comm>> comms;
  for (auto& p : plans) {
    comms.push_back(p->comm);
    set_async(*p->comm, ncclInProgress);
    std::lock_guard<std::mutex> lock(p->comm->mu);
    p->comm->job = job;
  }
  auto shared = std::make_shared<std::vector<std::unique_ptr<Plan>>>(std::move(plans));
  job->thread = std::thread([job, shared, comms] {
    std::vector<ncclResult_t> results;
    for (auto& p : *shared) results.push_back(launch(std::move(p)));
    job->done.store(true, std::memory_order_release);
    for (size_t i = 0; i < comms.size(); ++i) {
      set_async(*comms[i], results[i], results[i] == ncclSuccess ? "" : "launch failed");
    }
  });
  return ncclInProgress;
}

// One API call: checked, appended to its communicator's group, launched when the outermost group ends.
ncclResult_t enqueue(ncclComm_t h, Task t, ncclRedOp_t op) {
  const char* name = api_name(t.coll);
  ncclResult_t err;
  Comm* c = checked(h, name, &err);
  ++t_group.depth;
  if (c != nullptr) err = ensure_ready(*c, name);
  if (err == ncclSuccess) err = check_args(*c, t, op);
  if (err == ncclSuccess && t_group.blocking >= 0 && t_group.blocking != static_cast<int>(c->blocking)) {
    err = warn(ncclInvalidUsage, std::string(name) +
                                     " : blocking and nonblocking communicators are not allowed in the same group");
  }
  if (err == ncclSuccess) {
    std::lock_guard<std::mutex> lock(c->mu);
    if (!c->pending.empty() && capturing(c->pending.front().stream) != capturing(t.stream)) {
      err = warn(ncclInvalidUsage, std::string(name) +
                                       " : streams given to a communicator within a NCCL group must either be all "
                                       "uncaptured or all captured by the same graph");
    }
  }
  const bool empty_collective = t.count == 0 && t.coll != Coll::kSend && t.coll != Coll::kRecv;
  if (err == ncclSuccess && !empty_collective) {  // NCCL drops empty collectives
    t_group.blocking = c->blocking ? 1 : 0;
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->pending.empty()) t_group.comms.push_back(h->comm);
    c->pending.push_back(t);
  }
  if (err != ncclSuccess) {
    t_group.error = err;
    if (c != nullptr && !c->blocking) set_async(*c, err, "");
  }
  if (--t_group.depth > 0) return err;
  const ncclResult_t r = group_end_outer();
  return err != ncclSuccess ? err : r;
}

}  // namespace

const char* coll_name(Coll c) { return api_name(c); }

ncclResult_t launch(std::unique_ptr<Plan> p) {
  Comm& c = *p->comm;
  DeviceScope scope(c.device);
  std::vector<cudaStream_t> streams;
  for (const Task& t : p->tasks) {
    if (std::find(streams.begin(), streams.end(), t.stream) == streams.end()) streams.push_back(t.stream);
  }
  const cudaStream_t s0 = streams.front();
  p->captured = capturing(s0);
  p->fault = fault_at_launch(c.rank, &p->fault_code, &p->fault_op);
  auto cuda_failed = [&](cudaError_t e, const char* call) {
    cudaGetLastError();
    return warn(ncclUnhandledCudaError, std::string(call) + " failed: " + cudaGetErrorString(e));
  };
  for (size_t i = 1; i < streams.size(); ++i) {
    cudaError_t e = cudaEventRecord(c.fork_event, streams[i]);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(s0, c.fork_event, 0);
    if (e != cudaSuccess) return cuda_failed(e, "joining a group's streams");
  }
  Plan* raw = p.get();
  {
    std::lock_guard<std::mutex> lock(c.launch_mu);
    raw->ticket = c.next_ticket;
    const cudaError_t e = cudaLaunchHostFunc(s0, host_fn, raw);
    if (e != cudaSuccess) return cuda_failed(e, "cudaLaunchHostFunc");
    if (!raw->captured) ++c.next_ticket;
  }
  if (raw->captured) {
    std::lock_guard<std::mutex> lock(g_captured_mu);
    g_captured.push_back(std::move(p));
  } else {
    p.release();  // host_fn deletes it
  }
  for (size_t i = 1; i < streams.size(); ++i) {
    cudaError_t e = cudaEventRecord(c.join_event, s0);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(streams[i], c.join_event, 0);
    if (e != cudaSuccess) return cuda_failed(e, "joining a group's streams");
  }
  return ncclSuccess;
}

}  // namespace ncclemu

using namespace ncclemu;

NCCLEMU_API ncclResult_t ncclGroupStart() {
  ++t_group.depth;
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclGroupEnd() {
  if (t_group.depth <= 0) return warn(ncclInvalidUsage, "ncclGroupEnd: not in a group call");
  if (--t_group.depth > 0) return ncclSuccess;
  return group_end_outer();
}

namespace {
Task make(Coll coll, const void* send, void* recv, size_t count, ncclDataType_t type, int root, cudaStream_t stream) {
  Task t;
  t.coll = coll;
  t.send = send;
  t.recv = recv;
  t.count = count;
  t.type = type;
  t.root = root;
  t.stream = stream;
  return t;
}
}  // namespace

NCCLEMU_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                                       ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kAllReduce, send, recv, count, type, 0, stream), op);
}

NCCLEMU_API ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root,
                                       ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kBroadcast, send, recv, count, type, root, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                                    int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kReduce, send, recv, count, type, root, stream), op);
}

NCCLEMU_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                                       ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kAllGather, send, recv, count, type, 0, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kReduceScatter, send, recv, count, type, 0, stream), op);
}

NCCLEMU_API ncclResult_t ncclAlltoAll(const void* send, void* recv, size_t count, ncclDataType_t type,
                                      ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kAllToAll, send, recv, count, type, 0, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclGather(const void* send, void* recv, size_t count, ncclDataType_t type, int root,
                                    ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kGather, send, recv, count, type, root, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclScatter(const void* send, void* recv, size_t count, ncclDataType_t type, int root,
                                     ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, make(Coll::kScatter, send, recv, count, type, root, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                                  cudaStream_t stream) {
  return enqueue(comm, make(Coll::kSend, send, nullptr, count, type, peer, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                                  cudaStream_t stream) {
  return enqueue(comm, make(Coll::kRecv, nullptr, recv, count, type, peer, stream), ncclSum);
}

NCCLEMU_API ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t type,
                                                  ncclScalarResidence_t residence, ncclComm_t h) {
  ncclResult_t err;
  Comm* c = checked(h, "ncclRedOpCreatePreMulSum", &err);
  if (c == nullptr) return err;
  if (const ncclResult_t r = ensure_ready(*c, "ncclRedOpCreatePreMulSum")) return r;
  if (op == nullptr || scalar == nullptr) {
    return warn(ncclInvalidArgument, "ncclRedOpCreatePreMulSum : op or scalar argument is NULL");
  }
  if (type_size(type) == 0 || (is_fp8(type) && version() < 22400)) {
    return warn(ncclInvalidArgument, "ncclRedOpCreatePreMulSum : invalid type " + std::to_string(type));
  }
  if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate) {
    return warn(ncclInvalidArgument, "ncclRedOpCreatePreMulSum : invalid residence " + std::to_string(residence));
  }
  UserOp u;
  u.live = true;
  u.type = type;
  u.op.kind = DevOp::kPreMulSum;
  if (residence == ncclScalarHostImmediate) {
    u.op.scalar = scalar_bits(scalar, type);
  } else {
    u.op.scalar_ptr = scalar;
  }
  std::lock_guard<std::mutex> lock(c->mu);
  size_t ix = 0;
  while (ix < c->user_ops.size() && c->user_ops[ix].live) ++ix;
  if (ix == c->user_ops.size()) c->user_ops.push_back(u);
  c->user_ops[ix] = u;
  *op = static_cast<ncclRedOp_t>(ncclNumOps + static_cast<int>(ix));
  return ncclSuccess;
}

NCCLEMU_API ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t h) {
  if (static_cast<int>(op) >= 0 && op < ncclNumOps) {
    return warn(ncclInvalidArgument, "ncclRedOpDestroy : operator is a NCCL builtin.");
  }
  if (static_cast<int>(op) < 0) return warn(ncclInvalidArgument, "ncclRedOpDestroy : operator is garbage.");
  if (h == nullptr) return warn(ncclInvalidArgument, "ncclRedOpDestroy : invalid communicator passed.");
  ncclResult_t err;
  Comm* c = checked(h, "ncclRedOpDestroy", &err);
  if (c == nullptr) return err;
  const size_t ix = static_cast<size_t>(op - ncclNumOps);
  std::lock_guard<std::mutex> lock(c->mu);
  if (ix >= c->user_ops.size() || !c->user_ops[ix].live) {
    return warn(ncclInvalidArgument, "ncclRedOpDestroy : operator unknown to this communicator.");
  }
  c->user_ops[ix].live = false;
  return ncclSuccess;
}
