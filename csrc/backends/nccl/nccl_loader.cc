#include "backends/nccl/nccl_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <mutex>
#include <set>

#include "core/config.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll {
namespace {

constexpr const char* kSoname = "libnccl.so.2";
constexpr const char* kEnvVar = "GPUCOLL_NCCL_LIBRARY";

std::mutex g_mu;                                    // guards g_state and g_tried_wheels
NcclLibrary g_state;                                // the last search's outcome
std::set<std::string> g_tried_wheels;               // wheel paths the searches so far have seen
std::atomic<const NcclLibrary*> g_loaded{nullptr};  // published once, never freed

std::string dl_error(const char* fallback) {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string(fallback);
}

// The path the dynamic loader actually mapped (for a bare soname, where it found it).
std::string mapped_path(void* handle, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

// Opens one candidate and fills `lib` when it is usable. On failure returns false with `error` set and
// leaves nothing open.
bool try_library(const std::string& name, int flags, NcclLibrary* lib, std::string* error) {
  dlerror();
  void* handle = dlopen(name.c_str(), flags);
  if (handle == nullptr) {
    // glibc's message for an RTLD_NOLOAD miss ("cannot open shared object file") would read as a failure.
    *error = (flags & RTLD_NOLOAD) != 0 ? std::string("not loaded in this process") : dl_error("dlopen failed");
    return false;
  }
  const std::string path = mapped_path(handle, name);
  NcclFunctions fn;
  fn.ncclGetVersion = reinterpret_cast<PFN_ncclGetVersion>(dlsym(handle, "ncclGetVersion"));
  if (fn.ncclGetVersion == nullptr) {
    *error = path + " has no ncclGetVersion: not an NCCL library";
    dlclose(handle);
    return false;
  }
  int version = 0;
  const ncclResult_t r = fn.ncclGetVersion(&version);
  if (r != ncclSuccess) {
    *error = path + ": ncclGetVersion returned " + nccl_result_name(r);
    dlclose(handle);
    return false;
  }
  // Check the version before the symbols: for an old library "too old" is the useful message, not the name
  // of whichever entry point it happens to lack.
  if (version < kNcclMinVersion) {
    *error = path + " is NCCL " + nccl_version_string(version) + ", older than the minimum supported " +
             nccl_version_string(kNcclMinVersion);
    dlclose(handle);
    return false;
  }
  std::string missing;
  std::vector<std::string> missing_optional;
#define GPUCOLL_NCCL_RESOLVE(name, required)                    \
  fn.name = reinterpret_cast<PFN_##name>(dlsym(handle, #name)); \
  if (fn.name == nullptr) {                                     \
    if (required) {                                             \
      missing += missing.empty() ? #name : ", " #name;          \
    } else {                                                    \
      missing_optional.emplace_back(#name);                     \
    }                                                           \
  }
  GPUCOLL_NCCL_FUNCTIONS(GPUCOLL_NCCL_RESOLVE)
#undef GPUCOLL_NCCL_RESOLVE
  if (!missing.empty()) {
    *error = path + " (NCCL " + nccl_version_string(version) + ") lacks required entry points: " + missing;
    dlclose(handle);
    return false;
  }
  lib->loaded = true;
  lib->handle = handle;
  lib->path = path;
  lib->version = version;
  lib->version_string = nccl_version_string(version);
  lib->missing_optional = std::move(missing_optional);
  lib->fn = fn;
  lib->reason.clear();
  return true;
}

#ifdef GPUCOLL_CUDA_EMULATION
// gpucoll/_emu/libnccl-emu.so, beside the emulated runtime this process loaded (through _C's RPATH); "" if none.
std::string emulated_nccl_path() {
  void* emu = dlopen("libgpucoll_cudaemu.so", RTLD_NOW | RTLD_NOLOAD);
  if (emu == nullptr) return "";
  const std::string path = mapped_path(emu, "");
  dlclose(emu);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1) + "libnccl-emu.so";
}
#endif

NcclLibrary search(const std::vector<std::string>& wheels) {
  NcclLibrary lib;
  lib.attempted = true;
  std::string summary;  // "source name: error; ..." for the reason
  auto attempt = [&](const std::string& name, int flags, const char* source) {
    std::string error;
    const bool ok = try_library(name, flags, &lib, &error);
    lib.tried.emplace_back(name, ok ? std::string() : error);
    if (ok) {
      lib.source = source;
    } else {
      GPUCOLL_DEBUG("NCCL candidate ", name, " (", source, "): ", error);
      summary += (summary.empty() ? "" : "; ") + std::string(source) + " " + name + ": " + error;
    }
    return ok;
  };

  // RTLD_LOCAL: NCCL's symbols must not interpose on a different NCCL that torch may load later.
  constexpr int kFlags = RTLD_NOW | RTLD_LOCAL;
  if (config_is_set(kEnvVar)) {
    const std::string path = config_raw(kEnvVar);
    if (!attempt(path, kFlags, kEnvVar)) {
      lib.reason = std::string(kEnvVar) + "=" + path + " cannot be used: " + lib.tried.back().second +
                   ". gpucoll does not fall back to another NCCL when this variable is set; fix the path or "
                   "unset it to search the process, installed wheels and the system loader.";
    }
    return lib;
  }
#ifdef GPUCOLL_CUDA_EMULATION
  // An emulated device: NVIDIA's NCCL cannot drive it (it runs kernels on a real GPU). The NCCL stand-in built with
  // the emulator (csrc/emulation/nccl/) lies next to it, and is the only NCCL this build finds by itself.
  const std::string stand_in = emulated_nccl_path();
  if (stand_in.empty()) {
    lib.reason = "this is an emulated-device build (GPUCOLL_CUDA=emulate) and its NCCL stand-in was not found: the "
                 "emulator library libgpucoll_cudaemu.so is not loaded. Rebuild, or set " + std::string(kEnvVar);
    return lib;
  }
  if (!attempt(stand_in, kFlags, "emulator")) {
    lib.reason = "this is an emulated-device build (GPUCOLL_CUDA=emulate), and its NCCL stand-in " + stand_in +
                 " cannot be used: " + lib.tried.back().second + ". NVIDIA's NCCL needs a real GPU; rebuild.";
  }
  return lib;
#endif
  if (attempt(kSoname, kFlags | RTLD_NOLOAD, "process")) return lib;
  for (const std::string& w : wheels) {
    if (attempt(w, kFlags, "wheel")) return lib;
  }
  if (wheels.empty()) summary += "; wheel: no nvidia-nccl-cu13/-cu12 wheel found";
  if (attempt(kSoname, kFlags, "system")) return lib;
  lib.reason = "no usable NCCL found (minimum " + nccl_version_string(kNcclMinVersion) + "): " + summary;
  return lib;
}

}  // namespace

std::string nccl_version_string(int code) {
  int major = 0, minor = 0, patch = 0;
  if (code >= 10000) {
    major = code / 10000;
    minor = (code % 10000) / 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = (code % 1000) / 100;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

const char* nccl_result_name(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    case ncclTimeout:
      return "ncclTimeout";
    case ncclNumResults:
      break;
  }
  return "ncclResult(unknown)";
}

NcclLibrary nccl_load(const std::vector<std::string>& wheel_candidates) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_state.loaded) return g_state;
  if (g_state.attempted) {
    // An explicit GPUCOLL_NCCL_LIBRARY failure stays the answer; otherwise search again only for news.
    bool news = false;
    if (!config_is_set(kEnvVar)) {
      for (const std::string& w : wheel_candidates) news = news || g_tried_wheels.count(w) == 0;
    }
    if (!news) return g_state;
  }
  g_tried_wheels.insert(wheel_candidates.begin(), wheel_candidates.end());
  NcclLibrary lib = search(wheel_candidates);
  if (lib.loaded) {
    if (lib.source == "emulator") {
      GPUCOLL_INFO("loaded gpucoll's NCCL stand-in for the emulated CUDA device (not NVIDIA's NCCL; it reports NCCL ",
                   lib.version_string, ") from ", lib.path);
    } else {
      GPUCOLL_INFO("loaded NCCL ", lib.version_string, " from ", lib.path, " (", lib.source, ")");
    }
    // Leaked on purpose: the function table must outlive every communicator, including ones destroyed from
    // atexit handlers, and unloading NCCL with CUDA state alive is unsafe anyway.
    g_loaded.store(new NcclLibrary(lib), std::memory_order_release);
  } else {
    GPUCOLL_INFO("NCCL not loaded: ", lib.reason);
  }
  g_state = std::move(lib);
  return g_state;
}

