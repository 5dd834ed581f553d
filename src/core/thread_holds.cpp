// SPDX-License-Identifier: Apache-2.0
// Reentrancy and reader/writer rules, per thread, on top of one backend entry per thread.
#include "core/thread_holds.hpp"

#include <algorithm>

#include "core/client_state.hpp"

namespace turnstile::detail {

ThreadHolds::Holds::iterator ThreadHolds::find_mine() {
  const auto self = std::this_thread::get_id();
  return std::find_if(holds_.begin(), holds_.end(), [self](const auto& item) {
    return item.first == self && item.second.record->owned_by_this_process();
  });
}

const ThreadHolds::ThreadHold* ThreadHolds::find_current() const {
  const auto self = std::this_thread::get_id();
  for (const auto& [thread, held] : holds_) {
    if (thread == self && held.record->owned_by_this_process()) return &held;
  }
  return nullptr;
}

// A nested acquire counts on the hold this thread already has: when that hold may have been
// lost, admitting the nested one would report a lock held with nothing on the server.
void ThreadHolds::throw_if_lost(const HoldRecord& record) const {
  if (record.hold_state() != HoldState::lost) return;
  throw HoldLost("this thread's hold of '" + name_ + "' may have been lost (" + record.loss_reason() +
                 "); a nested acquire cannot count on it: release it and acquire again");
}

void ThreadHolds::erase(Holds::iterator it) {
  if (it != holds_.end() - 1) *it = std::move(holds_.back());
  holds_.pop_back();
}

bool ThreadHolds::count_nested_exclusive(ThreadHold& held, Primitive primitive, bool try_only) {
  const bool reentrant =
      held.exclusive_count > 0 && primitive != Primitive::mutex && held.exclusive_primitive != Primitive::mutex;
  // A try does not wait, so it cannot deadlock: the name is busy (held by this very thread), and
  // false is what a std::mutex user's `if (m.try_lock())` expects, as pthread's error-checking
  // mutex answers trylock with EBUSY where lock and timedlock give EDEADLK.
  if (!reentrant && try_only) return false;
  if (held.exclusive_count == 0) {
    throw WouldDeadlock("this thread holds the read lock of '" + name_ +
                        "'; asking for the write lock would deadlock (upgrades are not supported)");
  }
  if (primitive == Primitive::mutex || held.exclusive_primitive == Primitive::mutex) {
    throw WouldDeadlock("this thread already holds '" + name_ + "' and Mutex is not reentrant");
  }
  throw_if_lost(*held.record);
  ++held.exclusive_count;
  return true;
}

void ThreadHolds::mark_released_early_locked(bool shared) {
  const std::pair mark{std::this_thread::get_id(), shared};
  if (std::find(released_early_.begin(), released_early_.end(), mark) == released_early_.end()) {
    released_early_.push_back(mark);
  }
}

bool ThreadHolds::take_released_early_locked(bool shared) {
  const auto it =
      std::find(released_early_.begin(), released_early_.end(), std::pair{std::this_thread::get_id(), shared});
  if (it == released_early_.end()) return false;
  released_early_.erase(it);
  return true;
}

void ThreadHolds::forget_released_early_locked() {
  std::erase_if(released_early_, [self = std::this_thread::get_id()](const auto& mark) { return mark.first == self; });
}

bool ThreadHolds::acquire_exclusive(Primitive primitive, Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      const bool try_only = deadline && *deadline <= SteadyClock::now();
      const bool counted = count_nested_exclusive(it->second, primitive, try_only);
      if (counted) forget_released_early_locked();
      return counted;
    }
  }
  auto record = client_->acquire(
      {.name = name_, .kind = EntryKind::exclusive, .primitive = primitive, .stop = std::move(stop)}, deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
  forget_released_early_locked();
  holds_.emplace_back(std::this_thread::get_id(), ThreadHold{std::move(record), primitive, 1, 0});
  return true;
}

// The network call and any callbacks run without the mutex, so they neither hold up other
// threads nor deadlock a callback that looks at this lock. Only this thread removes its record,
// so the reference stays valid.
void ThreadHolds::downgrade_unlocked(HoldRecord& record) {
  try {
    record.backend_hold().downgrade();  // the reads keep the entry, now shared
  } catch (const Error& error) {
    // Its outcome is unknown: the entry may still be a writer's. Rather than leave a write
    // entry behind for the client's life, release it whole (retried in the background if need
    // be) and tell the remaining reads that their hold is lost.
    record.lose(std::string("its downgrade to a read lock failed (") + error.what() +
                "), so the hold was released whole");
    try {
      record.release();
    } catch (const Error&) {
      // HoldLost (just reported above) or BackendUnavailable (now retried in the background).
    }
    throw;
  }
}

