// Internals of the emulated CUDA runtime (libgpucoll_cudaemu.so). Not installed, not included outside runtime/.
//
// Map of the library:
//   errors.cc    error names and strings (CUDA's), the per-thread last error, driver error names, the sticky error
//   device.cc    configuration, devices, attributes, occupancy query, versions, the driver entry points
//   memory.cc    device memory (memfd + mmap, so CUDA IPC works between processes), pointer queries, IPC
//   region.cc    where device memory is mapped, and the gate that closes it to host code while the device is idle
//   access.cc    device code's global accesses checked (bounds, alignment: faults), seeded switch points
//   stream.cc    streams, events, host functions, synchronisation, memcpy/memset, kernel launches
//   capture.cc   stream capture into graphs, instantiation, graph launches
//   executor.cc  the block scheduler (the occupancy model: which SM holds a block, one slot thread per resident
//                block) and the per-block fiber scheduler: __syncthreads, polls that give way, fault aborts, the
//                kernel-visible thread-local indices
//   fiber.cc     the context switch and fiber stacks (ThreadSanitizer-annotated)
//
// Locking: one mutex (state().mu) guards streams, events, captures and graphs; state().cv is notified whenever an
// operation completes. Allocations have their own lock (memory.cc), and the region its own, innermost (region.cc).
// The executor has one lock per device. No lock is held while an operation runs.
#pragma once

#include <cuda_runtime.h>
#include <gpucoll_emu/api.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace gpucoll_emu {

// ---- errors.cc ---------------------------------------------------------------------------------------------------
// Records `e` as the calling thread's last error when it is not cudaSuccess, and returns it.
cudaError_t fail(cudaError_t e);
// The sticky error of a device fault (a kernel's illegal or misaligned access, access.cc), cudaSuccess until one
// happens. A GPU's fault destroys the context: every later call fails with it, and so it is here, for the whole
// process (all emulated devices: a test process drives one). set_sticky: true for the first fault only.
cudaError_t sticky();
bool set_sticky(cudaError_t e);
// A call's success: the sticky error once a fault happened, so that a call that waited for work (a synchronise, a
// blocking copy) reports the fault it waited through, as CUDA's do.
inline cudaError_t ok() { return fail(sticky()); }

// ---- device.cc ---------------------------------------------------------------------------------------------------
// The configuration, fixed by the first call that needs it.
const gpucoll_emu_config& config();
bool valid_device(int device);
int current_device();
// cudaErrorInitializationError in a child forked after the runtime started (as CUDA), cudaErrorNotPermitted in a
// host function, the sticky error after a fault, else cudaSuccess; fixes the configuration on first use.
cudaError_t check_init();
// Marks `device`'s primary context as created (cudaSetDevice, or the first call that uses the device).
void touch_device(int device);
bool device_touched(int device);
// Inside a host function (cudaLaunchHostFunc): CUDA calls are not permitted there.
bool in_host_function();
void set_in_host_function(bool on);
uint64_t now_ns();

// splitmix64: a well-mixed 64-bit value of `x`, for the seeded draws (stream jitter, thread order) that a
// GPUCOLL_EMU_SEED replays.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- memory.cc ---------------------------------------------------------------------------------------------------
struct Range {
  uintptr_t base = 0;
  size_t size = 0;
  int device = -1;
  bool ipc = false;  // a mapping opened with cudaIpcOpenMemHandle (not this process's allocation)
};
// The device allocation (own or IPC-mapped) containing [p, p + n), or false.
bool find_range(const void* p, size_t n, Range* out);
// The allocation with the highest base at or below `p` (whether or not it contains p), or false: what an access
// that missed every allocation ran past.
bool find_below(const void* p, Range* out);
// Changes whenever an allocation or IPC mapping goes away.
uint64_t alloc_generation();
// Bytes this process allocated on `device` (cudaMemGetInfo, the memory limit).
uint64_t allocated_bytes(int device);
// Whether a copy of `n` bytes in direction `kind` may run (cudaErrorInvalidValue: a pointer on the wrong side, or a
// device range that leaves its allocation), and whether a fill of [p, p + n) stays inside one allocation.
cudaError_t check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind);
cudaError_t check_fill(void* p, size_t n);

