// A host communicator's asynchronous operations (async_op=True) run in call order on one thread of the
// communicator's own, so that the caller goes on meanwhile: what DDP's backward needs to compute the next bucket's
// gradients while a bucket is reduced (gloo runs its collectives on threads of its own for the same reason).
//
// Order. A communicator's operations run in the order they were called, whichever thread called them and whether
// or not they were asynchronous: the call check compares calls by their place in that order on every rank, so
// any reordering is a mismatch at best. Synchronous operations therefore drain() first; an operation called from
// the progress thread itself (a completion callback) runs at once, after the task that ran the callback. drain()
// costs one atomic load when nothing is queued, the common case of a job that never goes asynchronous.
//
// The thread starts with the first task and sleeps on a condition variable between tasks. Each task's Completion
// ends after the task, with what it threw; its callbacks run on this thread (the Python binding's take the GIL).
//
// Exit. A task stuck on a dead peer holds its thread until the communicator's timeout. stop() waits for the queue
// to run out; stop_for() gives up after a while (at interpreter exit the Python binding cannot wait for the whole
// timeout), and the thread is then left running, detached: abandoned() is true, and the owner must not free what
// the thread still uses.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "core/completion.h"

namespace gpucoll::host {

class Progress {
 public:
  Progress() = default;
  ~Progress() { stop(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Queues `task` behind every task queued before it. Raises InvalidUsage once stopped.
  std::shared_ptr<Completion> submit(std::function<void()> task);
  // Returns once every task queued so far has run (at once on the progress thread, or when nothing is queued).
  void drain();
  bool idle() const { return !s_->busy.load(std::memory_order_acquire); }
  bool on_thread() const { return std::this_thread::get_id() == s_->thread_id.load(std::memory_order_acquire); }
  // Runs what is queued, then ends the thread. Never throws. From the progress thread itself (a callback that
  // drops the last reference to the communicator) it only stops taking tasks: the thread cannot join itself, and
  // ends after the current one.
  void stop() noexcept { stop_for(-1.0); }
  // stop() giving up after `seconds` (< 0: never); false when it did, and the thread was left running.
  bool stop_for(double seconds) noexcept;
  bool abandoned() const { return s_->abandoned.load(std::memory_order_acquire); }

 private:
  // Shared with the thread, which may outlive this object (stopped from the thread itself, or abandoned).
  struct State {
    std::mutex mu;
    std::condition_variable work_cv;  // a task was queued, or stop
    std::condition_variable idle_cv;  // the queue ran out
    std::deque<std::pair<std::function<void()>, std::shared_ptr<Completion>>> queue;
    bool running = false;  // a task is being run (the queue may be empty meanwhile)
    bool stopping = false;
    // Release when the queue ran out, acquire in drain()/idle(): a synchronous operation that finds it false sees
    // everything the tasks before it wrote (the communicator's counters, its buffers' results).
    std::atomic<bool> busy{false};
    std::atomic<bool> abandoned{false};
    std::atomic<std::thread::id> thread_id{};
  };
  static void main(const std::shared_ptr<State>& s);

  std::shared_ptr<State> s_ = std::make_shared<State>();
  std::thread thread_;
};

}  // namespace gpucoll::host
