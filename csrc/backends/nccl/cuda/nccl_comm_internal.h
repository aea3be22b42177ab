// Helpers shared by nccl_comm.cc (operations), nccl_split.cc (new communicators from one) and nccl_watchdog.cc
// (progress, abort, teardown).
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include "device/cuda/cuda_util.h"
#include "core/error.h"

namespace gpucoll::nccl::detail {

// After a short spin, polls back off from 10 us to 1 ms: connection setup takes milliseconds, and a tighter loop
// would only take the core from NCCL's own proxy thread.
inline void backoff(int* sleep_us) {
  std::this_thread::sleep_for(std::chrono::microseconds(*sleep_us));
  *sleep_us = std::min(*sleep_us * 2, 1000);
}

// Teardown paths must not throw: without the guard NCCL and the runtime still do their work (NCCL switches to
// the communicator's device itself), only from whatever device the thread has.
inline void guard_quietly(std::optional<cuda::DeviceGuard>* guard, int device) noexcept {
  try {
    guard->emplace(device);
  } catch (...) {
    guard->reset();
  }
}

// Re-raises an Error with the operation it happened in prepended, keeping its code and call.
[[noreturn]] inline void rethrow_with(const Error& e, const std::string& what, const char* file, int line) {
  throw Error(e.code(), what + ": " + e.message(), e.call(), file, line, e.ranks());
}

}  // namespace gpucoll::nccl::detail
