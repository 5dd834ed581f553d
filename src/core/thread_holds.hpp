// SPDX-License-Identifier: Apache-2.0
// The holds the threads of one process have on one lock name, through one client: reentrancy
// (a RecursiveMutex counts, a Mutex refuses), reader/writer rules and downgrade, on top of one
// backend entry per thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/hold_record.hpp"
#include "turnstile/lock.hpp"

namespace turnstile::detail {

class ClientState;

class ThreadHolds {
 public:
  ThreadHolds(std::shared_ptr<ClientState> client, std::string name)
      : client_(std::move(client)), name_(std::move(name)) {}

  // `primitive`: the lock type asking (Mutex refuses a nested acquire, the others count it).
  // A try (a deadline already past) on a name this thread holds where waiting would deadlock
  // returns false, as a busy name does; lock() and the timed tries throw WouldDeadlock.
  bool acquire_exclusive(Primitive primitive, Deadline deadline, std::stop_token stop = {});
  // `early`: release() rather than unlock(): the guard that still owns the lock (lock_guard,
  // unique_lock, shared_lock) will unlock it once more, and that unlock is then not misuse.
  // With `keep_for`, the last release leaves the entry in place that long (release_after).
  void release_exclusive(bool early = false, std::optional<std::chrono::milliseconds> keep_for = std::nullopt);
  bool acquire_shared(Deadline deadline, std::stop_token stop = {});
  void release_shared(bool early = false, std::optional<std::chrono::milliseconds> keep_for = std::nullopt);
  // unlock()/unlock_shared(): a release, except right after this thread's release() of that
  // side, when it is the guard's destructor and does nothing. The last one leaves the queue
  // without waiting for the server (HoldRecord::release_without_waiting): its failures go to
  // the error handler; misuse (NotHeld) and a read lock lost to a failed downgrade still throw.
  void unlock_exclusive();
  void unlock_shared();
  bool owns_exclusive() const;
  bool owns_shared() const;
  std::uint64_t fencing_token() const;
  std::string release_receipt() const;
  std::stop_token lost_token() const;
  HoldState hold_state() const;
  const std::string& name() const { return name_; }
  ClientState& client() { return *client_; }

 private:
  struct ThreadHold {
    std::unique_ptr<HoldRecord> record;  // one backend entry per thread and name
    Primitive exclusive_primitive;
    int exclusive_count = 0;
    int shared_count = 0;  // when exclusive_count > 0 too, the reads ride on the write entry
  };
  // A handful of threads at most hold one name at once: a linear scan of a vector that keeps
  // its capacity costs no allocation per acquire, unlike a hash map node.
  using Holds = std::vector<std::pair<std::thread::id, ThreadHold>>;
  // The calling thread's hold, skipping those a forked child inherited from its parent (its
  // thread id may equal the parent's thread's, but the hold is not the child's).
  Holds::iterator find_mine();
  const ThreadHold* find_current() const;
  // The calling thread's hold; throws NotHeld.
  const HoldRecord& current_record() const;
  void erase(Holds::iterator it);
  // Throws HoldLost when `record` may have been lost (before a nested acquire counts on it).
  void throw_if_lost(const HoldRecord& record) const;
  // A nested exclusive acquire on the calling thread's hold `held`: counted (true), refused
  // (WouldDeadlock), or for a try (`try_only`) false.
  bool count_nested_exclusive(ThreadHold& held, Primitive primitive, bool try_only);
  // The calling thread's release() of one side ("released early"), until its next unlock() or
  // acquire of the name. Caller holds mutex_.
  void mark_released_early_locked(bool shared);
  bool take_released_early_locked(bool shared);
  void forget_released_early_locked();
  // The last write count of a hold that still has reads: its entry becomes a shared one.
  void downgrade_unlocked(HoldRecord& record);
  // The release of each side; `wait`: release() (throws), else release_without_waiting().
  void release_exclusive_as(bool early, std::optional<std::chrono::milliseconds> keep_for, bool wait);
  void release_shared_as(bool early, std::optional<std::chrono::milliseconds> keep_for, bool wait);
  // Ends `record`'s hold as the release asked (see release_exclusive_as).
  static void end_hold(HoldRecord& record, std::optional<std::chrono::milliseconds> keep_for, bool wait);

  std::shared_ptr<ClientState> client_;
  std::string name_;
  mutable std::mutex mutex_;
  Holds holds_;
  // Threads whose last release() of a side the guard's unlock has not followed yet: one entry
  // per thread and side at most (cleared by that thread's next acquire of the name).
  std::vector<std::pair<std::thread::id, bool /* shared */>> released_early_;
};

}  // namespace turnstile::detail
