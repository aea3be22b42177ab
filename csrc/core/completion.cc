#include "core/completion.h"

#include <utility>

namespace gpucoll {

void Completion::complete(std::exception_ptr error) {
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
    run.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& fn : run) fn();
}

bool Completion::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::exception_ptr Completion::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Completion::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

void Completion::on_done(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

}  // namespace gpucoll
