// Checks of the emulated CUDA runtime itself (csrc/emulation/), one function per documented behaviour, run by
// tests/emulation/test_native.py. Prints "ok <name>" or "FAIL <name>: <why>" per check; exits 1 if any failed.
//   runtime_checks                      every check
//   runtime_checks --child <args>       the other process of the IPC checks (spawned by the parent)
#include <cuda_runtime.h>
#include <gpucoll_emu/api.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

int g_failures = 0;
std::string g_self;

#define EXPECT(cond, ...)                                    \
  do {                                                       \
    if (!(cond)) {                                           \
      std::printf("  expectation failed (line %d): %s\n", __LINE__, #cond); \
      return false;                                          \
    }                                                        \
  } while (0)
#define EXPECT_ERR(expr, code) EXPECT((expr) == (code) && (cudaGetLastError(), true))
#define OK(expr) EXPECT_ERR(expr, cudaSuccess)

void check(const char* name, bool (*fn)()) {
  const bool ok = fn();
  cudaGetLastError();
  std::printf("%s %s\n", ok ? "ok" : "FAIL", name);
  std::fflush(stdout);
  if (!ok) ++g_failures;
}

// ---- kernels --------------------------------------------------------------------------------------------------------

__global__ void block_sum(const int* in, int* out, int n) {
  __shared__ int partial[1024];
  int acc = 0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) acc += in[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

// Thread 0 of every block stores its block index + 1 into flags[blockIdx] and waits (bounded) until every other
// block did the same; out[blockIdx] = 1 if they all showed up in time. Blocks that are not co-resident cannot.
__global__ void all_blocks_meet(unsigned long long* flags, int* out, unsigned long long timeout_ns) {
  if (threadIdx.x == 0) {
    __atomic_store_n(&flags[blockIdx.x], 1ull, __ATOMIC_RELEASE);
    gpucoll_emu_stored(&flags[blockIdx.x]);
    const unsigned long long start = gpucoll_emu_global_timer_ns();
    int met = 1;
    for (unsigned b = 0; b < gridDim.x; ++b) {
      for (;;) {
        const unsigned long long v = __atomic_load_n(&flags[b], __ATOMIC_ACQUIRE);
        gpucoll_emu_polled(&flags[b], v);
        if (v != 0) break;
        if (gpucoll_emu_global_timer_ns() - start > timeout_ns) {
          met = 0;
          break;
        }
      }
    }
    out[blockIdx.x] = met;
  }
  __syncthreads();
}

// Two kernels that need each other running at once: kernel `me` stores flags[me] and waits (bounded) for
// flags[1 - me]; out[me] = 1 if the peer showed up in time.
__global__ void pair_meet(unsigned long long* flags, int me, int* out, unsigned long long timeout_ns) {
  if (threadIdx.x == 0) {
    __atomic_store_n(&flags[me], 1ull, __ATOMIC_RELEASE);
    gpucoll_emu_stored(&flags[me]);
    const unsigned long long start = gpucoll_emu_global_timer_ns();
    int met = 1;
    for (;;) {
      const unsigned long long v = __atomic_load_n(&flags[1 - me], __ATOMIC_ACQUIRE);
      gpucoll_emu_polled(&flags[1 - me], v);
      if (v != 0) break;
      if (gpucoll_emu_global_timer_ns() - start > timeout_ns) {
        met = 0;
        break;
      }
    }
    out[me] = met;
  }
  __syncthreads();
}

__global__ void write_value(int* out, int value) { *out = value; }

// Threads that return early do not hold up a barrier of the others.
__global__ void early_exit(int* out) {
  if (threadIdx.x % 2 == 1) return;
  __syncthreads();
  atomicAdd(out, 1);
}

// Faults (runtime/access.cc): thread 0 of block `bad` makes one bad access of kind `kind` through the checked
// intrinsics; every other block spins on flags[0] (set by nobody) until the fault ends it. 0: a load one element
// past the end of `in`; 1: a store one element past the end of `out`; 2: a load of host memory; 3: a 16-byte load
// at `in` + 4 bytes (misaligned).
__global__ void bad_access(const int* in, int n, int* out, const int* host, unsigned long long* flags, int kind,
                           unsigned bad) {
  if (blockIdx.x != bad) {
    for (;;) {  // only the fault can end this wait
      const unsigned long long v = __atomic_load_n(flags, __ATOMIC_ACQUIRE);
      gpucoll_emu_polled(flags, v);
      if (v != 0) break;
    }
    return;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (kind == 0) out[0] = __ldcg(in + n);
  if (kind == 1) __stwb(out + n, 1);
  if (kind == 2) out[0] = __ldcg(host);
  if (kind == 3) out[0] = static_cast<int>(__ldcg(reinterpret_cast<const uint4*>(in + 1)).x);
  out[1] = 7;  // never reached
}

void sleep_ms(void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms))); }
void increment(void* p) { ++*static_cast<int*>(p); }
void try_cuda_inside(void* p) {
  void* q = nullptr;
  *static_cast<cudaError_t*>(p) = cudaMalloc(&q, 16);
}

