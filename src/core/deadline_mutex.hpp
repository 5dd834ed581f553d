// SPDX-License-Identifier: Apache-2.0
#pragma once
// A mutex whose lock can wait until a steady-clock deadline, for std::unique_lock's
// try_lock_until. std::timed_mutex does that too, but libstdc++ 12 implements it with
// pthread_mutex_clocklock, which GCC 12's ThreadSanitizer does not intercept: it sees the
// unlock without the lock ("unlock of an unlocked mutex") and none of the order the lock gives.
// This one is a std::mutex and a condition variable, which every sanitizer sees.
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace turnstile::detail {

class DeadlineMutex {
 public:
  void lock() {
    std::unique_lock guard(mutex_);
    freed_.wait(guard, [this] { return !locked_; });
    locked_ = true;
  }

  bool try_lock() {
    std::lock_guard guard(mutex_);
    if (locked_) return false;
    locked_ = true;
    return true;
  }

  template <typename Clock, typename Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock guard(mutex_);
    if (!freed_.wait_until(guard, deadline, [this] { return !locked_; })) return false;
    locked_ = true;
    return true;
  }

  void unlock() {
    {
      std::lock_guard guard(mutex_);
      locked_ = false;
    }
    freed_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable freed_;
  bool locked_ = false;
};

}  // namespace turnstile::detail
