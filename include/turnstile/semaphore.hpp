// SPDX-License-Identifier: Apache-2.0
// Semaphore: a counting semaphore whose leases belong to their holder and vanish with it
// (Curator InterProcessSemaphoreV2, Consul semaphore), served in arrival order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>

#include "turnstile/async.hpp"
#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"
#include "turnstile/lease.hpp"

namespace turnstile {

namespace detail {
class ClientState;
}  // namespace detail

class Semaphore {
 public:
  // All of these throw InvalidArgument when n <= 0 or n > limit(), LimitMismatch when the
  // name is queued with another limit, KindMismatch when the name is in use as a lock,
  // BackendUnavailable, QueueFull.
  Lease acquire(std::int64_t n = 1) { return *acquire_until(std::nullopt, n); }
  std::optional<Lease> try_acquire(std::int64_t n = 1) { return acquire_until(SteadyClock::now(), n); }
  // Also InvalidArgument on a negative timeout.
  template <class Rep, class Period>
  std::optional<Lease> try_acquire_for(const std::chrono::duration<Rep, Period>& timeout, std::int64_t n = 1) {
    return acquire_until(detail::deadline_after(timeout), n);
  }
  template <class Clock, class Duration>
  std::optional<Lease> try_acquire_until(const std::chrono::time_point<Clock, Duration>& when, std::int64_t n = 1) {
    return acquire_until(detail::deadline_at(when), n);
  }
  // Waits until admitted, or until `stop` is requested (nullopt, after leaving the queue).
  std::optional<Lease> acquire(std::int64_t n, std::stop_token stop) {
    return acquire_until(std::nullopt, n, std::move(stop));
  }
  template <class Rep, class Period>
  std::optional<Lease> try_acquire_for(const std::chrono::duration<Rep, Period>& timeout, std::int64_t n,
                                       std::stop_token stop) {
    return acquire_until(detail::deadline_after(timeout), n, std::move(stop));
  }

  // Waits for n leases without a thread (turnstile/async.hpp): the Acquiring ends with the Lease,
  // or nullopt at the options' deadline or stop or on cancel(), after leaving the queue. Throws
  // InvalidArgument at once; the other errors above end the Acquiring (its get() rethrows).
  Acquiring<std::optional<Lease>> acquire_async(std::int64_t n = 1, AsyncOptions options = {});

  const std::string& name() const { return name_; }
  std::int64_t limit() const { return limit_; }

  // A Lockable view holding n leases between lock() and unlock(): for MultiLock and guards.
  // One view holds at most one set of leases at a time; it must outlive its use.
  class Lockable;
  Lockable lockable(std::int64_t n = 1) const;

 private:
  friend class Client;  // made by Client::semaphore()
  Semaphore(std::shared_ptr<detail::ClientState> client, std::string name, std::int64_t limit);

  std::optional<Lease> acquire_until(Deadline deadline, std::int64_t n, std::stop_token stop = {});
  void require_count(std::int64_t n) const;

  std::shared_ptr<detail::ClientState> client_;
  std::string name_;
  std::int64_t limit_;
};

class Semaphore::Lockable {
 public:
  void lock() { lease_ = owner_.acquire(n_); }
  bool try_lock() { return adopt(owner_.try_acquire(n_)); }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout) {
    return adopt(owner_.try_acquire_for(timeout, n_));
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& when) {
    return adopt(owner_.try_acquire_until(when, n_));
  }
  void unlock() noexcept { lease_ = Lease(); }
  const Lease& lease() const { return lease_; }
  // acquire_async(n): the Lease comes with the Acquiring, not into this view (for MultiLock).
  Acquiring<std::optional<Lease>> lock_async(AsyncOptions options = {}) {
    return owner_.acquire_async(n_, std::move(options));
  }

 private:
  friend class Semaphore;
  Lockable(Semaphore owner, std::int64_t n) : owner_(std::move(owner)), n_(n) {}
  bool adopt(std::optional<Lease> lease) {
    if (!lease) return false;
    lease_ = std::move(*lease);
    return true;
  }
  Semaphore owner_;
  std::int64_t n_;
  Lease lease_;
};

}  // namespace turnstile
