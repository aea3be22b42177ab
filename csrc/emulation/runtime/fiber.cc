#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace gpucoll_emu {

#if defined(__x86_64__)
// switch_context(from, to): push the callee-saved registers and the control words on the current stack, save the
// stack pointer into *from, load to's, pop the same frame and return into whatever `to` was doing. A new context
// gets a frame that "returns" into gpucoll_emu_fiber_start, which calls entry(arg) with a 16-byte aligned stack.
extern "C" void gpucoll_emu_ctx_switch(void** from_sp, void* to_sp);
extern "C" void gpucoll_emu_fiber_start();
asm(R"(
  .pushsection .text
  .globl gpucoll_emu_ctx_switch
  .hidden gpucoll_emu_ctx_switch
  .type gpucoll_emu_ctx_switch, @function
gpucoll_emu_ctx_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size gpucoll_emu_ctx_switch, .-gpucoll_emu_ctx_switch

  .globl gpucoll_emu_fiber_start
  .hidden gpucoll_emu_fiber_start
  .type gpucoll_emu_fiber_start, @function
gpucoll_emu_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size gpucoll_emu_fiber_start, .-gpucoll_emu_fiber_start
  .popsection
)");

void switch_context(Context* from, Context* to) { gpucoll_emu_ctx_switch(&from->sp, to->sp); }

void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  // 11 words: x87 control word, MXCSR, r15, r14, r13 (entry), r12 (arg), rbx, rbp, return address, and padding so
  // that after the frame is popped the stack is 16-byte aligned at the `call` in gpucoll_emu_fiber_start.
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 88);
  sp[0] = 0x037f;  // x87: all exceptions masked, double-extended precision, round to nearest
  sp[1] = 0x1f80;  // MXCSR: all exceptions masked, round to nearest
  sp[2] = 0;
  sp[3] = 0;
  sp[4] = reinterpret_cast<uint64_t>(entry);
  sp[5] = reinterpret_cast<uint64_t>(arg);
  sp[6] = 0;
  sp[7] = 0;
  sp[8] = reinterpret_cast<uint64_t>(&gpucoll_emu_fiber_start);
  ctx->sp = sp;
}
#else
namespace {
void ucontext_entry(unsigned hi, unsigned lo, unsigned ahi, unsigned alo) {
  auto entry = reinterpret_cast<void (*)(void*)>((static_cast<uintptr_t>(hi) << 32) | lo);
  entry(reinterpret_cast<void*>((static_cast<uintptr_t>(ahi) << 32) | alo));
  std::abort();
}
}  // namespace

void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack;
  ctx->uc.uc_stack.ss_size = size;
  ctx->uc.uc_link = nullptr;
  const uintptr_t e = reinterpret_cast<uintptr_t>(entry), a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&ctx->uc, reinterpret_cast<void (*)()>(&ucontext_entry), 4, static_cast<unsigned>(e >> 32),
              static_cast<unsigned>(e), static_cast<unsigned>(a >> 32), static_cast<unsigned>(a));
}
#endif

size_t Stacks::bytes() {
  // Kernel frames are small (a few hundred bytes of locals); instrumented builds need far more per frame.
#if defined(GPUCOLL_EMU_TSAN)
  return 256 << 10;
#else
  return 64 << 10;
#endif
}

void* Stacks::get(int i) {
  if (stacks_[i] != nullptr) return stacks_[i];
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, bytes() + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) std::abort();  // no stack for a CUDA thread: nothing sensible to return to the kernel
  mprotect(p, page, PROT_NONE);     // overflowing a fiber's stack faults instead of writing into the next one
  stacks_[i] = static_cast<char*>(p) + page;
  return stacks_[i];
}

Stacks::~Stacks() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (void* s : stacks_) {
    if (s != nullptr) munmap(static_cast<char*>(s) - page, bytes() + page);
  }
}

}  // namespace gpucoll_emu