// ---- region.cc ---------------------------------------------------------------------------------------------------
// Maps `bytes` of `fd` (MAP_SHARED) into the device region and fills them with `fill` (none if negative); null when
// the region is full or the map fails. region_unmap gives the place back.
void* region_map(int fd, size_t bytes, int fill);
void region_unmap(void* p, size_t bytes);
// Device work (a stream operation) queued, and finished: the region is open to the process while any is in flight,
// closed to host code otherwise.
void device_work_begin();
void device_work_end();

// ---- executor.cc -------------------------------------------------------------------------------------------------
struct Kernel {
  const void* func = nullptr;
  gpucoll_emu_invoke_fn invoke = nullptr;
  gpucoll_emu_free_fn destroy = nullptr;
  void* params = nullptr;  // packed at launch (CUDA copies kernel parameters at launch, not at execution)
  dim3 grid, block;
  size_t shared = 0;  // dynamic shared memory per block
  int device = 0;
  ~Kernel() {
    if (destroy != nullptr && params != nullptr) destroy(params);
  }
};
// How to call `func`, as registered by the typed overloads of <cuda_runtime.h>; false when unknown.
bool lookup_kernel(const void* func, gpucoll_emu_pack_fn* pack, gpucoll_emu_invoke_fn* invoke,
                   gpucoll_emu_free_fn* destroy);
// How many blocks of `threads` threads and `shared_bytes` of dynamic shared memory one SM holds at once: the
// occupancy model (executor.cc) that both the block scheduler and cudaOccupancyMaxActiveBlocksPerMultiprocessor use.
int resident_blocks(int threads, size_t shared_bytes);
// Validates a launch shape (cudaErrorInvalidConfiguration) without running anything.
cudaError_t check_shape(dim3 grid, dim3 block, size_t shared_bytes);
// Queues every block of `k` on its device's block scheduler; `done` runs (on a slot thread) after the last block.
void submit_grid(std::shared_ptr<const Kernel> k, std::function<void()> done);
// submit_grid and wait.
void run_grid(std::shared_ptr<const Kernel> k);
// Whether the calling thread runs device code (a CUDA thread of a block), and that block's kernel.
bool in_kernel();
const void* current_kernel();
// A scheduling point of the running CUDA thread: the block's other threads run before it goes on.
void switch_point();
// Ends the running block at once (after a fault: set_sticky first). Only from device code.
[[noreturn]] void abort_block();

// ---- graphs (capture.cc) -----------------------------------------------------------------------------------------
// One unit of work a stream (or a graph node) runs: a kernel, a copy, a fill, a host function, or nothing (event
// records and waits are operations with no work, so that their position in the stream is an ordinary sequence
// number).
struct Work {
  enum class Kind { kNone, kKernel, kCopy, kFill, kHost, kGraph } kind = Kind::kNone;
  std::shared_ptr<const Kernel> kernel;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  int value = 0;
  cudaHostFn_t fn = nullptr;
  void* data = nullptr;
  std::shared_ptr<struct GraphExec> exec;
};
// Runs `w` on the calling thread (a stream worker) and returns when it finished; after a fault it does nothing (a
// faulted context runs no more work, and its streams drain so that nobody waits forever).
void run_work(const Work& w);

struct Node {
  Work work;
  std::vector<int> deps;  // indices of earlier nodes
};
struct Graph {
  std::vector<Node> nodes;
};
struct GraphExec {
  std::vector<Node> nodes;  // a copy: a graph may be changed or destroyed after instantiation
};
// What a cudaGraphExec_t points to. Launches hold the GraphExec itself, so destroying the handle while a launch
// is still queued or running is safe (CUDA allows it).
struct GraphExecHandle {
  std::shared_ptr<GraphExec> exec;
};
// Runs every node of `g` as its dependencies finish; independent kernels run concurrently (the P ranks of a
// captured virtual-ranks call spin on each other, so they must).
void run_graph(const GraphExec& g);

