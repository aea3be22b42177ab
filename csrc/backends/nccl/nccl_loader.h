// Loads libnccl.so.2 at run time into a table of function pointers.
//
// gpucoll never links NCCL: the package must import where NCCL is absent, and a process that already has
// torch's or CuPy's NCCL should use that one copy. A missing or unusable NCCL is a state with a reason,
// never an exception or a crash at load; code that needs NCCL asks nccl_require(), which throws
// Unsupported carrying that reason.
//
// Search order (the first usable library wins):
//   1. GPUCOLL_NCCL_LIBRARY, when set. If it cannot be used, that failure is the state: naming a library is
//      a decision, and silently loading a different one would hide the mistake.
//   2. A copy already loaded in this process (dlopen("libnccl.so.2", RTLD_NOLOAD)), e.g. torch's.
//   3. The wheel paths passed in (gpucoll._nccl.wheel_candidates(): nvidia-nccl-cu13, then -cu12).
//   4. The system loader: dlopen("libnccl.so.2") (LD_LIBRARY_PATH, ld.so.cache).
// Emulated-device builds (GPUCOLL_CUDA=emulate) replace 2-4 by gpucoll's NCCL stand-in, libnccl-emu.so next to the
// emulator (source "emulator"): NVIDIA's NCCL cannot run on the emulated device.
// Libraries older than NCCL 2.18 are refused with a reason; the search then goes on to the next candidate.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "backends/nccl/nccl_api.h"

namespace gpucoll {

// NCCL_VERSION(2,18,0): ncclCommInitRankConfig, ncclCommFinalize and the config layout of nccl_api.h exist
// from this release on, and older ones are no longer shipped with supported CUDA versions.
constexpr int kNcclMinVersion = 21800;

struct NcclFunctions {
#define GPUCOLL_NCCL_FIELD(name, required) PFN_##name name = nullptr;
  GPUCOLL_NCCL_FUNCTIONS(GPUCOLL_NCCL_FIELD)
#undef GPUCOLL_NCCL_FIELD
};

struct NcclLibrary {
  bool attempted = false;  // false until the first nccl_load()
  bool loaded = false;
  std::string path;            // file that was loaded (as the dynamic loader resolved it)
  std::string source;          // "GPUCOLL_NCCL_LIBRARY", "process", "wheel", "system" or "emulator"
  int version = 0;             // ncclGetVersion code, e.g. 23203
  std::string version_string;  // "2.32.3"
  std::string reason;          // why not loaded; empty when loaded
  // Every attempt in order: (what was opened, error or "" for the one that loaded).
  std::vector<std::pair<std::string, std::string>> tried;
  std::vector<std::string> missing_optional;  // optional entry points this library lacks
  void* handle = nullptr;
  NcclFunctions fn;
};

// Runs the search once and caches the result; thread-safe. A loaded library is final for the life of the
// process (it is never unloaded). A failed search is repeated only when `wheel_candidates` names a path not
// tried before, so installing a wheel and calling again works, while repeated calls stay cheap.
NcclLibrary nccl_load(const std::vector<std::string>& wheel_candidates);

// A copy of the current state without loading anything (attempted == false before the first load).
NcclLibrary nccl_state();

// The loaded library, or nullptr. The object never changes once published: the hot path reads the
// function table through this pointer without a lock.
const NcclLibrary* nccl_loaded();

// The loaded library; throws Error(kUnsupported) with the reason when NCCL is not usable.
const NcclLibrary& nccl_require();

// "2.32.3" from 23203 (and from pre-2.9 codes such as 2708).
std::string nccl_version_string(int code);

// "ncclUnhandledCudaError" etc.
const char* nccl_result_name(ncclResult_t result);

// Checks an NCCL return code. ncclSuccess and ncclInProgress (a non-blocking communicator still working)
// are returned; anything else throws Error(kNccl) whose message holds the call, ncclGetErrorString and
// ncclGetLastError's text. Pass the communicator when there is one (NCCL keeps its last error per thread
// today, but the API takes the comm).
ncclResult_t nccl_check(ncclResult_t result, const char* call, ncclComm_t comm = nullptr, const char* file = nullptr,
                        int line = 0);

// Calls lib.fn.NAME(args...) and checks it, naming NAME and the call site:
//   GPUCOLL_NCCL_CALL(lib, ncclAllReduce, send, recv, n, dt, op, comm, stream);
#define GPUCOLL_NCCL_CALL(lib, name, ...) \
  ::gpucoll::nccl_check((lib).fn.name(__VA_ARGS__), #name, nullptr, __FILE__, __LINE__)

}  // namespace gpucoll