// ---- checks ---------------------------------------------------------------------------------------------------------

bool memory_and_copies() {
  int* d = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int)));
  int garbage = 0;
  OK(cudaMemcpy(&garbage, d, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT(garbage != 0);  // never zero-initialised
  std::vector<int> h(64);
  for (int i = 0; i < 64; ++i) h[i] = i;
  OK(cudaMemcpy(d, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice));
  std::vector<int> back(64, -1);
  OK(cudaMemcpy(back.data(), d, back.size() * sizeof(int), cudaMemcpyDefault));
  EXPECT(back == h);
  EXPECT_ERR(cudaMemcpy(back.data(), h.data(), 4, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);  // wrong side
  EXPECT_ERR(cudaMemcpy(d, h.data(), 65 * sizeof(int), cudaMemcpyHostToDevice), cudaErrorInvalidValue);  // past end
  EXPECT_ERR(cudaMemset(d + 60, 0, 5 * sizeof(int)), cudaErrorInvalidValue);
  OK(cudaMemset(d + 1, 0, sizeof(int)));
  OK(cudaMemcpy(back.data(), d, 2 * sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT(back[0] == 0 && back[1] == 0);
  cudaPointerAttributes a;
  OK(cudaPointerGetAttributes(&a, h.data()));
  EXPECT(a.type == cudaMemoryTypeUnregistered);
  OK(cudaPointerGetAttributes(&a, d + 10));
  EXPECT(a.type == cudaMemoryTypeDevice && a.device == 0);
  unsigned long long base = 0;
  size_t size = 0;
  EXPECT(cuMemGetAddressRange_v2(&base, &size, reinterpret_cast<unsigned long long>(d + 7)) == 0);
  EXPECT(base == reinterpret_cast<unsigned long long>(d) && size == 64 * sizeof(int));
  EXPECT(cuMemGetAddressRange_v2(&base, &size, reinterpret_cast<unsigned long long>(h.data())) == 500);
  EXPECT_ERR(cudaFree(d + 1), cudaErrorInvalidValue);
  OK(cudaFree(d));
  EXPECT_ERR(cudaFree(d), cudaErrorInvalidValue);
  return true;
}

bool kernels_barriers_shared_memory() {
  const int n = 100000;
  std::vector<int> h(n);
  long long want = 0;
  for (int i = 0; i < n; ++i) want += (h[i] = i % 13 - 6);
  int *in = nullptr, *out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&in), n * sizeof(int)));
  OK(cudaMalloc(reinterpret_cast<void**>(&out), 4 * sizeof(int)));
  OK(cudaMemcpy(in, h.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  int nn = n;
  void* args[] = {&in, &out, &nn};
  OK(cudaLaunchKernel(block_sum, dim3(4), dim3(512), args, 0, nullptr));  // 4 blocks, each the whole sum
  int got[4] = {};
  OK(cudaMemcpy(got, out, sizeof(got), cudaMemcpyDeviceToHost));
  for (int v : got) EXPECT(v == want);
  OK(cudaMemset(out, 0, sizeof(int)));
  void* eargs[] = {&out};
  OK(cudaLaunchKernel(early_exit, dim3(1), dim3(64), eargs, 0, nullptr));
  OK(cudaMemcpy(got, out, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT(got[0] == 32);
  EXPECT_ERR(cudaLaunchKernel(block_sum, dim3(1), dim3(2048), args, 0, nullptr), cudaErrorInvalidConfiguration);
  EXPECT_ERR(cudaLaunchKernel(reinterpret_cast<const void*>(&h), dim3(1), dim3(1), args, 0, nullptr),
             cudaErrorInvalidDeviceFunction);
  int bps = 0;
  OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, block_sum, 512, 0));
  gpucoll_emu_config c;
  gpucoll_emu_get_config(&c);
  EXPECT(bps == std::min(c.blocks_per_sm, 4));  // 512 threads: 4 per SM by sm_90's 2048 threads, under the cap
  OK(cudaFree(in));
  OK(cudaFree(out));
  return true;
}

bool parameters_copied_at_launch() {
  int* out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&out), sizeof(int)));
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int ms = 50;
  OK(cudaLaunchHostFunc(s, sleep_ms, &ms));  // the kernel below runs after the host variable changed
  int value = 7;
  void* args[] = {&out, &value};
  OK(cudaLaunchKernel(write_value, dim3(1), dim3(1), args, 0, s));
  value = 8;
  OK(cudaStreamSynchronize(s));
  int got = 0;
  OK(cudaMemcpy(&got, out, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT(got == 7);
  OK(cudaStreamDestroy(s));
  OK(cudaFree(out));
  return true;
}

bool streams_events_and_legacy_order() {
  cudaStream_t a, b, nb;
  OK(cudaStreamCreate(&a));
  OK(cudaStreamCreate(&b));
  OK(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
  int counter = 0, ms = 30;
  OK(cudaLaunchHostFunc(a, sleep_ms, &ms));
  OK(cudaLaunchHostFunc(a, increment, &counter));
  EXPECT_ERR(cudaStreamQuery(a), cudaErrorNotReady);
  cudaEvent_t e;
  OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  OK(cudaEventRecord(e, a));
  OK(cudaStreamWaitEvent(b, e, 0));
  int seen = -1;
  // b's host function runs after a's increment: the event orders them.
  struct Capture { int* counter; int* seen; } cap{&counter, &seen};
  OK(cudaLaunchHostFunc(b, [](void* p) { auto* c = static_cast<Capture*>(p); *c->seen = *c->counter; }, &cap));
  OK(cudaStreamSynchronize(b));
  EXPECT(seen == 1);
  OK(cudaEventSynchronize(e));
  OK(cudaEventQuery(e));
  // Legacy stream: a synchronous copy waits for work queued before it on a blocking stream.
  OK(cudaLaunchHostFunc(a, sleep_ms, &ms));
  OK(cudaLaunchHostFunc(a, increment, &counter));
  int* d = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(int)));
  int x = 0;
  OK(cudaMemcpy(d, &x, sizeof(int), cudaMemcpyHostToDevice));
  EXPECT(counter == 2);
  // ... and blocking streams wait for the legacy stream's earlier work.
  OK(cudaLaunchHostFunc(nullptr, sleep_ms, &ms));
  OK(cudaLaunchHostFunc(nullptr, increment, &counter));
  OK(cudaLaunchHostFunc(b, [](void* p) { auto* c = static_cast<Capture*>(p); *c->seen = *c->counter; }, &cap));
  OK(cudaStreamSynchronize(b));
  EXPECT(seen == 3);
  // Timing events.
  cudaEvent_t t0, t1;
  OK(cudaEventCreate(&t0));
  OK(cudaEventCreate(&t1));
  OK(cudaEventRecord(t0, nb));
  OK(cudaLaunchHostFunc(nb, sleep_ms, &ms));
  OK(cudaEventRecord(t1, nb));
  OK(cudaEventSynchronize(t1));
  float elapsed = 0;
  OK(cudaEventElapsedTime(&elapsed, t0, t1));
  EXPECT(elapsed >= 25.0f);
  EXPECT_ERR(cudaEventElapsedTime(&elapsed, e, t1), cudaErrorInvalidResourceHandle);  // e has no timing
  // A host function may not call CUDA.
  cudaError_t inside = cudaSuccess;
  OK(cudaLaunchHostFunc(nb, try_cuda_inside, &inside));
  OK(cudaStreamSynchronize(nb));
  EXPECT(inside == cudaErrorNotPermitted);
  for (cudaEvent_t ev : {e, t0, t1}) OK(cudaEventDestroy(ev));
  for (cudaStream_t st : {a, b, nb}) OK(cudaStreamDestroy(st));
  EXPECT_ERR(cudaStreamSynchronize(a), cudaErrorInvalidResourceHandle);
  OK(cudaFree(d));
  return true;
}

// Two kernels that each need the other running at the same time, on two streams, captured into one graph from two
// streams (fork and join through events) and replayed: the graph must run them concurrently.
bool capture_fork_join_and_replay() {
  unsigned long long* flags = nullptr;
  int* out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&flags), 2 * sizeof(unsigned long long)));
  OK(cudaMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(int)));
  cudaStream_t s0, s1;
  OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  unsigned long long timeout = 5000000000ull;
  int me0 = 0, me1 = 1;
  void* a0[] = {&flags, &me0, &out, &timeout};
  void* a1[] = {&flags, &me1, &out, &timeout};
  int hits = 0;
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
  OK(cudaMemsetAsync(flags, 0, 2 * sizeof(unsigned long long), s0));
  OK(cudaEventRecord(fork, s0));
  OK(cudaStreamWaitEvent(s1, fork, 0));
  EXPECT_ERR(cudaEventQuery(fork), cudaErrorCapturedEvent);
  OK(cudaLaunchKernel(pair_meet, dim3(1), dim3(32), a0, 0, s0));
  OK(cudaLaunchKernel(pair_meet, dim3(1), dim3(32), a1, 0, s1));
  OK(cudaLaunchHostFunc(s1, increment, &hits));
  OK(cudaEventRecord(join, s1));
  OK(cudaStreamWaitEvent(s0, join, 0));
  cudaGraph_t g = nullptr;
  OK(cudaStreamEndCapture(s0, &g));
  cudaGraphExec_t ge = nullptr;
  OK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 50; ++i) OK(cudaGraphLaunch(ge, s0));
  OK(cudaStreamSynchronize(s0));
  EXPECT(hits == 50);
  int met[2] = {};
  OK(cudaMemcpy(met, out, sizeof(met), cudaMemcpyDeviceToHost));
  EXPECT(met[0] == 1 && met[1] == 1);
  OK(cudaGraphExecDestroy(ge));
  OK(cudaGraphDestroy(g));
  // Capture rules.
  cudaGraph_t bad = nullptr;
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
  OK(cudaEventRecord(fork, s0));
  OK(cudaStreamWaitEvent(s1, fork, 0));
  OK(cudaLaunchHostFunc(s1, increment, &hits));
  EXPECT_ERR(cudaStreamEndCapture(s1, &bad), cudaErrorStreamCaptureUnmatched);
  EXPECT_ERR(cudaStreamEndCapture(s0, &bad), cudaErrorStreamCaptureInvalidated);
  EXPECT(bad == nullptr);
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
  OK(cudaEventRecord(fork, s0));
  OK(cudaStreamWaitEvent(s1, fork, 0));
  OK(cudaLaunchHostFunc(s1, increment, &hits));
  EXPECT_ERR(cudaStreamEndCapture(s0, &bad), cudaErrorStreamCaptureUnjoined);
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
  EXPECT_ERR(cudaStreamSynchronize(s0), cudaErrorStreamCaptureUnsupported);
  cudaStreamCaptureStatus st;
  OK(cudaStreamIsCapturing(s0, &st));
  EXPECT(st == cudaStreamCaptureStatusInvalidated);
  EXPECT_ERR(cudaStreamEndCapture(s0, &bad), cudaErrorStreamCaptureInvalidated);
  cudaEvent_t eager;
  OK(cudaEventCreateWithFlags(&eager, cudaEventDisableTiming));
  OK(cudaEventRecord(eager, s1));
  // Complete before the queries below: relaxed mode must let them through (cudaSuccess), and an event still pending
  // behind s1's host functions would answer cudaErrorNotReady instead (it did under CI load, with 3 SMs).
  OK(cudaEventSynchronize(eager));
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed));
  EXPECT_ERR(cudaStreamWaitEvent(s0, eager, 0), cudaErrorStreamCaptureIsolation);
  EXPECT_ERR(cudaStreamEndCapture(s0, &bad), cudaErrorStreamCaptureInvalidated);
  // Global mode: an unsafe call from another thread (in global mode) invalidates the capture; relaxed does not.
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  cudaError_t other = cudaSuccess;
  std::thread([&] { other = cudaEventQuery(eager); }).join();
  EXPECT(other == cudaErrorStreamCaptureUnsupported);
  EXPECT_ERR(cudaStreamEndCapture(s0, &bad), cudaErrorStreamCaptureInvalidated);
  OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  std::thread([&] {
    cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&m);
    other = cudaEventQuery(eager);
  }).join();
  EXPECT(other == cudaSuccess);
  OK(cudaStreamEndCapture(s0, &g));
  OK(cudaGraphDestroy(g));
  // The legacy stream cannot be used while a blocking stream captures.
  cudaStream_t blocking;
  OK(cudaStreamCreate(&blocking));
  OK(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeRelaxed));
  EXPECT_ERR(cudaMemsetAsync(out, 0, 4, nullptr), cudaErrorStreamCaptureImplicit);
  EXPECT_ERR(cudaStreamEndCapture(blocking, &bad), cudaErrorStreamCaptureInvalidated);
  for (cudaEvent_t ev : {fork, join, eager}) OK(cudaEventDestroy(ev));
  for (cudaStream_t s : {s0, s1, blocking}) OK(cudaStreamDestroy(s));
  OK(cudaFree(flags));
  OK(cudaFree(out));
  return true;
}

