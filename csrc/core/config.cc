#include "core/config.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace gpucoll {

const std::vector<ConfigVar>& config_vars() {
  static const std::vector<ConfigVar> vars = {
      {"GPUCOLL_LOG_LEVEL", VarType::kString, "WARN",
       "Log level: ERROR, WARN, INFO, DEBUG or TRACE. Lines go to stderr, prefixed with the rank."},
      {"GPUCOLL_NCCL_LIBRARY", VarType::kString, "",
       "Path of libnccl.so.2 to load; when empty gpucoll tries a copy already loaded in the process, an "
       "installed nvidia-nccl-cu13/-cu12 wheel, then the system loader (emulated-device builds: gpucoll's NCCL "
       "stand-in, gpucoll/_emu/libnccl-emu.so)."},
      {"GPUCOLL_NCCL_WATCHDOG_MS", VarType::kInt, "100",
       "How often (milliseconds) the NCCL backend's watchdog checks for timed-out collectives and asynchronous "
       "NCCL errors; ranks publish their progress to the store at most every max(this, 500 ms)."},
      {"GPUCOLL_NCCL_BLOCKING_OPS", VarType::kBool, "0",
       "1: after its non-blocking init (bounded by the timeout), the NCCL backend splits a blocking communicator "
       "off it for operations. NCCL >= 2.23 runs each operation of a non-blocking communicator through a thread "
       "it starts per call; a blocking one launches on the caller's thread, but the timeout then no longer bounds "
       "NCCL's host-side waits (connection setup to a peer that never comes). Off until measured on a GPU."},
      {"GPUCOLL_BACKEND", VarType::kString, "",
       "Backend when gpucoll.init(backend='auto'): host, nccl or custom. Empty: GPU backends when a GPU is "
       "usable, else host."},
      {"GPUCOLL_ALGO", VarType::kString, "",
       "Algorithm overrides per collective, e.g. 'allreduce:ring,broadcast:tree'. An explicit algo= argument "
       "wins over this."},
      {"GPUCOLL_LOCAL_SIZE", VarType::kInt, "0",
       "Ranks per (virtual) node for hierarchical algorithms; 0 means all ranks of the host form one node."},
      {"GPUCOLL_DEBUG_CHECKS", VarType::kBool, "0",
       "Explicit cross-rank call checks for backends whose own synchronisation cannot carry them: the NCCL "
       "backend compares every collective's signature through the rendezvous store before enqueuing it (a store "
       "round trip per call). The host backend compares every collective call across ranks always, within its "
       "first step, whatever this says, and the custom kernels compare every call in their first barrier."},
      {"GPUCOLL_STORE_SECRET", VarType::kSecret, "",
       "The job's secret for gpucoll's rendezvous store: every connection proves it knows it (HMAC "
       "challenge-response; it never travels). The same random value (16 bytes at least; 32 random bytes in hex "
       "are best) on every rank. gpucoll.spawn and init(mpi_comm=...) make one themselves; under a launcher set "
       "it in the job's environment, else init() uses the per-user file ~/.gpucoll/store_secret. Not used over "
       "torch.distributed's store (torchrun's agent)."},
      {"GPUCOLL_HOST_BUFFER_BYTES", VarType::kBytes, "16M",
       "Shared-memory work buffer per rank of the host backend, used as two halves by alternate pieces; "
       "messages larger than a half are processed in pieces."},
      {"GPUCOLL_HOST_SEGMENT_BYTES", VarType::kBytes, "256K",
       "Target chunk size of one host schedule step: a message runs its schedule piece by piece, each piece "
       "sized so that its chunks are about this big, so a step's data stays in cache and ranks, coupled only "
       "through step counters, work on successive pieces at once."},
      {"GPUCOLL_HOST_FUSION_BYTES", VarType::kBytes, "32M",
       "Chunk of the host backend's coalesced calls (all_reduce_coalesced, all_gather_coalesced): arrays are "
       "packed into a staging buffer of at most this size per communicator, one collective per chunk."},
      {"GPUCOLL_HOST_SPIN_US", VarType::kInt, "50",
       "How long a waiting host rank spins before it sleeps on a futex. Ranks may outnumber cores, and a "
       "spinning rank would steal the core the awaited rank needs."},
      {"GPUCOLL_STRAGGLER_REPORT", VarType::kInt, "0",
       "Every this many collectives, rank 0 of a communicator writes a one-line straggler summary to stderr: the "
       "ranks that arrived last most often over the last 1000 collectives measured, and how late (comm."
       "stragglers() gives the whole table). 0: never."},
      {"GPUCOLL_TRACE_BUFFER", VarType::kInt, "2000",
       "Entries of each communicator's flight recorder: its last operations with their call, size, algorithm, "
       "state and times, dumped to GPUCOLL_TRACE_DIR when a collective times out or a peer fails (read it with "
       "python -m gpucoll trace). 0: off."},
      {"GPUCOLL_TRACE_DIR", VarType::kString, "",
       "Where a failed collective's flight-recorder dump is written, one JSON file per rank; empty: the system's "
       "temporary directory. The error names the file."},
      {"GPUCOLL_CUSTOM_BUFFER_BYTES", VarType::kBytes, "32M",
       "Staging buffer per rank of the custom backend's kernels, per half (two halves, used by alternate calls); "
       "larger allreduces run as several kernels."},
      {"GPUCOLL_CUSTOM_NCCL_FALLBACK", VarType::kBool, "1",
       "Custom backend: run what its kernels cannot (other collectives, dtypes, ops, no P2P) on NCCL. 0: raise "
       "Unsupported with the reason instead."},
      {"GPUCOLL_TOPO_FILE", VarType::kString, "",
       "Topology file (our JSON, NCCL topology XML or nvidia-smi topo -m text) used instead of detection."},
      {"GPUCOLL_TOPO_DUMP_FILE", VarType::kString, "", "Write the detected (or loaded) topology to this JSON file."},
      {"GPUCOLL_TUNING_FILE", VarType::kString, "",
       "Tuning file from gpucoll-tune: fitted a/b per algorithm and link class replacing the shipped defaults."},
      {"GPUCOLL_CUDA", VarType::kString, "auto",
       "Build time (read by setup.py): auto builds the CUDA sources when nvcc is found; on requires nvcc; "
       "off builds host-only; emulate builds them with the host compiler against gpucoll's emulated CUDA device "
       "(csrc/emulation/), so the GPU code runs on a CPU (for tests: it is not a GPU, and its timings are not GPU "
       "timings)."},
      {"GPUCOLL_CUDA_ARCHS", VarType::kString, "",
       "Build time (read by setup.py): CUDA architectures, e.g. '80;90'. Empty: the local GPU's, else 80;90."},
      {"GPUCOLL_BUILD_DIR", VarType::kString, "",
       "Build time (read by setup.py): CMake's build directory. Empty: build/gpucoll._C-<mode>-py<X.Y> in the "
       "source tree, kept between installs so that a second install only rebuilds what changed."},
      // The emulated device's shape (GPUCOLL_CUDA=emulate builds only), read when gpucoll._C is imported: every
      // process of a job must see the same values. Tests set them to check residency and eligibility decisions
      // on several GPU shapes.
      {"GPUCOLL_EMU_DEVICES", VarType::kInt, "1", "Emulated device: how many devices (cudaGetDeviceCount)."},
      {"GPUCOLL_EMU_SMS", VarType::kInt, "8",
       "Emulated device: multiprocessors per device. Each holds as many blocks at once (one OS thread each) as "
       "the occupancy model allows: the block's warps, its dynamic shared memory and the SM's block limit for the "
       "compute capability, capped by GPUCOLL_EMU_BLOCKS_PER_SM; a block that fits nowhere waits, as on a GPU."},
      {"GPUCOLL_EMU_BLOCKS_PER_SM", VarType::kInt, "2",
       "Emulated device: a cap on resident blocks per multiprocessor, below the occupancy model's answer (what "
       "cudaOccupancyMaxActiveBlocksPerMultiprocessor gives; 32 leaves the model alone: 4 blocks of gpucoll's "
       "512-thread kernels on sm_90). 2 keeps the emulated suite's grids small."},
      {"GPUCOLL_EMU_COMPUTE_CAPABILITY", VarType::kString, "9.0", "Emulated device: compute capability, e.g. 8.0."},
      {"GPUCOLL_EMU_P2P", VarType::kBool, "1",
       "Emulated device: whether distinct devices can map each other's memory (cudaDeviceCanAccessPeer, CUDA "
       "IPC between processes on different devices)."},
      {"GPUCOLL_EMU_JITTER_US", VarType::kInt, "0",
       "Emulated device: each stream operation starts after a delay of 0 to this many microseconds, drawn from "
       "GPUCOLL_EMU_SEED, so that streams interleave differently from run to run and a missing dependency shows "
       "(the GPU test suite sets it; 0: none)."},
      {"GPUCOLL_EMU_SEED", VarType::kInt, "0",
       "Emulated device: the seed of GPUCOLL_EMU_JITTER_US's delays and GPUCOLL_EMU_SHUFFLE_THREADS's thread order "
       "and switch points. The same seed replays the same draws."},
      {"GPUCOLL_EMU_SHUFFLE_THREADS", VarType::kBool, "0",
       "Emulated device: start each turn of a block's threads at a thread drawn from GPUCOLL_EMU_SEED instead of "
       "thread 0, and give way to the block's other threads after a drawn number (1 to 16) of global accesses, so "
       "that a missing __syncthreads shows as a read before the write (the GPU test suite sets it)."},
      {"GPUCOLL_EMU_HOST_FENCE", VarType::kBool, "0",
       "Emulated device: close device memory to the process while the device is idle, so that host code that "
       "dereferences a device pointer segfaults as on a GPU (one mprotect per idle/busy transition; the GPU test "
       "suite sets it for the NCCL and group tests, and everywhere with --thorough)."},
      {"GPUCOLL_EMU_MEMORY", VarType::kBytes, "16G",
       "Emulated device: memory per device; cudaMalloc beyond it fails with cudaErrorMemoryAllocation. "
       "Allocations are host memory (shared, so CUDA IPC works)."},
  };
  return vars;
}