// ---- streams (stream.cc) -----------------------------------------------------------------------------------------
struct Capture;

struct Stream {
  int device = 0;
  bool blocking = true;   // synchronises with the legacy default stream
  bool legacy = false;    // the legacy default stream of `device`
  bool destroyed = false;
  uint64_t number = 0;    // the how-manieth stream of the process (seeds its jitter)
  uint64_t enqueued = 0;  // sequence number of the last operation queued
  uint64_t completed = 0; // sequence number of the last operation finished (operations finish in order)
  struct Op {
    uint64_t seq;
    Work work;
    std::vector<std::pair<Stream*, uint64_t>> deps;  // (stream, sequence) that must have completed first
    std::shared_ptr<struct EventRecord> record;       // an event record: stamped with the completion time
  };
  std::deque<Op> queue;
  bool worker = false;
  // Capture: the sequence this stream belongs to, and the nodes its next captured operation depends on.
  Capture* capture = nullptr;
  std::vector<int> frontier;
};

struct EventRecord {
  Stream* stream = nullptr;
  uint64_t seq = 0;
  uint64_t time_ns = 0;  // completion time, once completed
};

struct Event {
  int device = 0;
  unsigned flags = 0;
  std::shared_ptr<EventRecord> record;  // the last eager record; null when never recorded
  Capture* capture = nullptr;           // recorded last inside this capture (then `nodes` is what it marks)
  std::vector<int> nodes;
};

struct Capture {
  Graph* graph = nullptr;
  Stream* origin = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalid = false;
  std::set<Stream*> members;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;  // any operation completed, or a queue changed
  std::set<Stream*> streams;   // live (not destroyed) user streams
  std::vector<Stream*> all;    // every stream ever made, including legacy and draining ones (never freed)
  std::set<Event*> events;
  std::set<Capture*> captures;
  std::set<Graph*> graphs;
  std::set<GraphExecHandle*> execs;
  std::vector<Stream*> legacy;  // per device
};
State& state();

// Resolves a handle (0 and cudaStreamLegacy: the current device's legacy stream; cudaStreamPerThread: this
// thread's default stream) under state().mu; null with *err set for an unknown handle.
Stream* resolve_stream(cudaStream_t handle, cudaError_t* err);
// Queues `w` on `s` (under state().mu), with the legacy-stream dependencies CUDA implies. Returns its sequence.
uint64_t enqueue(Stream* s, Work w, std::shared_ptr<EventRecord> record = nullptr,
                 std::vector<std::pair<Stream*, uint64_t>> deps = {});
// Blocks (releasing `lock`) until `s` completed `seq`.
void wait_for(std::unique_lock<std::mutex>& lock, Stream* s, uint64_t seq);

// ---- capture rules (capture.cc) ----------------------------------------------------------------------------------
// Under state().mu. Adds `w` to the capture `s` belongs to (s->capture != null). cudaErrorStreamCaptureInvalidated
// when that capture was invalidated.
cudaError_t capture_work(Stream* s, Work w);
// Invalidates `c` (an illegal call happened while it was open).
void invalidate(Capture* c);
// The "potentially unsafe API call" rule of cudaStreamCaptureModeGlobal/ThreadLocal: cudaErrorStreamCaptureUnsupported
// (and the offending captures invalidated) when the calling thread may not make such a call now. Under state().mu.
cudaError_t check_unsafe_call();
// Using the legacy stream of `device` implicitly synchronises with every blocking stream of it: not while one of
// them is capturing (cudaErrorStreamCaptureImplicit, that capture invalidated). Under state().mu.
cudaError_t check_legacy_use(int device);

}  // namespace gpucoll_emu
