// The kernel executor of the emulated device.
//
// Residency. A block runs on one SM from start to end, on a slot (an OS thread) of its own: it never migrates and is
// never preempted by another block. How many blocks an SM holds at once follows an occupancy model of what the
// kernel declares, as a GPU's does (resident_blocks): its block size in whole warps against the SM's thread limit,
// its dynamic shared memory (plus the 1 KiB per block that sm_80 and newer reserve) against the SM's shared memory,
// the SM's block limit, all by compute capability, and GPUCOLL_EMU_BLOCKS_PER_SM as a cap of blocks per SM.
// (Registers and static __shared__ are not modelled: the host compiler knows neither.) Blocks are dispatched in
// launch order (kernels in the order they reached the device, a kernel's blocks by index) to the least-loaded SM
// that has room; a block that fits nowhere waits, and so does every block behind it, as on a GPU. That is the
// property the virtual-ranks residency limit is about: P ranks whose blocks spin on each other progress only if all
// of them are resident at once, here as on a GPU. Kernels of different streams (and graph nodes without an edge
// between them) run concurrently.
//
// Threads. A block's CUDA threads are fibers on its slot thread, run in turn until each blocks: at
// __syncthreads (it waits until every thread of the block that has not exited arrives: bar.sync), at a poll of a
// flag that has not changed since its last poll (gpucoll_emu_polled), or at its end. A block all of whose threads
// wait and at least one polls sleeps on that flag's futex for at most kPollSleepUs, and a store through the
// emulated st.release wakes it: spinning ranks of every process progress on two cores without burning them.
//
// ThreadSanitizer sees every fiber as a thread. Switches carry no synchronisation of their own
// (__tsan_switch_to_fiber_no_sync): what orders two threads of a block is exactly what orders them on a GPU, the
// barrier (release on arrival, acquire on leaving; two objects alternate so that a fast thread's accesses after
// the next barrier are not ordered before a slow thread's). A block's fibers start after their creation (the
// block's dispatch, ordered after the launch) and its end is released to the slot thread, which reports the grid
// done through the stream's own synchronisation.
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <thread>
#include <unordered_map>

#include "fiber.h"
#include "runtime.h"

extern "C" {
__thread uint3 threadIdx = {0, 0, 0};
__thread uint3 blockIdx = {0, 0, 0};
__thread dim3 blockDim = dim3(1, 1, 1);
__thread dim3 gridDim = dim3(1, 1, 1);
}

