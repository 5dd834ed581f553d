// Semaphore: a counting semaphore whose leases belong to their holder and vanish with it
// (Curator InterProcessSemaphoreV2, Consul semaphore), served in arrival order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>

#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"

namespace turnstile {

namespace detail {
class ClientState;
class HoldRecord;
}  // namespace detail

// n leases of one Semaphore, held until release() or destruction. Movable, not copyable;
// may be released from any thread.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;  // releases what this lease held first
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  // Releases; failures go to the client's error handler and are retried in the background.
  ~Lease();

  bool held() const noexcept { return record_ != nullptr; }
  explicit operator bool() const noexcept { return held(); }
  const std::string& name() const;      // throws NotHeld when empty
  std::int64_t permits() const;         // throws NotHeld when empty
  std::uint64_t fencing_token() const;  // throws NotHeld when empty
  std::stop_token lost_token() const;   // throws NotHeld when empty
  HoldState hold_state() const;         // throws NotHeld when empty
  // Releases now and reports: NotHeld (empty or already released), BackendUnavailable
  // (the release is still retried in the background), HoldLost.
  void release();

  explicit Lease(std::shared_ptr<detail::HoldRecord> record);

 private:
  std::shared_ptr<detail::HoldRecord> record_;
};

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
