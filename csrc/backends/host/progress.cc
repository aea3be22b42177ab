#include "backends/host/progress.h"

#include <chrono>

#include "core/error.h"

namespace gpucoll::host {

std::shared_ptr<Completion> Progress::submit(std::function<void()> task) {
  auto done = std::make_shared<Completion>();
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->stopping) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "async_op", "async_op=True on a closed communicator");
    s_->queue.emplace_back(std::move(task), done);
    s_->busy.store(true, std::memory_order_relaxed);  // the lock orders it before main() clears it
    if (!thread_.joinable()) {
      thread_ = std::thread([s = s_] { main(s); });
      s_->thread_id.store(thread_.get_id(), std::memory_order_release);
    }
  }
  s_->work_cv.notify_one();
  return done;
}

void Progress::drain() {
  if (!s_->busy.load(std::memory_order_acquire) || on_thread()) return;
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->idle_cv.wait(lock, [this] { return s_->queue.empty() && !s_->running; });
}

bool Progress::stop_for(double seconds) noexcept {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->stopping = true;
  s_->work_cv.notify_one();
  if (!thread_.joinable()) return true;
  if (on_thread()) {
    thread_.detach();  // it ends by itself after the task that called this
    return true;
  }
  if (seconds >= 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    if (!s_->idle_cv.wait_until(lock, until, [this] { return s_->queue.empty() && !s_->running; })) {
      s_->abandoned.store(true, std::memory_order_release);
      thread_.detach();
      return false;
    }
  }
  lock.unlock();
  thread_.join();
  return true;
}

void Progress::main(const std::shared_ptr<State>& s) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->work_cv.wait(lock, [&s] { return !s->queue.empty() || s->stopping; });
    if (s->queue.empty()) return;  // stopping, and nothing left
    auto [task, done] = std::move(s->queue.front());
    s->queue.pop_front();
    s->running = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    task = nullptr;  // what it holds goes before the waiters hear of the end
    done->complete(error);
    done.reset();
    lock.lock();
    s->running = false;
    if (s->queue.empty()) {
      s->busy.store(false, std::memory_order_release);
      s->idle_cv.notify_all();
    }
  }
}

}  // namespace gpucoll::host