const char* var_type_name(VarType t) {
  switch (t) {
    case VarType::kBool:
      return "bool";
    case VarType::kInt:
      return "int";
    case VarType::kBytes:
      return "bytes";
    case VarType::kFloat:
      return "float";
    case VarType::kString:
      return "string";
    case VarType::kSecret:
      return "secret";
  }
  return "?";
}

static const ConfigVar& find_var(const std::string& name) {
  for (const ConfigVar& v : config_vars()) {
    if (name == v.name) return v;
  }
  GPUCOLL_THROW(ErrorCode::kInvalidArgument, "config", "unknown configuration variable '", name,
                "'; known ones are listed by `python -m gpucoll info`");
}

bool config_is_set(const std::string& name) {
  find_var(name);
  const char* env = std::getenv(name.c_str());
  return env != nullptr && env[0] != '\0';
}

std::string config_raw(const std::string& name) {
  const ConfigVar& var = find_var(name);
  const char* env = std::getenv(name.c_str());
  if (env != nullptr && env[0] != '\0') return env;
  return var.default_value;
}

static std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool config_bool(const std::string& name) {
  const std::string v = lower(config_raw(name));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  GPUCOLL_THROW(ErrorCode::kInvalidArgument, "config", name, "='", v, "' is not a boolean (expected 0/1/true/false)");
}

