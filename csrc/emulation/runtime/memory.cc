// Device memory of the emulated runtime. Every cudaMalloc is its own memfd, mapped MAP_SHARED, so that another
// process can map the same pages: cudaIpcGetMemHandle names (pid, fd, inode) and cudaIpcOpenMemHandle opens
// /proc/<pid>/fd/<fd>, checks the inode, and maps it.
//
// Why memfd and /proc rather than named shared memory (shm_open): a memfd has no name, so nothing can be left in
// /dev/shm by a process that is killed; its pages live exactly as long as some process holds the fd or a mapping.
// Opening /proc/<pid>/fd/<n> needs the same user (PTRACE_MODE_READ), which ranks of one job have, and it fails
// once the exporter exits or frees the allocation, as opening a stale CUDA IPC handle does. The inode check stops
// a recycled fd number (or pid) from mapping someone else's memory.
//
// Strict where CUDA is strict: a handle cannot be opened in the process that exported it; copies and fills must
// stay inside one allocation and match the direction they name; a host pointer is unregistered memory to
// cudaPointerGetAttributes. Where the pages live, and how host code is kept off them while the device is idle:
// region.cc.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <shared_mutex>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

constexpr char kMagic[8] = {'g', 'p', 'c', 'l', '-', 'e', 'm', 'u'};
// New allocations are filled with this byte, not zeros: cudaMalloc does not clear memory, and code that reads
// memory it never wrote must not pass because the pages happened to be fresh.
constexpr int kGarbage = 0xcd;

struct Alloc {
  size_t size = 0;      // bytes asked for
  size_t mapped = 0;    // bytes mapped (whole pages)
  int device = 0;
  int fd = -1;          // own allocations: the memfd (kept open: peers open it through /proc)
  bool ipc = false;     // opened from a handle
  int refs = 0;         // IPC: opens not yet closed
  uint64_t ino = 0, dev = 0;
};

struct Handle {
  char magic[8];
  uint64_t instance;  // this process's emulator instance (pid reuse across a fork-exec is caught by the inode too)
  int32_t pid;
  int32_t fd;
  uint64_t ino;
  uint64_t dev;
  uint64_t size;
  int32_t device;
  int32_t pad;
};
static_assert(sizeof(Handle) <= CUDA_IPC_HANDLE_SIZE, "IPC handle layout");

// By base address. Made at load time and never destroyed: a CUDA object freed during process exit must still find
// its allocation.
std::shared_mutex& g_mu = *new std::shared_mutex();
std::map<uintptr_t, Alloc>& g_allocs = *new std::map<uintptr_t, Alloc>();
uint64_t g_bytes[16] = {};
// Bumped whenever an allocation or mapping goes away: access.cc's per-thread caches of allocation bounds hold the
// value they were filled under and refill when it moved.
std::atomic<uint64_t> g_generation{1};

uint64_t instance_id() {
  static const uint64_t id = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  }();
  return id;
}

size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

// Under g_mu. The allocation containing [p, p + n).
const std::pair<const uintptr_t, Alloc>* lookup(uintptr_t p, size_t n) {
  auto it = g_allocs.upper_bound(p);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  const uintptr_t base = it->first;
  if (p < base || p - base >= it->second.size || n > it->second.size - (p - base)) return nullptr;
  return &*it;
}

enum class Side { kHost, kDevice };

// What a copy's pointer must be for `kind` (cudaMemcpyDefault: whatever it is). Device ranges must lie in one
// allocation; host ranges must not touch device memory.
cudaError_t check_side(const void* p, size_t n, Side want, bool infer) {
  Range r;
  const bool device = find_range(p, n, &r);
  if (infer) {
    if (!device && find_range(p, 1, &r)) return cudaErrorInvalidValue;  // starts in an allocation, runs past it
    return cudaSuccess;
  }
  if (want == Side::kDevice) return device ? cudaSuccess : cudaErrorInvalidValue;
  return find_range(p, 1, &r) ? cudaErrorInvalidValue : cudaSuccess;
}

}  // namespace

