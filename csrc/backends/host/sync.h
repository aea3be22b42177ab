// Cross-process waiting for the host backend: spin briefly, then sleep on a futex.
//
// Ranks may outnumber cores (4 ranks on a 2-core machine is the common test set-up), so a waiting rank must
// not burn the core the awaited rank needs: it spins for GPUCOLL_HOST_SPIN_US, yielding, then sleeps in the
// kernel until the word changes. The futex is the shared (non-private) kind because the word lives in a
// MAP_SHARED mapping used by several processes.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpucoll::host {

// A 32-bit counter that other processes wait on. `sleepers` lets the publisher skip the wake syscall when
// nobody sleeps: the waiter increments sleepers then re-reads value, the publisher writes value then reads
// sleepers, both seq_cst, so at least one of them sees the other (no lost wake-up). Users give it its own cache
// line (alignas(64) where it is declared), or share the line with data its one writer publishes through it.
struct WaitWord {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
};

void futex_wake_all(std::atomic<uint32_t>* word) noexcept;
// Sleeps while *word == expected, at most timeout_ns; spurious returns are fine (callers re-check).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) noexcept;

inline void publish(WaitWord* w, uint32_t value) noexcept {
  w->value.store(value, std::memory_order_seq_cst);
  if (w->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&w->value);
}

// Has the wrapping counter reached target? Counters are compared by signed distance so they may wrap.
inline bool reached(uint32_t value, uint32_t target) noexcept {
  return static_cast<int32_t>(value - target) >= 0;
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int64_t now_ns() noexcept;

}  // namespace gpucoll::host