int64_t config_int(const std::string& name) {
  const std::string v = config_raw(name);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0') {
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, "config", name, "='", v, "' is not an integer");
  }
  return x;
}

bool parse_bytes(const std::string& text, int64_t* out) {
  // Plain decimal numbers only ("1.5M" is fine): strtod alone would also take "nan", "inf", "0x10", " 4".
  if (text.empty() || !(std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.')) return false;
  for (char c : text) {
    if (c == 'x' || c == 'X' || c == 'e' || c == 'E') return false;
  }
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || !std::isfinite(x) || x < 0) return false;
  std::string suffix = lower(end);
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  if (suffix.size() == 2 && suffix[1] == 'i') suffix.pop_back();
  double mult = 1;
  if (suffix.empty()) {
    mult = 1;
  } else if (suffix == "k") {
    mult = 1024.0;
  } else if (suffix == "m") {
    mult = 1024.0 * 1024;
  } else if (suffix == "g") {
    mult = 1024.0 * 1024 * 1024;
  } else if (suffix == "t") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return false;
  }
  const double bytes = x * mult;
  if (bytes >= 9.2e18) return false;  // would not fit int64
  *out = static_cast<int64_t>(bytes);
  return true;
}

int64_t config_bytes(const std::string& name) {
  const std::string v = config_raw(name);
  int64_t x = 0;
  if (!parse_bytes(v, &x)) {
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, "config", name, "='", v,
                  "' is not a size (expected e.g. 4096, 64K, 16M, 1G)");
  }
  return x;
}

double config_float(const std::string& name) {
  const std::string v = config_raw(name);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0') {
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, "config", name, "='", v, "' is not a number");
  }
  return x;
}

}  // namespace gpucoll