// A kernel whose blocks must all be resident at once, with more blocks than the device has slots: the blocks
// beyond the slots wait, so the meeting times out, as on a GPU; with as many blocks as slots it succeeds.
// The occupancy model (executor.cc): blocks per SM from the block's warps, its dynamic shared memory (+1 KiB reserved)
// and the SM's block limit (sm_90's: 2048 threads, 32 blocks, 228 KiB), capped by blocks_per_sm. The query answers
// it, and exactly that many blocks per SM are co-resident: one block more than sms x that never meets the others.
bool residency_is_enforced() {
  gpucoll_emu_config c;
  gpucoll_emu_get_config(&c);
  EXPECT(c.cc_major == 9 && c.cc_minor == 0);  // the limits below are sm_90's
  struct Shape {
    int threads;
    size_t shared;
  };
  for (const Shape sh : {Shape{32, 0}, Shape{1024, 0}, Shape{256, 40 << 10}, Shape{1000, 0}}) {
    const int warps = (sh.threads + 31) / 32 * 32;
    const int want = std::min({c.blocks_per_sm, 32, 2048 / warps, static_cast<int>((228u << 10) / (sh.shared + 1024))});
    int per_sm = -1;
    OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, all_blocks_meet,
                                                     sh.threads, sh.shared));
    if (per_sm != want) std::printf("  %d threads, %zu shared bytes: %d blocks per SM, want %d\n", sh.threads, sh.shared, per_sm, want);
    EXPECT(per_sm == want);
    const int slots = c.sms * per_sm;
    unsigned long long* flags = nullptr;
    int* out = nullptr;
    OK(cudaMalloc(reinterpret_cast<void**>(&flags), (slots + 1) * sizeof(unsigned long long)));
    OK(cudaMalloc(reinterpret_cast<void**>(&out), (slots + 1) * sizeof(int)));
    unsigned long long timeout = 300000000ull;  // 0.3 s
    void* args[] = {&flags, &out, &timeout};
    std::vector<int> met(slots + 1);
    for (int blocks : {slots, slots + 1}) {
      OK(cudaMemset(flags, 0, (slots + 1) * sizeof(unsigned long long)));
      OK(cudaLaunchKernel(all_blocks_meet, dim3(blocks), dim3(sh.threads), args, sh.shared, nullptr));
      OK(cudaMemcpy(met.data(), out, blocks * sizeof(int), cudaMemcpyDeviceToHost));
      int all = 1;
      for (int b = 0; b < blocks; ++b) all &= met[b];
      if (all != (blocks <= slots ? 1 : 0)) std::printf("  %d threads, %d blocks: met=%d\n", sh.threads, blocks, all);
      EXPECT(all == (blocks <= slots ? 1 : 0));
    }
    OK(cudaFree(flags));
    OK(cudaFree(out));
  }
  return true;
}

