// The kernel executor of the emulated device.
//
// Residency. A device has sms x blocks_per_sm slots, each an OS thread that runs one block at a time to the end,
// as an SM runs a resident block: a block never migrates and is never preempted by another block. Blocks are
// dispatched in launch order (kernels in the order they reached the device, a kernel's blocks by index); a launch
// that finds every slot busy waits for one to free. That is the property the virtual-ranks residency limit is
// about: P ranks whose blocks spin on each other progress only if all of them are resident at once, here as on a
// GPU. Kernels of different streams (and graph nodes without an edge between them) run concurrently.
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
  b->kernel = &k;
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
  while (b->live > 0) {
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
};

struct DeviceExec {
  std::mutex mu;
  std::deque<std::shared_ptr<GridRun>> queue;  // grids with blocks not yet dispatched, in launch order
  std::vector<Slot*> slots;
};

DeviceExec* const g_devices = new DeviceExec[16];  // made at load time, never destroyed (see g_kernels)

DeviceExec& device_exec(int device) { return g_devices[device]; }

// Under d->mu: the next queued block, or false.
bool take_block(DeviceExec* d, std::shared_ptr<GridRun>* g, uint64_t* index) {
  if (d->queue.empty()) return false;
  *g = d->queue.front();
  *index = (*g)->next++;
  if ((*g)->next == (*g)->total) d->queue.pop_front();
  return true;
}

void slot_main(DeviceExec* d, Slot* slot) {
  std::unique_lock<std::mutex> lock(d->mu);
  for (;;) {
    slot->cv.wait(lock, [&] { return slot->grid != nullptr; });
    std::shared_ptr<GridRun> g = std::move(slot->grid);
    uint64_t index = slot->index;
    slot->grid = nullptr;
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
      g.reset();
      lock.lock();
    } while (take_block(d, &g, &index));
    slot->busy = false;
  }
}

// Under d->mu: hands queued blocks to idle slots, lowest index first.
void dispatch(DeviceExec* d) {
  for (Slot* slot : d->slots) {
    if (d->queue.empty()) return;
    if (slot->busy) continue;
    slot->busy = true;
    take_block(d, &slot->grid, &slot->index);
    slot->cv.notify_one();
  }
}

}  // namespace

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
  if (d.slots.empty()) {
    const int slots = config().sms * config().blocks_per_sm;
    for (int i = 0; i < slots; ++i) {
      d.slots.push_back(new Slot());  // never freed, like its thread
      std::thread(slot_main, &d, d.slots.back()).detach();
    }
  }
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
