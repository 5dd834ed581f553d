// SPDX-License-Identifier: Apache-2.0
// MultiLock: all-or-nothing over any mix of lockables (Curator InterProcessMultiLock).
// Acquires in the given order; when it cannot take them all it releases what it took in
// reverse order; unlock() releases in reverse order.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "turnstile/async.hpp"
#include "turnstile/deadline.hpp"
#include "turnstile/lease.hpp"

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
  // Takes every member without a thread (turnstile/async.hpp), in order, all or nothing: the
  // Acquiring ends true once all are held (they then belong to this MultiLock, not to a thread:
  // any thread may unlock() it), or false at the options' deadline or stop or on cancel(), or
  // with a member's error, after releasing what it took in reverse order. The members must have
  // an async form whose hold is a Lease (Mutex, RecursiveMutex, SharedMutex, SharedMutex::Reader,
  // Semaphore::Lockable): else, or while this MultiLock holds through lock_async already, it
  // throws InvalidArgument at once. The MultiLock must outlive the acquire.
  Acquiring<bool> lock_async(AsyncOptions options = {});
  // Releases what lock() or lock_async() took, in reverse order.
  void unlock() noexcept;

  // A member's async acquire: `done(lease, error)` is told once (an empty Lease: not acquired).
  using AsyncDone = std::function<void(Lease, std::exception_ptr)>;
  using AsyncStart = std::function<void(const AsyncOptions&, AsyncDone)>;

 private:
  struct Member {
    std::function<bool(Deadline)> acquire;
    std::function<void()> unlock;
    AsyncStart acquire_async;  // empty: the member has no async form
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
                  [&lockable] { lockable.unlock(); }, erase_async(lockable)};
  }
  template <class L>
  static AsyncStart erase_async(L& lockable) {
    if constexpr (requires { lockable.lock_async(AsyncOptions{}); }) {
      if constexpr (std::is_same_v<decltype(lockable.lock_async(AsyncOptions{})), Acquiring<std::optional<Lease>>>) {
        return [&lockable](const AsyncOptions& options, AsyncDone done) {
          // Throws at once what lock_async throws at once (WouldDeadlock): the caller catches it.
          std::move(lockable.lock_async(options)).then([done = std::move(done)](auto ended) {
            std::exception_ptr failure;
            try {
              auto lease = ended.get();
              return done(lease ? std::move(*lease) : Lease(), nullptr);
            } catch (...) {
              failure = std::current_exception();
            }
            // Outside the handler: the thread that finally takes the error holds its last reference.
            done(Lease(), std::move(failure));
          });
        };
      }
    }
    return {};
  }
  bool acquire_until(Deadline deadline);

  std::vector<Member> members_;
  // What lock_async() took: released by unlock().
  std::shared_ptr<std::mutex> async_mutex_ = std::make_shared<std::mutex>();
  std::shared_ptr<std::vector<Lease>> async_held_ = std::make_shared<std::vector<Lease>>();
};

}  // namespace turnstile
