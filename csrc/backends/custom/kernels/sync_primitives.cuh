// The few device operations of the custom kernels that differ between a real GPU and gpucoll's emulated device
// (GPUCOLL_CUDA=emulate, csrc/emulation/): each one twice, side by side, with the same memory-model meaning.
// Everything else the kernels do (indexing, barriers, reductions, the flag protocol of peer_sync.cuh) is one
// source for both.
//
//   st_release_sys       PTX st.release.sys               C++ release store (+ wake pollers of the word)
//   ld_acquire_sys       PTX ld.acquire.sys               C++ acquire load (+ a scheduling point for a poller)
//   ld_relaxed_sys       PTX ld.relaxed.sys               C++ relaxed load (32- and 64-bit)
//   st_relaxed_sys       PTX st.relaxed.sys               C++ relaxed store
//   fetch_add_acq_rel    PTX atom.acq_rel.gpu.add         C++ acq_rel read-modify-write
//   global_timer_ns      %globaltimer                     CLOCK_MONOTONIC
//
// Each emulated version first checks its access as device.h's __ldcg does (alignment, the bounds of a device
// allocation: a fault otherwise, runtime/access.cc). The emulated versions use the compiler's __atomic builtins, i.e. the C++ memory model's release and acquire,
// which is what the PTX scopes mean for our use (.sys: visible to other GPUs and processes, as every thread of
// every emulated process sees the same shared memory). ThreadSanitizer instruments them: a release weakened to
// relaxed (GPUCOLL_EMU_TEST_WEAK_RELEASE, test builds only) makes the peers' reads of staged data a reported race.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpucoll::cuda::custom {

#if defined(GPUCOLL_CUDA_EMULATION)

#if defined(GPUCOLL_EMU_TEST_WEAK_RELEASE)
constexpr int kReleaseOrder = __ATOMIC_RELAXED;  // a deliberately broken protocol: the TSan check must see it
#else
constexpr int kReleaseOrder = __ATOMIC_RELEASE;
#endif

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  gpucoll_emu_global_access(p, sizeof(*p), 1);
  __atomic_store_n(p, v, kReleaseOrder);
  gpucoll_emu_stored(p);
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  gpucoll_emu_global_access(p, sizeof(*p), 0);
  const uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  gpucoll_emu_polled(p, v);
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  gpucoll_emu_global_access(p, sizeof(*p), 0);
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  gpucoll_emu_global_access(p, sizeof(*p), 0);
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  gpucoll_emu_global_access(p, sizeof(*p), 1);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

__device__ __forceinline__ uint32_t fetch_add_acq_rel(uint32_t* p, uint32_t v) {
  gpucoll_emu_global_access(p, sizeof(*p), 1);
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}

__device__ __forceinline__ uint64_t global_timer_ns() { return gpucoll_emu_global_timer_ns(); }

#else

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Device scope: every block of one kernel runs on the same GPU.
__device__ __forceinline__ uint32_t fetch_add_acq_rel(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#endif

}  // namespace gpucoll::cuda::custom
