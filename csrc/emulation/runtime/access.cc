// Device code's global-memory accesses on the emulated device: the checks a GPU's memory system makes (and
// compute-sanitizer's memcheck sharpens), and the scheduling points a GPU's warps give for free.
//
// Every load and store the kernels make of global memory goes through __ldcg/__stwb (device.h), which call
// gpucoll_emu_global_access first. An access must be naturally aligned (a 16-byte pack on a 16-byte boundary:
// cudaErrorMisalignedAddress otherwise) and lie wholly inside one live device allocation, this process's own or an
// IPC mapping, to the byte the allocation asked for (cudaErrorIllegalAddress otherwise). That is stricter than a
// GPU, whose pages round allocations up to 2 MiB and let a read one element past the end return garbage, and as
// strict as memcheck, which is what a kernel bug deserves: a pointer into host memory, one element past a slice,
// a pack split that lost its alignment. A failed check is a fault, as on a GPU: the process's sticky error is set,
// the block ends where it stands, every other block ends at its next scheduling point, and every later runtime
// call returns the error. It is not a segfault of the test process: the test sees CUDA's error, and one line on
// stderr says where it happened.
//
// Why a per-thread cache of allocation bounds: a kernel's accesses fall in a handful of allocations (its input,
// output, and the P staging buffers), so eight bounds, revalidated by a generation number that moves when an
// allocation goes away, answer nearly every check without the allocation map's lock.
//
// Switch points: with GPUCOLL_EMU_SHUFFLE_THREADS a CUDA thread also gives way to its block's other threads after a
// drawn number (1 to 16) of accesses, so that their accesses interleave inside a step, not only at a barrier or a
// flag poll; the draws come from GPUCOLL_EMU_SEED.
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "runtime.h"

namespace gpucoll_emu {
namespace {

struct Bounds {
  uintptr_t lo = 0, hi = 0;
  uint64_t gen = 0;
};
constexpr int kCached = 8;
thread_local Bounds t_bounds[kCached];
thread_local unsigned t_next = 0;
thread_local uint32_t t_until_switch = 0;
thread_local uint64_t t_switch_draws = 0;

bool inside_allocation(uintptr_t p, uint32_t n) {
  const uint64_t gen = alloc_generation();
  for (const Bounds& b : t_bounds) {
    if (b.gen == gen && p >= b.lo && p < b.hi && n <= b.hi - p) return true;
  }
  Range r;
  if (!find_range(reinterpret_cast<const void*>(p), n, &r)) return false;
  t_bounds[t_next++ % kCached] = Bounds{r.base, r.base + r.size, gen};
  return true;
}

// The running kernel: its demangled name (the template arguments say which dtype, op and finish), or, for a kernel
// with internal linkage (no dynamic symbol), the library and offset that addr2line -f -C -e LIB OFFSET resolves.
void kernel_name(char* out, size_t size) {
  Dl_info info{};
  const void* func = current_kernel();
  std::snprintf(out, size, "?");
  if (func == nullptr || dladdr(func, &info) == 0) return;
  if (info.dli_sname == nullptr) {
    std::snprintf(out, size, "%s+0x%zx", info.dli_fname != nullptr ? info.dli_fname : "?",
                  static_cast<size_t>(static_cast<const char*>(func) - static_cast<const char*>(info.dli_fbase)));
    return;
  }
  int status = 0;
  char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::snprintf(out, size, "%s", status == 0 && demangled != nullptr ? demangled : info.dli_sname);
  std::free(demangled);
}

// Where the access fell, for the report: its offset from the allocation just below it (within 1 MiB), or nowhere.
void describe(uintptr_t p, char* out, size_t size) {
  Range r;
  if (find_below(reinterpret_cast<const void*>(p), &r) && p - r.base < r.size + (1u << 20)) {
    std::snprintf(out, size, "is at offset %zu of the %zu-byte allocation at %p", static_cast<size_t>(p - r.base),
                  r.size, reinterpret_cast<void*>(r.base));
    return;
  }
  std::snprintf(out, size, "is in no device allocation (host memory, or freed)");
}

[[noreturn]] void fault(cudaError_t e, uintptr_t p, uint32_t n, bool write) {
  if (set_sticky(e)) {
    char name[512], where[160];
    kernel_name(name, sizeof(name));
    if (e == cudaErrorMisalignedAddress) {
      std::snprintf(where, sizeof(where), "is not %u-byte aligned", n);
    } else {
      describe(p, where, sizeof(where));
    }
    std::fprintf(stderr,
                 "gpucoll emulated device: %s (%s): a %u-byte %s at %p %s; kernel %s, block (%u,%u,%u), "
                 "thread (%u,%u,%u)\n",
                 cudaGetErrorName(e), cudaGetErrorString(e), n, write ? "store" : "load", reinterpret_cast<void*>(p),
                 where, name, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  }
  abort_block();
}

}  // namespace
}  // namespace gpucoll_emu

using namespace gpucoll_emu;

extern "C" void gpucoll_emu_global_access(const void* p, uint32_t bytes, int write) {
  if (!in_kernel()) return;  // host code using the same helpers: host memory is its to read
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % bytes != 0) fault(cudaErrorMisalignedAddress, a, bytes, write != 0);
  if (!inside_allocation(a, bytes)) fault(cudaErrorIllegalAddress, a, bytes, write != 0);
  const gpucoll_emu_config& c = config();
  if (c.shuffle_threads != 0 && t_until_switch-- == 0) {
    t_until_switch = static_cast<uint32_t>(mix64(c.seed ^ mix64(++t_switch_draws)) % 16);
    switch_point();
  }
}
