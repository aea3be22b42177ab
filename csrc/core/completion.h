// The end of one operation that runs on another thread than its caller's: the one state a Work reads, whichever
// backend ran it (the host backend's progress thread today).
//
// The thread that runs the operation calls complete() once, with the error it raised or none. Waiters block on a
// condition variable, not a spin: an asynchronous operation is one the caller chose not to wait for, so whoever
// waits later has nothing better to do with the core than give it to the operation. Callbacks registered before
// completion run on the completing thread, in order, after the state is published (a callback that waits on the
// same Completion returns at once); one registered after runs at once on the registering thread. A callback must
// not throw.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
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

}  // namespace gpucoll