bool devices_and_errors() {
  int n = 0;
  OK(cudaGetDeviceCount(&n));
  gpucoll_emu_config c;
  gpucoll_emu_get_config(&c);
  EXPECT(n == c.devices);
  EXPECT_ERR(cudaSetDevice(n), cudaErrorInvalidDevice);
  int sms = 0;
  OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  EXPECT(sms == c.sms);
  EXPECT(std::strcmp(cudaGetErrorName(cudaErrorStreamCaptureImplicit), "cudaErrorStreamCaptureImplicit") == 0);
  EXPECT(std::strcmp(cudaGetErrorString(cudaErrorInvalidValue), "invalid argument") == 0);
  EXPECT(cudaMalloc(nullptr, 4) == cudaErrorInvalidValue);
  EXPECT(cudaPeekAtLastError() == cudaErrorInvalidValue && cudaGetLastError() == cudaErrorInvalidValue);
  EXPECT(cudaGetLastError() == cudaSuccess);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  OK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q));
  EXPECT(q == cudaDriverEntryPointSuccess && fn == reinterpret_cast<void*>(&cuMemGetAddressRange_v2));
  OK(cudaGetDriverEntryPointByVersion("cuNoSuchThing", &fn, 12000, cudaEnableDefault, &q));
  EXPECT(q == cudaDriverEntryPointSymbolNotFound && fn == nullptr);
  void* p = nullptr;
  EXPECT_ERR(cudaMalloc(&p, static_cast<size_t>(c.memory) + 1), cudaErrorMemoryAllocation);
  return true;
}