NcclLibrary nccl_state() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_state.attempted) {
    NcclLibrary lib;
    lib.reason = "NCCL has not been loaded yet (gpucoll._nccl.load() loads it)";
    return lib;
  }
  return g_state;
}

const NcclLibrary* nccl_loaded() { return g_loaded.load(std::memory_order_acquire); }

const NcclLibrary& nccl_require() {
  const NcclLibrary* lib = nccl_loaded();
  if (lib != nullptr) return *lib;
  const NcclLibrary state = nccl_state();
  GPUCOLL_THROW(ErrorCode::kUnsupported, "dlopen(libnccl.so.2)", "NCCL is not available: ", state.reason,
                ". Install it with `pip install nvidia-nccl-cu13` (or 'gpucoll[cu13]'; -cu12 for CUDA 12 drivers), "
                "or point GPUCOLL_NCCL_LIBRARY at libnccl.so.2.");
}

ncclResult_t nccl_check(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) return result;
  std::string msg = std::string(call) + " failed: " + nccl_result_name(result);
  const NcclLibrary* lib = nccl_loaded();
  if (lib != nullptr) {
    const char* text = lib->fn.ncclGetErrorString(result);
    if (text != nullptr && text[0] != '\0') msg += std::string(" (") + text + ")";
    const char* last = lib->fn.ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') msg += std::string("; NCCL's last error: ") + last;
  }
  if (msg.find("NCCL_DEBUG") == std::string::npos) msg += "; NCCL_DEBUG=WARN (or INFO) prints NCCL's own log";
  throw Error(ErrorCode::kNccl, msg, call, file != nullptr ? file : __FILE__, file != nullptr ? line : __LINE__);
}

}  // namespace gpucoll
