// gpucoll's emulated CUDA device: what device code sees. The CUDA qualifiers, the thread and block indices, block
// barriers, atomics and cache-hinted loads, for kernels compiled by the host compiler and run by the emulator's
// executor (csrc/emulation/runtime/executor.cc): every block is one OS thread, every CUDA thread of it one fiber.
//
// Why these definitions are faithful enough for gpucoll's kernels:
// - threadIdx/blockIdx/blockDim/gridDim are thread-local variables the executor rewrites at every fiber switch.
//   A switch only happens inside an out-of-line call into the emulator (__syncthreads, a poll of a flag), so the
//   compiler reloads them after every point where they can change.
// - __shared__ is a static thread-local: one instance per OS thread, i.e. per resident block, shared by the
//   block's fibers and, like CUDA shared memory, holding garbage (the previous block's value) until written.
// - atomicAdd/atomicMax/... are relaxed read-modify-writes, as CUDA's are (no ordering beyond the one location).
// - __ldcg (cache-global load) and __stwb (write-back store, a plain st.global) are plain accesses: L1 bypass
//   changes nothing about ordering, so a plain load racing a write is exactly as wrong here (and to
//   ThreadSanitizer) as the GPU code would be. Each is checked first (gpucoll_emu_global_access, runtime/access.cc):
//   natural alignment and the bounds of a device allocation, a fault otherwise, as a GPU faults; and, with the
//   seeded thread order, a switch point.
// Ordering primitives that do more (release/acquire at system scope) are not here: they live next to their PTX in
// csrc/backends/custom/kernels/sync_primitives.cuh, so the two implementations can be read side by side.
#pragma once

#include <stdint.h>

#include "cuda_runtime_api.h"
#include "vector_types.h"

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static __thread

extern "C" {
GPUCOLL_EMU_API extern __thread uint3 threadIdx;
GPUCOLL_EMU_API extern __thread uint3 blockIdx;
GPUCOLL_EMU_API extern __thread dim3 blockDim;
GPUCOLL_EMU_API extern __thread dim3 gridDim;

// Block barrier of the calling fiber's block (bar.sync 0).
GPUCOLL_EMU_API void gpucoll_emu_syncthreads(void);
// A scheduling point after a load of a word other agents write (a flag): a fiber that keeps reading the same
// `value` at `addr` gives its OS thread to the block's other fibers, and a block whose every fiber waits sleeps
// until some word it polls changes (futex on its low 32 bits, bounded), so spinning ranks on 2 cores progress.
GPUCOLL_EMU_API void gpucoll_emu_polled(const void* addr, uint64_t value);
// Wakes fibers of any process that sleep on the word at `addr` (call after storing to it).
GPUCOLL_EMU_API void gpucoll_emu_stored(const void* addr);
// Device code's load (write 0) or store (write 1) of `bytes` at `p` in global memory, before it happens: a fault
// (cudaErrorMisalignedAddress, cudaErrorIllegalAddress; the block ends here) unless it is naturally aligned and
// inside a device allocation; a seeded switch point. Does nothing outside device code.
GPUCOLL_EMU_API void gpucoll_emu_global_access(const void* p, uint32_t bytes, int write);
// %globaltimer: nanoseconds, monotonic.
GPUCOLL_EMU_API uint64_t gpucoll_emu_global_timer_ns(void);
}

__forceinline__ void __syncthreads() { gpucoll_emu_syncthreads(); }
__forceinline__ void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#define GPUCOLL_EMU_RMW(name, type, builtin)                      \
  __forceinline__ type name(type* p, type v) { return builtin(p, v, __ATOMIC_RELAXED); }
GPUCOLL_EMU_RMW(atomicAdd, int, __atomic_fetch_add)
GPUCOLL_EMU_RMW(atomicAdd, unsigned int, __atomic_fetch_add)
GPUCOLL_EMU_RMW(atomicAdd, unsigned long long, __atomic_fetch_add)
GPUCOLL_EMU_RMW(atomicSub, int, __atomic_fetch_sub)
GPUCOLL_EMU_RMW(atomicSub, unsigned int, __atomic_fetch_sub)
GPUCOLL_EMU_RMW(atomicExch, int, __atomic_exchange_n)
GPUCOLL_EMU_RMW(atomicExch, unsigned int, __atomic_exchange_n)
GPUCOLL_EMU_RMW(atomicExch, unsigned long long, __atomic_exchange_n)
GPUCOLL_EMU_RMW(atomicOr, unsigned int, __atomic_fetch_or)
GPUCOLL_EMU_RMW(atomicAnd, unsigned int, __atomic_fetch_and)
#undef GPUCOLL_EMU_RMW

template <class T, class Better>
__forceinline__ T gpucoll_emu_atomic_pick(T* p, T v, Better better) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (better(v, old) && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
#define GPUCOLL_EMU_MINMAX(type)                                                                                 \
  __forceinline__ type atomicMax(type* p, type v) {                                                              \
    return gpucoll_emu_atomic_pick(p, v, [](type a, type b) { return a > b; });                                  \
  }                                                                                                              \
  __forceinline__ type atomicMin(type* p, type v) {                                                              \
    return gpucoll_emu_atomic_pick(p, v, [](type a, type b) { return a < b; });                                  \
  }
GPUCOLL_EMU_MINMAX(int)
GPUCOLL_EMU_MINMAX(unsigned int)
GPUCOLL_EMU_MINMAX(unsigned long long)
#undef GPUCOLL_EMU_MINMAX

__forceinline__ unsigned int atomicCAS(unsigned int* p, unsigned int expected, unsigned int desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
__forceinline__ unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected,
                                             unsigned long long desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}

template <class T>
__forceinline__ T __ldcg(const T* p) {
  gpucoll_emu_global_access(p, sizeof(T), 0);
  return *p;
}
template <class T>
__forceinline__ void __stwb(T* p, T v) {
  gpucoll_emu_global_access(p, sizeof(T), 1);
  *p = v;
}