bool find_range(const void* p, size_t n, Range* out) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  const auto* a = lookup(reinterpret_cast<uintptr_t>(p), n == 0 ? 1 : n);
  if (a == nullptr) return false;
  if (out != nullptr) {
    out->base = a->first;
    out->size = a->second.size;
    out->device = a->second.device;
    out->ipc = a->second.ipc;
  }
  return true;
}

bool find_below(const void* p, Range* out) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_allocs.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocs.begin()) return false;
  --it;
  out->base = it->first;
  out->size = it->second.size;
  out->device = it->second.device;
  out->ipc = it->second.ipc;
  return true;
}

uint64_t alloc_generation() { return g_generation.load(std::memory_order_acquire); }

uint64_t allocated_bytes(int device) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  return device >= 0 && device < 16 ? g_bytes[device] : 0;
}

cudaError_t check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  const bool infer = kind == cudaMemcpyDefault;
  Side d = Side::kHost, s = Side::kHost;
  switch (kind) {
    case cudaMemcpyHostToHost:
      break;
    case cudaMemcpyHostToDevice:
      d = Side::kDevice;
      break;
    case cudaMemcpyDeviceToHost:
      s = Side::kDevice;
      break;
    case cudaMemcpyDeviceToDevice:
      d = s = Side::kDevice;
      break;
    case cudaMemcpyDefault:
      break;
    default:
      return cudaErrorInvalidMemcpyDirection;
  }
  if (const cudaError_t e = check_side(dst, n, d, infer)) return e;
  return check_side(src, n, s, infer);
}

cudaError_t check_fill(void* p, size_t n) {
  if (n == 0) return cudaSuccess;
  return find_range(p, n, nullptr) ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (ptr == nullptr) return fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    if (const cudaError_t e = check_unsafe_call()) return fail(e);
  }
  if (size == 0) return ok();
  const int device = current_device();
  touch_device(device);
  const size_t mapped = page_round(size);
  {
    std::shared_lock<std::shared_mutex> lock(g_mu);
    if (g_bytes[device] + mapped > config().memory) return fail(cudaErrorMemoryAllocation);
  }
  const int fd = memfd_create("gpucoll-emu-device-memory", MFD_CLOEXEC);
  if (fd < 0) return fail(cudaErrorMemoryAllocation);
  struct stat st;
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0 || fstat(fd, &st) != 0) {
    close(fd);
    return fail(cudaErrorMemoryAllocation);
  }
  void* p = region_map(fd, mapped, kGarbage);
  if (p == nullptr) {
    close(fd);
    return fail(cudaErrorMemoryAllocation);
  }
  Alloc a;
  a.size = size;
  a.mapped = mapped;
  a.device = device;
  a.fd = fd;
  a.ino = static_cast<uint64_t>(st.st_ino);
  a.dev = static_cast<uint64_t>(st.st_dev);
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    g_allocs[reinterpret_cast<uintptr_t>(p)] = a;
    g_bytes[device] += mapped;
  }
  *ptr = p;
  return ok();
}

cudaError_t cudaFree(void* ptr) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (ptr == nullptr) return ok();
  Alloc a;
  {
    std::shared_lock<std::shared_mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_allocs.end() || it->second.ipc) return fail(cudaErrorInvalidValue);
    a = it->second;
  }
  // cudaFree synchronises the device: no kernel or copy still in flight can touch the pages once they are gone.
  if (const cudaError_t e = cudaDeviceSynchronize()) return e;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_allocs.end()) return fail(cudaErrorInvalidValue);
    g_bytes[a.device] -= a.mapped;
    g_allocs.erase(it);
    g_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  region_unmap(ptr, a.mapped);
  close(a.fd);
  return ok();
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (attr == nullptr || ptr == nullptr) return fail(cudaErrorInvalidValue);
  Range r;
  if (find_range(ptr, 1, &r)) {
    attr->type = cudaMemoryTypeDevice;
    attr->device = r.device;
    attr->devicePointer = const_cast<void*>(ptr);
    attr->hostPointer = nullptr;
  } else {
    // CUDA 11+: memory the driver does not know is unregistered host memory (not an error).
    attr->type = cudaMemoryTypeUnregistered;
    attr->device = -2;
    attr->devicePointer = nullptr;
    attr->hostPointer = nullptr;
  }
  return ok();
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (handle == nullptr || ptr == nullptr) return fail(cudaErrorInvalidValue);
  Handle h{};
  {
    std::shared_lock<std::shared_mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    // The base of an allocation of this process: CUDA exports allocations, not interior pointers or mappings
    // opened from another process's handle.
    if (it == g_allocs.end() || it->second.ipc) return fail(cudaErrorInvalidValue);
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.instance = instance_id();
    h.pid = static_cast<int32_t>(getpid());
    h.fd = it->second.fd;
    h.ino = it->second.ino;
    h.dev = it->second.dev;
    h.size = it->second.size;
    h.device = it->second.device;
  }
  std::memset(handle->reserved, 0, sizeof(handle->reserved));
  std::memcpy(handle->reserved, &h, sizeof(h));
  return ok();
}

cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
  if (const cudaError_t e = check_init()) return fail(e);
  if (ptr == nullptr || flags != cudaIpcMemLazyEnablePeerAccess) return fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    if (const cudaError_t e = check_unsafe_call()) return fail(e);
  }
  Handle h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.size == 0) return fail(cudaErrorInvalidValue);
  // CUDA refuses a handle in the process that made it ("invalid device context"): ranks sharing a process must
  // use plain pointers (virtual ranks), and a test that only ever runs one process cannot pass by accident.
  if (h.instance == instance_id() && h.pid == static_cast<int32_t>(getpid())) {
    return fail(cudaErrorDeviceUninitialized);
  }
  const int device = current_device();
  touch_device(device);
  if (h.device != device && !config().p2p) return fail(cudaErrorPeerAccessUnsupported);
  {
    // Opened already (and not closed): CUDA counts the opens and returns the same pointer.
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (auto& [base, a] : g_allocs) {
      if (a.ipc && a.ino == h.ino && a.dev == h.dev) {
        ++a.refs;
        *ptr = reinterpret_cast<void*>(base);
        return ok();
      }
    }
  }
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.fd);
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return fail(cudaErrorMapBufferObjectFailed);  // the exporter exited or freed the allocation
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_ino) != h.ino || static_cast<uint64_t>(st.st_dev) != h.dev) {
    close(fd);
    return fail(cudaErrorMapBufferObjectFailed);
  }
  const size_t mapped = page_round(static_cast<size_t>(h.size));
  void* p = region_map(fd, mapped, -1);
  close(fd);  // the mapping keeps the pages
  if (p == nullptr) return fail(cudaErrorMapBufferObjectFailed);
  Alloc a;
  a.size = static_cast<size_t>(h.size);
  a.mapped = mapped;
  a.device = h.device;
  a.ipc = true;
  a.refs = 1;
  a.ino = h.ino;
  a.dev = h.dev;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    g_allocs[reinterpret_cast<uintptr_t>(p)] = a;
  }
  *ptr = p;
  return ok();
}

cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  if (const cudaError_t e = check_init()) return fail(e);
  size_t mapped = 0;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_allocs.end() || !it->second.ipc) return fail(cudaErrorInvalidValue);
    if (--it->second.refs > 0) return ok();
    mapped = it->second.mapped;
    g_allocs.erase(it);
    g_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  region_unmap(ptr, mapped);
  return ok();
}

void gpucoll_emu_get_counts(gpucoll_emu_counts* out) {
  if (out == nullptr) return;
  *out = gpucoll_emu_counts{};
  {
    std::shared_lock<std::shared_mutex> lock(g_mu);
    for (const auto& [base, a] : g_allocs) {
      (void)base;
      if (a.ipc) {
        ++out->ipc_mappings;
      } else {
        ++out->allocations;
      }
    }
  }
  std::lock_guard<std::mutex> lock(state().mu);
  out->streams = static_cast<int64_t>(state().streams.size());
  out->events = static_cast<int64_t>(state().events.size());
  out->graphs = static_cast<int64_t>(state().graphs.size());
  out->graph_execs = static_cast<int64_t>(state().execs.size());
}

}  // extern "C"
