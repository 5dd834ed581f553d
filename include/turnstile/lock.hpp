// SPDX-License-Identifier: Apache-2.0
// Mutex, RecursiveMutex and SharedMutex: the C++ Lockable / TimedLockable / SharedTimedLockable
// requirements over a backend queue, so std::lock_guard, std::unique_lock, std::scoped_lock and
// std::shared_lock work unchanged.
//
// Holds belong to the calling thread. All three kinds on one name share one queue: a Mutex
// excludes a RecursiveMutex and a SharedMutex writer of the same name, and readers of it.
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
class ThreadHolds;
class AsyncHolds;
// Which lock type (or Semaphore) asks: defined in the library (src/core/queue.hpp).
enum class Primitive : std::uint8_t;

// What the three lock types share: the exclusive side of the C++ lock requirements, and the
// calling thread's view of its hold.
class LockHandle {
 public:
  // Blocks until held. Throws WouldDeadlock when the calling thread already holds the name and
  // the type is not reentrant (Mutex), or holds only the read lock of it (SharedMutex: upgrades
  // are not supported); BackendUnavailable; HoldLost (a reentrant acquire on a hold that may
  // have been lost).
  void lock() { acquire_exclusive(std::nullopt); }
  // One attempt, no waiting. Same errors as lock(), except that where lock() would throw
  // WouldDeadlock (this thread already holds the name, through this handle or another) it
  // returns false: a try cannot deadlock, and the name is busy (as pthread's error-checking
  // mutex answers trylock with EBUSY). So does try_lock_for() with a zero timeout.
  bool try_lock() { return acquire_exclusive(SteadyClock::now()); }
  // Throws InvalidArgument on a negative timeout, else as lock().
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout) {
    return acquire_exclusive(detail::deadline_after(timeout));
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& when) {
    return acquire_exclusive(detail::deadline_at(when));
  }
  // Waits until held (true), or until `stop` is requested (false, after the waiter has left
  // the queue: a signal handler or a shutting-down service can give up a wait cleanly).
  bool lock(std::stop_token stop) { return acquire_exclusive(std::nullopt, std::move(stop)); }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout, std::stop_token stop) {
    return acquire_exclusive(detail::deadline_after(timeout), std::move(stop));
  }
  // Never throws (guards call it from destructors): misuse and release failures go to the
  // client's error handler, and a failed release is retried in the background. A reentrant
  // hold is released on the server when its count drops to zero.
  void unlock() noexcept { unlock_exclusive(); }
  // unlock() that reports: NotHeld, BackendUnavailable (retried in the background), HoldLost
  // (the hold may have been lost while held; also when its release failed after that). Inside
  // a std::lock_guard or unique_lock, the guard's own unlock() that follows does nothing.
  void release() { release_exclusive(); }
  // Gives the hold up now but leaves the name held for `keep_for` more (ShedLock's
  // lockAtLeastFor: a job that must run once per period across hosts): the entry stays in the
  // queue, waiters keep waiting, and it ends on its own then, even when this process has exited.
  // Measured by the server's clock where the engine has one (see docs/guide.md for each
  // backend's precision). Applies when the release would leave the queue (a reentrant count
  // dropping to zero). Throws as release(); InvalidArgument where the backend cannot keep a hold
  // (then released at once); BackendUnavailable when the server could not be reached (then
  // released plainly in the background: the name may be free sooner).
  void release_after(std::chrono::milliseconds keep_for) { release_exclusive(keep_for); }

  // Waits for the lock without a thread (turnstile/async.hpp): the Acquiring ends with a Lease
  // that owns the hold (not a thread: any thread may release it, and owns_lock() and the other
  // calling-thread queries below do not see it), or nullopt at the options' deadline or stop or
  // on cancel(), after leaving the queue. Errors as lock(), through the Acquiring's get().
  Acquiring<std::optional<Lease>> lock_async(AsyncOptions options = {}) {
    return acquire_async(/*shared=*/false, std::move(options));
  }

  const std::string& name() const;
  // Whether the calling thread holds the lock exclusively.
  bool owns_lock() const;
  // The fencing token of the calling thread's hold (exclusive, else shared): strictly greater
  // than every earlier holder's of this name. Throws NotHeld.
  std::uint64_t fencing_token() const;
  // Text naming exactly this hold's entry on the server, for Client::release_receipt() in
  // another process (e.g. one that outlives a holder killed with SIGKILL). It may contain the
  // name but no credentials. "" on file://, where a hold ends with its process. Throws NotHeld.
  std::string release_receipt() const;
  // Signalled when the calling thread's hold may have been lost. Throws NotHeld.
  std::stop_token lost_token() const;
  // Whether the calling thread's hold is confirmed, suspended or lost. Throws NotHeld.
  // owns_lock() stays true while suspended: the hold is still this thread's to release.
  HoldState hold_state() const;

 protected:
  LockHandle(std::shared_ptr<ThreadHolds> holds, Primitive primitive);
  bool acquire_exclusive(Deadline deadline, std::stop_token stop = {});
  void release_exclusive(std::optional<std::chrono::milliseconds> keep_for = std::nullopt);
  void unlock_exclusive() noexcept;
  bool acquire_shared(Deadline deadline, std::stop_token stop = {});
  void release_shared_hold(std::optional<std::chrono::milliseconds> keep_for = std::nullopt);
  void unlock_shared_noexcept() noexcept;
  Acquiring<std::optional<Lease>> acquire_async(bool shared, AsyncOptions options);
  bool owns_shared_lock() const;

 private:
  std::shared_ptr<ThreadHolds> holds_;
  Primitive primitive_;
  std::shared_ptr<AsyncHolds> async_holds_;  // this object's (and its copies') async holds
};
}  // namespace detail