// ---- IPC between processes ------------------------------------------------------------------------------------------

std::string hex(const cudaIpcMemHandle_t& h) {
  std::string s;
  char b[3];
  for (char c : h.reserved) {
    std::snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(c));
    s += b;
  }
  return s;
}

cudaIpcMemHandle_t unhex(const char* s) {
  cudaIpcMemHandle_t h;
  for (size_t i = 0; i < sizeof(h.reserved); ++i) {
    unsigned v = 0;
    std::sscanf(s + 2 * i, "%2x", &v);
    h.reserved[i] = static_cast<char>(v);
  }
  return h;
}

int run_child(const std::vector<std::string>& args) {
  // child <handle> <mode>: "rw" reads 0..63 and writes their negatives; "gone" expects the open to fail.
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, unhex(args[0].c_str()), cudaIpcMemLazyEnablePeerAccess);
  if (args[1] == "gone") return e == cudaErrorMapBufferObjectFailed ? 0 : 10;
  if (e != cudaSuccess) return 11;
  void* again = nullptr;
  if (cudaIpcOpenMemHandle(&again, unhex(args[0].c_str()), cudaIpcMemLazyEnablePeerAccess) != cudaSuccess ||
      again != p) {
    return 12;  // a second open returns the same mapping
  }
  std::vector<int> h(64);
  if (cudaMemcpy(h.data(), p, 64 * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) return 13;
  for (int i = 0; i < 64; ++i) {
    if (h[i] != i) return 14;
    h[i] = -i;
  }
  if (cudaMemcpy(p, h.data(), 64 * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess) return 15;
  if (cudaIpcCloseMemHandle(p) != cudaSuccess || cudaIpcCloseMemHandle(p) != cudaSuccess) return 16;
  if (cudaIpcCloseMemHandle(p) != cudaErrorInvalidValue) return 17;
  return 0;
}

// --fault <kind>: one fault of bad_access's `kind` in a fresh process (a fault poisons the process for good).
int run_fault(int kind) {
  int *in = nullptr, *out = nullptr;
  unsigned long long* flags = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&in), 100 * sizeof(int)) != cudaSuccess) return 20;
  if (cudaMalloc(reinterpret_cast<void**>(&out), 100 * sizeof(int)) != cudaSuccess) return 21;
  if (cudaMalloc(reinterpret_cast<void**>(&flags), 8) != cudaSuccess) return 22;
  if (cudaMemset(flags, 0, 8) != cudaSuccess || cudaMemset(out, 0, 400) != cudaSuccess) return 23;
  static int host_word = 5;
  cudaStream_t s;
  if (cudaStreamCreate(&s) != cudaSuccess) return 24;
  // Blocks 0 and 2 spin; block 1 faults. The launch succeeds: the fault is found while the kernel runs.
  const int* cin = in;
  const int* host = &host_word;
  int n = 100;
  unsigned bad = 1;
  void* args[] = {&cin, &n, &out, &host, &flags, &kind, &bad};
  if (cudaLaunchKernel(bad_access, dim3(3), dim3(64), args, 0, s) != cudaSuccess) return 25;
  const cudaError_t want = kind == 3 ? cudaErrorMisalignedAddress : cudaErrorIllegalAddress;
  if (cudaStreamSynchronize(s) != want) return 26;
  // Sticky: every later call fails the same way, and the last error cannot be cleared.
  void* p = nullptr;
  if (cudaMalloc(&p, 64) != want) return 27;
  if (cudaGetLastError() != want || cudaGetLastError() != want || cudaPeekAtLastError() != want) return 28;
  int h = 0;
  if (cudaMemcpy(&h, out + 1, sizeof(int), cudaMemcpyDeviceToHost) != want) return 29;
  return 0;
}

