// Where device memory lives on the emulated device, and the fence that keeps host threads out of it.
//
// A GPU's device memory is not host memory: host code that dereferences a cudaMalloc pointer segfaults. Here every
// allocation and IPC mapping is a memfd mapped into one reserved span of address space (the device region), and,
// with the host fence on (GPUCOLL_EMU_HOST_FENCE), the region is closed (PROT_NONE) whenever the device is idle: no kernel, copy, fill, host function or event queued or
// running on any stream. Host code that touches device memory then faults as on a GPU, and a SIGSEGV handler names
// what it touched before the process dies the usual way (Python's faulthandler, a core). The device's own work (the
// slot threads running kernels, the stream workers copying) opens the region for as long as any of it is in flight.
//
// Why a gate and not per-thread rights: x86 protection keys would give exactly that (device threads allowed, host
// threads not, switched with WRPKRU at no cost), but the CPUs of CI have none; mprotect is process-wide. So host code
// racing device work is not caught, only host code touching device memory while the device is idle, which is
// where such bugs live: reading a result after a synchronise instead of copying it back. One region makes the
// toggle one mprotect call, whatever the number of allocations; its cost still grows with the mapped pages (every
// page-table entry changes, and the other cores' TLBs are flushed): the emulated GPU suite took 667 s with the fence
// everywhere against 558 s with it on a sample, so it is a mode, on for a sample of the suite and everywhere in the thorough run.
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

constexpr size_t kRegionBytes = size_t{1} << 40;  // 1 TiB of address space, reserved, never committed
constexpr size_t kGrain = size_t{64} << 10;       // placement granularity: 64 KiB (CUDA aligns to 256 B at least)

// Made at load time, never destroyed (see executor.cc's g_kernels). Innermost lock: taken under state().mu (stream
// work begins and ends) and under memory.cc's map lock, never the other way round.
std::mutex& g_mu = *new std::mutex();
char* g_base = nullptr;
size_t g_high = 0;               // end offset of the highest placement ever made: what the toggle covers
std::map<size_t, size_t> g_holes;  // free offset -> length
int64_t g_busy = 0;               // device work queued or running
bool g_open = true;               // the region's pages are readable and writable (with the fence: only while device
                                  // work runs; closed by the first end of device work)
struct sigaction g_previous;

void write_str(const char* s) {
  const ssize_t n = write(STDERR_FILENO, s, std::strlen(s));
  (void)n;
}

void write_hex(uintptr_t v) {
  char buf[19] = "0x";
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
  buf[18] = '\0';
  write_str(buf);
}

// Host code touched the closed region: say so (async-signal-safe calls only), then hand the fault back to whoever
// had SIGSEGV before (the instruction faults again on return).
void on_segv(int sig, siginfo_t* info, void* uctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  const uintptr_t base = reinterpret_cast<uintptr_t>(g_base);
  if (g_base != nullptr && a >= base && a < base + kRegionBytes) {
    write_str("gpucoll emulated device: host code dereferenced device memory at ");
    write_hex(a);
    write_str(" while the device was idle (a GPU faults there too: device memory is not host memory; copy it "
              "with cudaMemcpy); native stack:\n");
    void* frames[32];
    backtrace_symbols_fd(frames, backtrace(frames, 32), STDERR_FILENO);  // preloaded in ensure_region
  }
  (void)sig;
  (void)uctx;
  sigaction(SIGSEGV, &g_previous, nullptr);
}

// Under g_mu: reserves the region and installs the handler, once.
bool ensure_region() {
  if (g_base != nullptr) return true;
  void* p = mmap(nullptr, kRegionBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  g_base = static_cast<char*>(p);
  g_holes[0] = kRegionBytes;
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now: the handler must not be the first to (dlopen is not safe there)
  struct sigaction sa{};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
  return true;
}

// Under g_mu: makes [base, base + g_high) accessible or not. Without the fence (GPUCOLL_EMU_HOST_FENCE) it stays open.
void set_open(bool open) {
  if (!open && config().host_fence == 0) return;
  if (g_open == open) return;
  g_open = open;
  if (g_high > 0) mprotect(g_base, g_high, open ? PROT_READ | PROT_WRITE : PROT_NONE);
}

size_t grain_round(size_t n) { return (n + kGrain - 1) / kGrain * kGrain; }

}  // namespace

void* region_map(int fd, size_t bytes, int fill) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!ensure_region()) return nullptr;
  const size_t len = grain_round(bytes);
  auto it = g_holes.begin();
  while (it != g_holes.end() && it->second < len) ++it;  // first fit
  if (it == g_holes.end()) return nullptr;
  const size_t off = it->first, hole = it->second;
  g_holes.erase(it);
  if (hole > len) g_holes[off + len] = hole - len;
  char* p = g_base + off;
  if (mmap(p, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    g_holes[off] = len;  // (neighbours stay split: harmless, and a failed map is rare)
    return nullptr;
  }
  if (fill >= 0) std::memset(p, fill, bytes);
  if (off + len > g_high) {
    // The toggle's span grows: what lies between the old end and this placement is reservation, whose protection
    // follows the gate from now on.
    if (!g_open && off > g_high) mprotect(g_base + g_high, off - g_high, PROT_NONE);
    g_high = off + len;
  }
  if (!g_open) mprotect(p, len, PROT_NONE);
  return p;
}

void region_unmap(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  const size_t off = static_cast<size_t>(static_cast<char*>(p) - g_base);
  const size_t len = grain_round(bytes);
  // Back to reservation (not a hole in the address space another mmap could take).
  mmap(p, len, g_open ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
       -1, 0);
  auto next = g_holes.lower_bound(off);
  size_t start = off, length = len;
  if (next != g_holes.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      start = prev->first;
      length += prev->second;
      g_holes.erase(prev);
    }
  }
  if (next != g_holes.end() && next->first == off + len) {
    length += next->second;
    g_holes.erase(next);
  }
  g_holes[start] = length;
}

void device_work_begin() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_busy++ == 0) set_open(true);
}

void device_work_end() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (--g_busy == 0) set_open(false);
}

}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" {
void gpucoll_emu_agent_begin(void) { device_work_begin(); }
void gpucoll_emu_agent_end(void) { device_work_end(); }
}