// Not reentrant (Curator InterProcessSemaphoreMutex, Consul lock): lock(), try_lock(),
// try_lock_for(), try_lock_until(), unlock() and release() as in detail::LockHandle.
class Mutex : public detail::LockHandle {
 private:
  friend class Client;
  using LockHandle::LockHandle;
};

// Reentrant per thread with a hold count (Curator InterProcessMutex, Redisson RLock): the
// members of detail::LockHandle; unlock() releases the backend hold when the count drops to zero.
class RecursiveMutex : public detail::LockHandle {
 private:
  friend class Client;
  using LockHandle::LockHandle;
};

// Readers/writer, reentrant on both sides (Curator InterProcessReadWriteLock). A writer may
// also take the read lock and then drop the write lock (downgrade); a thread holding only the
// read lock that asks for the write lock gets WouldDeadlock (upgrades deadlock by nature).
class SharedMutex : public detail::LockHandle {
 public:
  // lock(), try_lock(), try_lock_for(), try_lock_until(), unlock() and release(): the write
  // lock, as in detail::LockHandle.

  void lock_shared() { acquire_shared(std::nullopt); }
  bool try_lock_shared() { return acquire_shared(SteadyClock::now()); }
  template <class Rep, class Period>
  bool try_lock_shared_for(const std::chrono::duration<Rep, Period>& timeout) {
    return acquire_shared(detail::deadline_after(timeout));
  }
  template <class Clock, class Duration>
  bool try_lock_shared_until(const std::chrono::time_point<Clock, Duration>& when) {
    return acquire_shared(detail::deadline_at(when));
  }
  // As lock(std::stop_token), for the read lock.
  bool lock_shared(std::stop_token stop) { return acquire_shared(std::nullopt, std::move(stop)); }
  template <class Rep, class Period>
  bool try_lock_shared_for(const std::chrono::duration<Rep, Period>& timeout, std::stop_token stop) {
    return acquire_shared(detail::deadline_after(timeout), std::move(stop));
  }
  // lock_async() for the read lock.
  Acquiring<std::optional<Lease>> lock_shared_async(AsyncOptions options = {}) {
    return acquire_async(/*shared=*/true, std::move(options));
  }
  void unlock_shared() noexcept { unlock_shared_noexcept(); }
  void release_shared() { release_shared_hold(); }
  // release_after() for the read lock.
  void release_shared_after(std::chrono::milliseconds keep_for) { release_shared_hold(keep_for); }
  bool owns_shared() const { return owns_shared_lock(); }

  // A Lockable view whose lock() is lock_shared(): for MultiLock and std::lock_guard.
  class Reader {
   public:
    void lock() { owner_->lock_shared(); }
    bool try_lock() { return owner_->try_lock_shared(); }
    template <class Rep, class Period>
    bool try_lock_for(const std::chrono::duration<Rep, Period>& timeout) {
      return owner_->try_lock_shared_for(timeout);
    }
    template <class Clock, class Duration>
    bool try_lock_until(const std::chrono::time_point<Clock, Duration>& when) {
      return owner_->try_lock_shared_until(when);
    }
    void unlock() noexcept { owner_->unlock_shared(); }
    Acquiring<std::optional<Lease>> lock_async(AsyncOptions options = {}) {
      return owner_->lock_shared_async(std::move(options));
    }

   private:
    friend class SharedMutex;
    explicit Reader(SharedMutex* owner) : owner_(owner) {}
    SharedMutex* owner_;
  };
  // The view refers to this SharedMutex, which must outlive it.
  Reader reader() { return Reader(this); }

 private:
  friend class Client;
  using LockHandle::LockHandle;
};

}  // namespace turnstile