// --fault 4: host code reads device memory while the device is idle: a segfault, as on a GPU (region.cc).
int run_host_touch() {
  int* d = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&d), 64) != cudaSuccess || cudaMemset(d, 0, 64) != cudaSuccess) return 40;
  if (cudaDeviceSynchronize() != cudaSuccess) return 41;
  const volatile int v = *d;  // dies here
  (void)v;
  return 42;
}

// Runs this program again with `args`; its exit status, or 128 + the signal that killed it.
int spawn_self(std::vector<std::string> argv_s) {
  argv_s.insert(argv_s.begin(), g_self);
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, g_self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -2;
}

int spawn_child(const std::string& handle, const char* mode) { return spawn_self({"--child", handle, mode}); }

bool ipc_between_processes() {
  int* d = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int)));
  std::vector<int> h(64);
  for (int i = 0; i < 64; ++i) h[i] = i;
  OK(cudaMemcpy(d, h.data(), sizeof(int) * 64, cudaMemcpyHostToDevice));
  cudaIpcMemHandle_t handle;
  EXPECT_ERR(cudaIpcGetMemHandle(&handle, d + 1), cudaErrorInvalidValue);  // not an allocation's base
  OK(cudaIpcGetMemHandle(&handle, d));
  void* p = nullptr;
  EXPECT_ERR(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess), cudaErrorDeviceUninitialized);
  const int rc = spawn_child(hex(handle), "rw");
  if (rc != 0) std::printf("  child exited with %d\n", rc);
  EXPECT(rc == 0);
  OK(cudaMemcpy(h.data(), d, sizeof(int) * 64, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 64; ++i) EXPECT(h[i] == -i);
  OK(cudaFree(d));
  EXPECT(spawn_child(hex(handle), "gone") == 0);  // a freed allocation cannot be opened
  return true;
}

