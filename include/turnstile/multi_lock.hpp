// MultiLock: all-or-nothing over any mix of lockables (Curator InterProcessMultiLock).
// Acquires in the given order; when it cannot take them all it releases what it took in
// reverse order; unlock() releases in reverse order.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "turnstile/deadline.hpp"

namespace turnstile {

class MultiLock {
 public:
  // Each argument must offer lock(), try_lock_until(steady time point) and unlock() and
  // outlive the MultiLock: Mutex, RecursiveMutex, SharedMutex, SharedMutex::Reader,
  // Semaphore::Lockable, PermitCounter::Lockable, another MultiLock, or a std::timed_mutex.
  template <class... Lockables>
  explicit MultiLock(Lockables&... lockables) {
    (members_.push_back(erase(lockables)), ...);
  }

  // Throws whatever a member throws, after releasing the members already taken.
  void lock() { acquire_until(std::nullopt); }
  bool try_lock() { return acquire_until(SteadyClock::now()); }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout) {
    return acquire_until(detail::deadline_after(timeout));
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& when) {
    return acquire_until(detail::deadline_at(when));
  }
  void unlock() noexcept;

 private:
  struct Member {
    std::function<bool(Deadline)> acquire;
    std::function<void()> unlock;
  };
  template <class L>
  static Member erase(L& lockable) {
    return Member{[&lockable](Deadline deadline) {
                    if (!deadline) {
                      lockable.lock();
                      return true;
                    }
                    return static_cast<bool>(lockable.try_lock_until(*deadline));
                  },
                  [&lockable] { lockable.unlock(); }};
  }
  bool acquire_until(Deadline deadline);

  std::vector<Member> members_;
};

}  // namespace turnstile
