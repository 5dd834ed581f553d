// SPDX-License-Identifier: Apache-2.0
// PermitCounter: Redisson RSemaphore semantics. Permits are a number, not owned: anyone may
// release, nothing returns them when a process dies. Waiters are served in arrival order and
// wake when permits are added.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>

#include "turnstile/async.hpp"
#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"

namespace turnstile {

namespace detail {
class ClientState;
}

class PermitCounter {
 public:
  // Sets the count to n only if it was never set. Throws InvalidArgument when n < 0 or n > max_permits.
  bool try_set_permits(std::int64_t n);
  // Adds n (which may be negative) to the count, unset counting as 0; returns the new count.
  // Throws InvalidArgument, changing nothing, when |n| > max_permits or the count would leave
  // [-max_permits, max_permits].
  std::int64_t add_permits(std::int64_t n);
  std::int64_t available_permits();
  // Sets the count to 0 and returns the count it had (0 when never set), as Redisson does.
  std::int64_t drain_permits();

  // Takes n permits, waiting for them. Throws InvalidArgument when n <= 0 or n > max_permits.
  void acquire(std::int64_t n = 1) { acquire_until(std::nullopt, n); }
  bool try_acquire(std::int64_t n = 1) { return acquire_until(SteadyClock::now(), n); }
  template <class Rep, class Period>
  bool try_acquire_for(const std::chrono::duration<Rep, Period>& timeout, std::int64_t n = 1) {
    return acquire_until(detail::deadline_after(timeout), n);
  }
  template <class Clock, class Duration>
  bool try_acquire_until(const std::chrono::time_point<Clock, Duration>& when, std::int64_t n = 1) {
    return acquire_until(detail::deadline_at(when), n);
  }
  // Waits for n permits, or until `stop` is requested (false, after leaving the line).
  bool acquire(std::int64_t n, std::stop_token stop) { return acquire_until(std::nullopt, n, std::move(stop)); }
  template <class Rep, class Period>
  bool try_acquire_for(const std::chrono::duration<Rep, Period>& timeout, std::int64_t n, std::stop_token stop) {
    return acquire_until(detail::deadline_after(timeout), n, std::move(stop));
  }
  // Waits for n permits without a thread (turnstile/async.hpp): the Acquiring ends with true
  // (taken), or false at the options' deadline or stop or on cancel(), after leaving the line
  // (permits taken just as it was cancelled are returned). Throws InvalidArgument at once.
  Acquiring<bool> acquire_async(std::int64_t n = 1, AsyncOptions options = {});
  // Returns n permits (no ownership check, as in Redisson). Throws InvalidArgument when n <= 0, n > max_permits
  // or the count would exceed max_permits.
  void release(std::int64_t n = 1);

  const std::string& name() const { return name_; }

  // A Lockable view taking n permits in lock() and returning them in unlock(). The view
  // remembers whether it holds, so unlock() without lock() returns nothing.
  class Lockable;
  Lockable lockable(std::int64_t n = 1) const;

 private:
  friend class Client;  // made by Client::permit_counter()
  PermitCounter(std::shared_ptr<detail::ClientState> client, std::string name);

  bool acquire_until(Deadline deadline, std::int64_t n, std::stop_token stop = {});

  std::shared_ptr<detail::ClientState> client_;
  std::string name_;
};

class PermitCounter::Lockable {
 public:
  // Each throws WouldDeadlock when this view already holds its permits (locking it again
  // would take n more that one unlock() could never return), else as PermitCounter's.
  void lock() {
    require_free();
    owner_.acquire(n_);
    held_ = true;
  }
  bool try_lock() {
    require_free();
    return held_ = owner_.try_acquire(n_);
  }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout) {
    require_free();
    return held_ = owner_.try_acquire_for(timeout, n_);
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& when) {
    require_free();
    return held_ = owner_.try_acquire_until(when, n_);
  }
  void unlock() noexcept;

 private:
  friend class PermitCounter;
  Lockable(PermitCounter owner, std::int64_t n) : owner_(std::move(owner)), n_(n) {}
  void require_free() const;
  PermitCounter owner_;
  std::int64_t n_;
  bool held_ = false;
};

}  // namespace turnstile
