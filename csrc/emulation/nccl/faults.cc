// Fault injection, for tests of what gpucoll does when NCCL misbehaves. One fault at a time per process, given by
// NCCL_EMU_FAULT (read when the library loads) or by ncclEmuInjectFault (which replaces it), in the same syntax:
//
//   init_hang[:rank=R]             this process's rank R never arrives at its next communicator init: it never
//                                  contacts the bootstrap root, so every rank's init stays ncclInProgress until aborted
//   hang:op=N[:rank=R]             the Nth operation launched from now on (groups count once per communicator) never
//                                  arrives: it waits, without touching the channels, until the communicator is aborted
//   error:op=N[:rank=R][:code=C]   the Nth operation sets the asynchronous error C (an ncclResult_t, default 6,
//                                  ncclRemoteError) with a text saying it was injected, then waits for the abort, as a
//                                  kernel whose peer's network failed
//   none                           clears the fault
//
// rank=R limits the fault to communicators in which this process has rank R (spawned ranks inherit one environment).
// A fault fires once.
#include <cstdlib>
#include <mutex>
#include <string>

#include "nccl_emu.h"

namespace ncclemu {
namespace {

std::mutex g_mu;
Fault g_fault;
int g_launches = 0;  // operations launched since the fault was set (matching its rank)
bool g_loaded = false;

bool parse(const std::string& spec, Fault* out, std::string* error) {
  Fault f;
  size_t pos = 0;
  bool first = true;
  while (pos <= spec.size()) {
    const size_t end = spec.find(':', pos);
    const std::string part = spec.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? spec.size() + 1 : end + 1;
    if (first) {
      first = false;
      if (part == "init_hang") {
        f.kind = Fault::kInitHang;
      } else if (part == "hang") {
        f.kind = Fault::kHang;
      } else if (part == "error") {
        f.kind = Fault::kError;
      } else if (part == "none" || part.empty()) {
        f.kind = Fault::kNone;
      } else {
        *error = "unknown fault kind '" + part + "' (init_hang, hang, error or none)";
        return false;
      }
      continue;
    }
    const size_t eq = part.find('=');
    char* tail = nullptr;
    const long v = eq == std::string::npos ? 0 : std::strtol(part.c_str() + eq + 1, &tail, 10);
    if (eq == std::string::npos || tail == nullptr || *tail != '\0') {
      *error = "bad fault parameter '" + part + "' (op=N, rank=R or code=C)";
      return false;
    }
    const std::string key = part.substr(0, eq);
    if (key == "op" && v >= 1) {
      f.op = static_cast<int>(v);
    } else if (key == "rank" && v >= 0) {
      f.rank = static_cast<int>(v);
    } else if (key == "code" && v > 0 && v < gpucoll::ncclNumResults && v != gpucoll::ncclInProgress) {
      f.code = static_cast<ncclResult_t>(v);
    } else {
      *error = "bad fault parameter '" + part + "'";
      return false;
    }
  }
  if ((f.kind == Fault::kHang || f.kind == Fault::kError) && f.op < 1) {
    *error = "the fault needs op=N (N >= 1)";
    return false;
  }
  *out = f;
  return true;
}

void load_env_locked() {
  if (g_loaded) return;
  g_loaded = true;
  const char* env = std::getenv("NCCL_EMU_FAULT");
  if (env == nullptr || env[0] == '\0') return;
  std::string error;
  if (!parse(env, &g_fault, &error)) warn(gpucoll::ncclInvalidArgument, "NCCL_EMU_FAULT=" + std::string(env) + ": " + error);
}

}  // namespace

bool fault_at_init(int rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  load_env_locked();
  if (g_fault.kind != Fault::kInitHang || (g_fault.rank >= 0 && g_fault.rank != rank)) return false;
  g_fault = Fault{};
  return true;
}

Fault::Kind fault_at_launch(int rank, ncclResult_t* code, int* op) {
  std::lock_guard<std::mutex> lock(g_mu);
  load_env_locked();
  if (g_fault.kind != Fault::kHang && g_fault.kind != Fault::kError) return Fault::kNone;
  if (g_fault.rank >= 0 && g_fault.rank != rank) return Fault::kNone;
  if (++g_launches < g_fault.op) return Fault::kNone;
  const Fault f = g_fault;
  g_fault = Fault{};
  *code = f.code;
  *op = f.op;
  return f.kind;
}

}  // namespace ncclemu

// Sets the process's fault (syntax above; "none" clears it). ncclSuccess, or ncclInvalidArgument for a bad spec.
NCCLEMU_API gpucoll::ncclResult_t ncclEmuInjectFault(const char* spec) {
  using namespace ncclemu;
  std::string error;
  Fault f;
  if (spec == nullptr || !parse(spec, &f, &error)) {
    return warn(gpucoll::ncclInvalidArgument, "ncclEmuInjectFault: " + (spec == nullptr ? std::string("NULL spec") : error));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_loaded = true;  // an explicit fault replaces NCCL_EMU_FAULT
  g_fault = f;
  g_launches = 0;
  return gpucoll::ncclSuccess;
}