void ThreadHolds::end_hold(HoldRecord& record, std::optional<std::chrono::milliseconds> keep_for, bool wait) {
  if (keep_for) return record.release_after(*keep_for);
  wait ? record.release() : record.release_without_waiting();
}

void ThreadHolds::release_exclusive(bool early, std::optional<std::chrono::milliseconds> keep_for) {
  release_exclusive_as(early, keep_for, /*wait=*/true);
}

void ThreadHolds::release_shared(bool early, std::optional<std::chrono::milliseconds> keep_for) {
  release_shared_as(early, keep_for, /*wait=*/true);
}

void ThreadHolds::release_exclusive_as(bool early, std::optional<std::chrono::milliseconds> keep_for, bool wait) {
  std::unique_lock lock(mutex_);
  const auto it = find_mine();
  if (it == holds_.end() || it->second.exclusive_count == 0) {
    throw NotHeld("this thread does not hold '" + name_ + "'");
  }
  auto& held = it->second;
  if (--held.exclusive_count > 0) return;
  if (early) mark_released_early_locked(false);
  if (held.shared_count > 0) {
    auto* record = held.record.get();
    lock.unlock();
    downgrade_unlocked(*record);
    return;
  }
  auto record = std::move(held.record);
  erase(it);
  lock.unlock();
  end_hold(*record, keep_for, wait);
}

bool ThreadHolds::acquire_shared(Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      throw_if_lost(*it->second.record);
      ++it->second.shared_count;  // reentrant read, or a writer reading (downgrade path)
      forget_released_early_locked();
      return true;
    }
  }
  auto record = client_->acquire(
      {.name = name_, .kind = EntryKind::shared, .primitive = Primitive::shared_mutex, .stop = std::move(stop)},
      deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
  forget_released_early_locked();
  holds_.emplace_back(std::this_thread::get_id(), ThreadHold{std::move(record), Primitive::shared_mutex, 0, 1});
  return true;
}

void ThreadHolds::release_shared_as(bool early, std::optional<std::chrono::milliseconds> keep_for, bool wait) {
  std::unique_lock lock(mutex_);
  const auto it = find_mine();
  if (it == holds_.end() || it->second.shared_count == 0) {
    throw NotHeld("this thread does not hold the read lock of '" + name_ + "'");
  }
  auto& held = it->second;
  if (--held.shared_count > 0) return;
  if (early) mark_released_early_locked(true);
  if (held.exclusive_count > 0) return;
  auto record = std::move(held.record);
  erase(it);
  lock.unlock();
  if (record->released()) {
    // Released whole when its downgrade failed; the loss was told then.
    throw HoldLost("the read lock of '" + name_ + "' was lost when its downgrade failed: " + record->loss_reason());
  }
  end_hold(*record, keep_for, wait);
}

void ThreadHolds::unlock_exclusive() {
  {
    std::lock_guard lock(mutex_);
    const auto it = find_mine();
    const bool holds = it != holds_.end() && it->second.exclusive_count > 0;
    if (!holds && take_released_early_locked(false)) return;  // the guard after release()
  }
  release_exclusive_as(/*early=*/false, std::nullopt, /*wait=*/false);
}

void ThreadHolds::unlock_shared() {
  {
    std::lock_guard lock(mutex_);
    const auto it = find_mine();
    const bool holds = it != holds_.end() && it->second.shared_count > 0;
    if (!holds && take_released_early_locked(true)) return;
  }
  release_shared_as(/*early=*/false, std::nullopt, /*wait=*/false);
}

bool ThreadHolds::owns_exclusive() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  return held && held->exclusive_count > 0;
}

bool ThreadHolds::owns_shared() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  return held && held->shared_count > 0;
}

const HoldRecord& ThreadHolds::current_record() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  if (!held) throw NotHeld("this thread does not hold '" + name_ + "'");
  // Only this thread can release its record, so it outlives the caller's use of it.
  return *held->record;
}

std::uint64_t ThreadHolds::fencing_token() const { return current_record().fencing_token(); }
std::string ThreadHolds::release_receipt() const { return current_record().receipt(); }
std::stop_token ThreadHolds::lost_token() const { return current_record().lost_token(); }
HoldState ThreadHolds::hold_state() const { return current_record().hold_state(); }

}  // namespace turnstile::detail
