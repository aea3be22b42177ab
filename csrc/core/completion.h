// The two ends an operation's Work (gpucoll._C.Work, python/work.cc) reads. Completion: an operation that runs on
// another thread than its caller's (the host backend's progress thread). DeviceDone: one that runs on a GPU (the
// NCCL communicator's operation, the custom kernels' call), known from an event recorded after it.
//
// The thread that runs the operation calls complete() once, with the error it raised or none. Waiters block on a
// condition variable, not a spin: an asynchronous operation is one the caller chose not to wait for, so whoever
// waits later has nothing better to do with the core than give it to the operation. Callbacks registered before
// completion run on the completing thread, in order, after the state is published (a callback that waits on the
// same Completion returns at once); one registered after runs at once on the registering thread. A callback must
// not throw.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace gpucoll {

class Completion {
 public:
  // Publishes the end (at most once; later calls are ignored), then runs the callbacks registered so far.
  void complete(std::exception_ptr error = nullptr);
  bool done() const;
  // The error the operation raised, or nullptr (also while it runs).
  std::exception_ptr error() const;
  // Blocks until complete(); rethrows the operation's error.
  void wait() const;
  void on_done(std::function<void()> fn);

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<std::function<void()>> callbacks_;
};

// The device side of an operation's end. Called without the GIL. An operation captured into a CUDA graph has no
// eager end: it reports done, and a wait on it does nothing.
class DeviceDone {
 public:
  virtual ~DeviceDone() = default;
  virtual bool query() = 0;                    // whether the GPU finished it (never blocks)
  virtual void wait_on(uintptr_t stream) = 0;  // `stream` (a cudaStream_t) waits for it; the host does not block
  virtual void synchronize() = 0;              // blocks the calling thread until the GPU finished it
  virtual bool has_seq() const { return false; }
  virtual uint64_t seq() const { return 0; }
  virtual std::string describe() = 0;  // what it is and where it stands, for repr()
};

}  // namespace gpucoll
