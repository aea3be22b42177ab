// Fibers of the emulated device: one per CUDA thread of a running block, switched cooperatively on the block's OS
// thread (executor.cc). A hand-written context switch on x86-64 (callee-saved registers, the stack pointer, the
// SSE/x87 control words: no system call, tens of nanoseconds), ucontext elsewhere. ThreadSanitizer must be told
// about every switch; executor.cc does that through the gpucoll_emu_tsan_* wrappers below, which compile to nothing
// without -fsanitize=thread.
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// GPUCOLL_EMU_TSAN: the process runs under ThreadSanitizer (set by the build that links it; the emulator itself is
// best left uninstrumented, see tests/emulation/native/CMakeLists.txt).
#if defined(GPUCOLL_EMU_TSAN) || defined(__SANITIZE_THREAD__)
#undef GPUCOLL_EMU_TSAN
#define GPUCOLL_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GPUCOLL_EMU_TSAN 1
#endif
#endif

namespace gpucoll_emu {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

// Saves the running context into `from` and resumes `to`.
void switch_context(Context* from, Context* to);
// Makes `ctx` start `entry(arg)` on [stack, stack + size) when it is next switched to. `entry` must never return.
void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg);

// Fiber stacks of one OS thread, reused block after block: index i is CUDA thread i's.
class Stacks {
 public:
  Stacks() = default;
  ~Stacks();
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  // The stack of thread `i` (allocated on first use, with a guard page below it); its usable size is bytes().
  void* get(int i);
  static size_t bytes();

 private:
  void* stacks_[1024] = {};
};

}  // namespace gpucoll_emu

#if defined(GPUCOLL_EMU_TSAN)
#include <sanitizer/tsan_interface.h>
#define GPUCOLL_EMU_TSAN_ONLY(...) __VA_ARGS__
#else
#define GPUCOLL_EMU_TSAN_ONLY(...)
#endif