bool faults_are_sticky_errors() {
  for (const char* kind : {"0", "1", "2", "3"}) {
    const int rc = spawn_self({"--fault", kind});
    if (rc != 0) std::printf("  fault kind %s: child exited with %d\n", kind, rc);
    EXPECT(rc == 0);
  }
  return true;
}

bool host_code_cannot_touch_idle_device_memory() {
  const int rc = spawn_self({"--fault", "4"});
  if (rc != 128 + SIGSEGV) std::printf("  child exited with %d (want %d: SIGSEGV)\n", rc, 128 + SIGSEGV);
  EXPECT(rc == 128 + SIGSEGV);
  return true;
}

bool forked_child_cannot_use_cuda() {
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaErrorInitializationError ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  g_self = argv[0];
  if (argc >= 2 && std::strcmp(argv[1], "--child") == 0) {
    std::vector<std::string> args(argv + 2, argv + argc);
    return run_child(args);
  }
  // --sms=N --blocks_per_sm=N: the device shape (before the first CUDA call).
  gpucoll_emu_config cfg;
  gpucoll_emu_default_config(&cfg);
  cfg.host_fence = 1;  // host code kept out of idle device memory (region.cc): every check runs with it
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--sms=", 6) == 0) cfg.sms = std::atoi(argv[i] + 6);
    if (std::strncmp(argv[i], "--blocks_per_sm=", 16) == 0) cfg.blocks_per_sm = std::atoi(argv[i] + 16);
  }
  if (gpucoll_emu_configure(&cfg) != cudaSuccess) {
    std::printf("FAIL configure\n");
    return 1;
  }
  if (argc >= 3 && std::strcmp(argv[1], "--fault") == 0) {
    return std::atoi(argv[2]) == 4 ? run_host_touch() : run_fault(std::atoi(argv[2]));
  }
  check("memory_and_copies", memory_and_copies);
  check("kernels_barriers_shared_memory", kernels_barriers_shared_memory);
  check("parameters_copied_at_launch", parameters_copied_at_launch);
  check("streams_events_and_legacy_order", streams_events_and_legacy_order);
  check("capture_fork_join_and_replay", capture_fork_join_and_replay);
  check("residency_is_enforced", residency_is_enforced);
  check("devices_and_errors", devices_and_errors);
  check("ipc_between_processes", ipc_between_processes);
  check("forked_child_cannot_use_cuda", forked_child_cannot_use_cuda);
  check("faults_are_sticky_errors", faults_are_sticky_errors);
  check("host_code_cannot_touch_idle_device_memory", host_code_cannot_touch_idle_device_memory);
  gpucoll_emu_counts counts;
  gpucoll_emu_get_counts(&counts);
  const bool clean = counts.allocations == 0 && counts.ipc_mappings == 0 && counts.streams == 0 && counts.events == 0 &&
                     counts.graphs == 0 && counts.graph_execs == 0;
  std::printf("%s nothing_left_behind\n", clean ? "ok" : "FAIL");
  if (!clean) ++g_failures;
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
