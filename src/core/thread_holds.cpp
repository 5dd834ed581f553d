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

void ThreadHolds::count_nested_exclusive(ThreadHold& held, Primitive primitive) {
  if (held.exclusive_count == 0) {
    throw WouldDeadlock("this thread holds the read lock of '" + name_ +
                        "'; asking for the write lock would deadlock (upgrades are not supported)");
  }
  if (primitive == Primitive::mutex || held.exclusive_primitive == Primitive::mutex) {
    throw WouldDeadlock("this thread already holds '" + name_ + "' and Mutex is not reentrant");
  }
  throw_if_lost(*held.record);
  ++held.exclusive_count;
}

bool ThreadHolds::acquire_exclusive(Primitive primitive, Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      count_nested_exclusive(it->second, primitive);
      return true;
    }
  }
  auto record = client_->acquire(
      {.name = name_, .kind = EntryKind::exclusive, .primitive = primitive, .stop = std::move(stop)}, deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
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

void ThreadHolds::release_exclusive() {
  std::unique_lock lock(mutex_);
  const auto it = find_mine();
  if (it == holds_.end() || it->second.exclusive_count == 0) {
    throw NotHeld("this thread does not hold '" + name_ + "'");
  }
  auto& held = it->second;
  if (--held.exclusive_count > 0) return;
  if (held.shared_count > 0) {
    auto* record = held.record.get();
    lock.unlock();
    downgrade_unlocked(*record);
    return;
  }
  auto record = std::move(held.record);
  erase(it);
  lock.unlock();
  record->release();
}

bool ThreadHolds::acquire_shared(Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      throw_if_lost(*it->second.record);
      ++it->second.shared_count;  // reentrant read, or a writer reading (downgrade path)
      return true;
    }
  }
  auto record = client_->acquire(
      {.name = name_, .kind = EntryKind::shared, .primitive = Primitive::shared_mutex, .stop = std::move(stop)},
      deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
  holds_.emplace_back(std::this_thread::get_id(), ThreadHold{std::move(record), Primitive::shared_mutex, 0, 1});
  return true;
}

void ThreadHolds::release_shared() {
  std::unique_lock lock(mutex_);
  const auto it = find_mine();
  if (it == holds_.end() || it->second.shared_count == 0) {
    throw NotHeld("this thread does not hold the read lock of '" + name_ + "'");
  }
  auto& held = it->second;
  if (--held.shared_count > 0 || held.exclusive_count > 0) return;
  auto record = std::move(held.record);
  erase(it);
  lock.unlock();
  if (record->released()) {
    // Released whole when its downgrade failed; the loss was told then.
    throw HoldLost("the read lock of '" + name_ + "' was lost when its downgrade failed: " + record->loss_reason());
  }
  record->release();
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
std::stop_token ThreadHolds::lost_token() const { return current_record().lost_token(); }
HoldState ThreadHolds::hold_state() const { return current_record().hold_state(); }

}  // namespace turnstile::detail