namespace gpucoll_emu {
namespace {

constexpr long kPollSleepUs = 200;

// ---- kernel registry ----------------------------------------------------------------------------------------------

struct KernelEntry {
  gpucoll_emu_pack_fn pack;
  gpucoll_emu_invoke_fn invoke;
  gpucoll_emu_free_fn destroy;
};
// Made when the library is loaded, before any thread (and never destroyed: slot threads outlive static
// destructors at exit). A function-local static would also do, but its first-use guard is invisible to
// ThreadSanitizer in this uninstrumented library.
std::mutex* const g_kernels_mu = new std::mutex();
auto* const g_kernels = new std::unordered_map<const void*, KernelEntry>();

// ---- fibers and the block scheduler -------------------------------------------------------------------------------

struct Fiber {
  enum class State { kReady, kRunning, kBarrier, kStalled, kDone };
  Context ctx;
  uint3 tid{0, 0, 0};
  bool started = false;  // resumed since this block began
  State state = State::kReady;
  uint64_t barrier_gen = 0;
  const void* poll_addr = nullptr;
  uint64_t poll_value = 0;
};

struct Block {
  Context sched;
  Stacks stacks;
  std::vector<Fiber> fibers;
  std::vector<void*> tsan_fibers;  // ThreadSanitizer's fiber of CUDA thread i, reused block after block
  const Kernel* kernel = nullptr;
  Fiber* current = nullptr;
  int live = 0;
  int arrived = 0;
  bool aborted = false;  // a fault ended the block (its own access, or another block's: the context is gone)
  uint64_t gen = 0;
  void* tsan_sched = nullptr;
  char tsan_barrier[2] = {0, 0};  // sync objects of even and odd barrier generations
  char tsan_done = 0;
};

thread_local Block* t_block = nullptr;  // set on a slot thread while it runs a block

[[noreturn]] void to_scheduler_forever(Block* b, Fiber* f) {
  GPUCOLL_EMU_TSAN_ONLY(__tsan_switch_to_fiber(b->tsan_sched, __tsan_switch_to_fiber_no_sync);)
  switch_context(&f->ctx, &b->sched);
  std::abort();  // a finished fiber is never resumed (its context is rebuilt for the next block)
}

void yield_to_scheduler(Block* b, Fiber* f) {
  GPUCOLL_EMU_TSAN_ONLY(__tsan_switch_to_fiber(b->tsan_sched, __tsan_switch_to_fiber_no_sync);)
  switch_context(&f->ctx, &b->sched);
}

// A fault anywhere in the process ends every block at its next scheduling point, as a GPU's fault ends every kernel
// of the context. The block's other fibers are abandoned where they stand: kernel code holds no resources whose
// destructors would have to run, and their contexts are rebuilt by the next block.
void abort_if_faulted(Block* b, Fiber* f) {
  if (sticky() == cudaSuccess) return;
  b->aborted = true;
  to_scheduler_forever(b, f);
}

void fiber_main(void* arg) {
  Fiber* f = static_cast<Fiber*>(arg);
  Block* b = t_block;
  b->kernel->invoke(b->kernel->func, b->kernel->params);
  f->state = Fiber::State::kDone;
  GPUCOLL_EMU_TSAN_ONLY(__tsan_release(&b->tsan_done);)
  to_scheduler_forever(b, f);
}

void resume(Block* b, Fiber* f, int index) {
  b->current = f;
  threadIdx = f->tid;
  if (f->state != Fiber::State::kBarrier) f->state = Fiber::State::kRunning;
  // The first switch into a thread of this block synchronises: everything before the block's dispatch happens
  // before its threads (a GPU's launch does that); later switches do not.
  GPUCOLL_EMU_TSAN_ONLY(__tsan_switch_to_fiber(b->tsan_fibers[index], f->started ? __tsan_switch_to_fiber_no_sync : 0);)
  (void)index;
  f->started = true;
  switch_context(&b->sched, &f->ctx);
  b->current = nullptr;
}

void futex_wait(const void* addr, uint32_t value) {
  if (reinterpret_cast<uintptr_t>(addr) % 4 != 0) {
    sched_yield();
    return;
  }
  timespec ts{0, kPollSleepUs * 1000};
  syscall(SYS_futex, addr, FUTEX_WAIT, value, &ts, nullptr, 0);
}

void release_barrier_if_complete(Block* b) {
  if (b->live > 0 && b->arrived == b->live) {
    b->arrived = 0;
    ++b->gen;
  }
}

void run_block(const Kernel& k, uint64_t index) {
  static thread_local Block* block = new Block();  // per slot thread, never freed: stacks are reused
  static thread_local uint64_t blocks_run = 0;      // this slot's dispatches (the thread order's draws)
  Block* b = block;
  // Seeded thread order: each turn starts at a drawn thread and goes round; index order otherwise.
  const bool shuffle = config().shuffle_threads != 0;
  const uint64_t draws = shuffle ? mix64(config().seed ^ mix64((index << 20) ^ ++blocks_run)) : 0;
  uint64_t turn = 0;
  const uint64_t nx = k.grid.x, nxy = nx * k.grid.y;
  blockIdx = uint3{static_cast<unsigned>(index % nx), static_cast<unsigned>((index / nx) % k.grid.y),
                   static_cast<unsigned>(index / nxy)};
  blockDim = k.block;
  gridDim = k.grid;
  const int n = static_cast<int>(k.block.x * k.block.y * k.block.z);
  if (sticky() != cudaSuccess) return;  // dispatched after a fault: it never starts
  b->kernel = &k;
  b->aborted = false;
  b->fibers.resize(n);
  b->live = n;
  b->arrived = 0;
  b->gen = 0;
  GPUCOLL_EMU_TSAN_ONLY(b->tsan_sched = __tsan_get_current_fiber();)
  for (int i = 0; i < n; ++i) {
    Fiber& f = b->fibers[i];
    f = Fiber();
    f.tid = uint3{static_cast<unsigned>(i % k.block.x), static_cast<unsigned>((i / k.block.x) % k.block.y),
                  static_cast<unsigned>(i / (k.block.x * k.block.y))};
    make_context(&f.ctx, b->stacks.get(i), Stacks::bytes(), &fiber_main, &f);
    GPUCOLL_EMU_TSAN_ONLY(if (b->tsan_fibers.size() <= static_cast<size_t>(i)) b->tsan_fibers.push_back(__tsan_create_fiber(0));)
  }
  t_block = b;
  while (b->live > 0 && !b->aborted) {
    if (sticky() != cudaSuccess) break;
    bool progress = false;
    const void* wait_addr = nullptr;
    uint64_t wait_value = 0;
    const int first = shuffle ? static_cast<int>(mix64(draws + turn++) % static_cast<uint64_t>(n)) : 0;
    for (int step = 0; step < n; ++step) {
      const int i = first + step < n ? first + step : first + step - n;
      Fiber& f = b->fibers[i];
      if (f.state == Fiber::State::kDone) continue;
      if (f.state == Fiber::State::kBarrier && f.barrier_gen == b->gen) continue;
      resume(b, &f, i);
      if (b->aborted) break;
      switch (f.state) {
        case Fiber::State::kDone:
          --b->live;
          release_barrier_if_complete(b);
          progress = true;
          break;
        case Fiber::State::kStalled:
          if (wait_addr == nullptr) {
            wait_addr = f.poll_addr;
            wait_value = f.poll_value;
          }
          break;
        default:
          progress = true;
          break;
      }
    }
    if (!progress && wait_addr != nullptr) futex_wait(wait_addr, static_cast<uint32_t>(wait_value));
  }
  t_block = nullptr;
  threadIdx = uint3{0, 0, 0};
  GPUCOLL_EMU_TSAN_ONLY(__tsan_acquire(&b->tsan_done);)
}

// ---- the block scheduler of one device ----------------------------------------------------------------------------

struct GridRun {
  std::shared_ptr<const Kernel> kernel;
  uint64_t total = 0;
  uint64_t next = 0;
  std::atomic<uint64_t> left{0};
  std::function<void()> done;
};

// A device's slots. Work goes to the lowest-numbered idle slot, and a slot that finishes a block takes the next
// queued one itself, so the set of slot threads in use (each with its stacks and, under ThreadSanitizer, 512 fiber
// states) stays as small as the concurrency the kernels need instead of spreading over every slot.
struct Slot {
  std::condition_variable cv;
  bool busy = false;
  std::shared_ptr<GridRun> grid;  // handed over by the dispatcher
  uint64_t index = 0;
  int sm = -1;  // the SM the block runs on
};

// What an SM has in use.
struct SmUse {
  int blocks = 0;
  int threads = 0;
  size_t shared = 0;
};

struct DeviceExec {
  std::mutex mu;
  std::deque<std::shared_ptr<GridRun>> queue;  // grids with blocks not yet dispatched, in launch order
  std::vector<Slot*> slots;
  std::vector<SmUse> sms;
};

// CUDA's per-SM limits by compute capability (the programming guide's table): resident threads, resident blocks,
// shared memory, and the shared memory the driver reserves per block.
struct SmLimits {
  int threads, blocks;
  size_t shared, reserved;
};
SmLimits sm_limits() {
  const gpucoll_emu_config& c = config();
  const int cc = c.cc_major * 10 + c.cc_minor;
  SmLimits l{2048, 32, 64u << 10, 0};
  if (cc >= 90) {
    l = {2048, 32, 228u << 10, 1u << 10};
  } else if (cc == 89) {
    l = {1536, 24, 100u << 10, 1u << 10};
  } else if (cc >= 86) {
    l = {1536, 16, 100u << 10, 1u << 10};
  } else if (cc >= 80) {
    l = {2048, 32, 164u << 10, 1u << 10};
  } else if (cc >= 75) {
    l = {1024, 16, 64u << 10, 0};
  } else if (cc >= 70) {
    l = {2048, 32, 96u << 10, 0};
  }
  l.blocks = std::min(l.blocks, c.blocks_per_sm);
  return l;
}

// A block's claim on its SM: its threads in whole warps, its shared memory with the driver's reservation.
SmUse claim_of(const Kernel& k) {
  const SmLimits l = sm_limits();
  const int threads = static_cast<int>(k.block.x * k.block.y * k.block.z);
  return SmUse{1, (threads + 31) / 32 * 32, k.shared + l.reserved};
}

// Under d->mu: the least-loaded SM with room for `need`, or -1.
int find_sm(DeviceExec* d, const SmUse& need) {
  const SmLimits l = sm_limits();
  if (d->sms.empty()) d->sms.resize(static_cast<size_t>(config().sms));
  int best = -1;
  for (int i = 0; i < static_cast<int>(d->sms.size()); ++i) {
    const SmUse& u = d->sms[i];
    if (u.blocks + 1 > l.blocks || u.threads + need.threads > l.threads || u.shared + need.shared > l.shared) continue;
    if (best < 0 || u.blocks < d->sms[best].blocks) best = i;
  }
  return best;
}

DeviceExec* const g_devices = new DeviceExec[16];  // made at load time, never destroyed (see g_kernels)

DeviceExec& device_exec(int device) { return g_devices[device]; }

// Under d->mu: the next queued block and the SM it goes to, its claim taken; false when the queue is empty or the
// next block fits on no SM now (the blocks behind it wait too: dispatch is in order).
bool take_block(DeviceExec* d, std::shared_ptr<GridRun>* g, uint64_t* index, int* sm) {
  if (d->queue.empty()) return false;
  const SmUse need = claim_of(*d->queue.front()->kernel);
  const int where = find_sm(d, need);
  if (where < 0) return false;
  SmUse& u = d->sms[where];
  u.blocks += need.blocks;
  u.threads += need.threads;
  u.shared += need.shared;
  *sm = where;
  *g = d->queue.front();
  *index = (*g)->next++;
  if ((*g)->next == (*g)->total) d->queue.pop_front();
  return true;
}

void release_sm(DeviceExec* d, const Kernel& k, int sm) {
  const SmUse need = claim_of(k);
  SmUse& u = d->sms[sm];
  u.blocks -= need.blocks;
  u.threads -= need.threads;
  u.shared -= need.shared;
}

void dispatch(DeviceExec* d);

void slot_main(DeviceExec* d, Slot* slot) {
  std::unique_lock<std::mutex> lock(d->mu);
  for (;;) {
    slot->cv.wait(lock, [&] { return slot->grid != nullptr; });
    std::shared_ptr<GridRun> g = std::move(slot->grid);
    uint64_t index = slot->index;
    slot->grid = nullptr;
    int sm = slot->sm;
    do {
      lock.unlock();
      run_block(*g->kernel, index);
      // The grid is done when its last block is, whichever slot ran it: every block's work happens before the
      // grid's completion (told to ThreadSanitizer by hand: this library's atomics are not instrumented).
      GPUCOLL_EMU_TSAN_ONLY(__tsan_release(g.get());)
      if (g->left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        GPUCOLL_EMU_TSAN_ONLY(__tsan_acquire(g.get());)
        g->done();
      }
      // The claim goes back before the grid's reference: the kernel (its shape) lives as long as the grid.
      lock.lock();
      release_sm(d, *g->kernel, sm);
      g.reset();
    } while (take_block(d, &g, &index, &sm));
    slot->busy = false;
    dispatch(d);  // the freed room may fit a block that waits for a bigger claim than this one's
  }
}

// Under d->mu: hands queued blocks that fit to idle slots, lowest index first, starting a slot thread when every
// one is busy (at most one per block the device can hold, so the count follows the kernels' occupancy).
void dispatch(DeviceExec* d) {
  size_t i = 0;
  std::shared_ptr<GridRun> g;
  uint64_t index = 0;
  int sm = -1;
  while (take_block(d, &g, &index, &sm)) {
    while (i < d->slots.size() && d->slots[i]->busy) ++i;
    if (i == d->slots.size()) {
      d->slots.push_back(new Slot());  // never freed, like its thread
      std::thread(slot_main, d, d->slots.back()).detach();
    }
    Slot* slot = d->slots[i];
    slot->grid = std::move(g);
    slot->index = index;
    slot->sm = sm;
    slot->busy = true;
    slot->cv.notify_one();
  }
}

}  // namespace

bool in_kernel() { return t_block != nullptr && t_block->current != nullptr; }

const void* current_kernel() { return t_block != nullptr ? t_block->kernel->func : nullptr; }

void switch_point() {
  Block* b = t_block;
  if (b == nullptr || b->current == nullptr) return;
  Fiber* f = b->current;
  yield_to_scheduler(b, f);  // still kRunning: the scheduler resumes it in its turn, after the block's others
  abort_if_faulted(b, f);
}

void abort_block() {
  Block* b = t_block;
  b->aborted = true;
  to_scheduler_forever(b, b->current);
}

bool lookup_kernel(const void* func, gpucoll_emu_pack_fn* pack, gpucoll_emu_invoke_fn* invoke,
                   gpucoll_emu_free_fn* destroy) {
  std::lock_guard<std::mutex> lock(*g_kernels_mu);
  auto it = g_kernels->find(func);
  if (func == nullptr || it == g_kernels->end()) return false;
  *pack = it->second.pack;
  *invoke = it->second.invoke;
  *destroy = it->second.destroy;
  return true;
}

int resident_blocks(int threads, size_t shared_bytes) {
  const SmLimits l = sm_limits();
  if (threads < 1 || threads > 1024) return 0;
  const int warps = (threads + 31) / 32 * 32;
  const size_t shared = shared_bytes + l.reserved;
  return std::min({l.blocks, l.threads / warps, static_cast<int>(l.shared / shared)});
}

cudaError_t check_shape(dim3 grid, dim3 block, size_t shared_bytes) {
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  if (threads < 1 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (shared_bytes > 48 * 1024) return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

void submit_grid(std::shared_ptr<const Kernel> k, std::function<void()> done) {
  auto g = std::make_shared<GridRun>();
  g->total = static_cast<uint64_t>(k->grid.x) * k->grid.y * k->grid.z;
  g->left.store(g->total);
  g->kernel = std::move(k);
  g->done = std::move(done);
  DeviceExec& d = device_exec(g->kernel->device);
  std::lock_guard<std::mutex> lock(d.mu);
  d.queue.push_back(std::move(g));
  dispatch(&d);
}

void run_grid(std::shared_ptr<const Kernel> k) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  submit_grid(std::move(k), [&] {
    std::lock_guard<std::mutex> lock(mu);
    finished = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

void gpucoll_emu_register_kernel(const void* func, gpucoll_emu_pack_fn pack, gpucoll_emu_invoke_fn invoke,
                                 gpucoll_emu_free_fn destroy) {
  std::lock_guard<std::mutex> lock(*g_kernels_mu);
  g_kernels->emplace(func, KernelEntry{pack, invoke, destroy});
}

void gpucoll_emu_syncthreads(void) {
  Block* b = t_block;
  if (b == nullptr || b->current == nullptr) return;  // host code: one thread, nothing to wait for
  Fiber* f = b->current;
  GPUCOLL_EMU_TSAN_ONLY(__tsan_release(&b->tsan_barrier[b->gen & 1]);)
  if (++b->arrived == b->live) {
    b->arrived = 0;
    ++b->gen;
    GPUCOLL_EMU_TSAN_ONLY(__tsan_acquire(&b->tsan_barrier[(b->gen - 1) & 1]);)
    return;
  }
  f->state = Fiber::State::kBarrier;
  f->barrier_gen = b->gen;
  yield_to_scheduler(b, f);
  abort_if_faulted(b, f);
  GPUCOLL_EMU_TSAN_ONLY(__tsan_acquire(&b->tsan_barrier[f->barrier_gen & 1]);)
  f->state = Fiber::State::kRunning;
}

void gpucoll_emu_polled(const void* addr, uint64_t value) {
  Block* b = t_block;
  if (b == nullptr || b->current == nullptr) return;
  Fiber* f = b->current;
  if (f->poll_addr == addr && f->poll_value == value) {
    f->state = Fiber::State::kStalled;
    yield_to_scheduler(b, f);
    abort_if_faulted(b, f);
    f->state = Fiber::State::kRunning;
  } else {
    f->poll_addr = addr;
    f->poll_value = value;
  }
}

void gpucoll_emu_stored(const void* addr) {
  if (reinterpret_cast<uintptr_t>(addr) % 4 == 0) syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint64_t gpucoll_emu_global_timer_ns(void) { return now_ns(); }

}  // extern "C"
