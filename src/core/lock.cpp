// Reentrancy and reader/writer rules, per thread, on top of one backend entry per thread.
#include <algorithm>

#include "core/client_state.hpp"
#include "turnstile/lock.hpp"

namespace turnstile {
namespace detail {

LockCore::Holds::iterator LockCore::find_mine() {
  const auto self = std::this_thread::get_id();
  return std::find_if(holds_.begin(), holds_.end(), [self](const auto& item) {
    return item.first == self && item.second.record->owned_by_this_process();
  });
}

const LockCore::ThreadHold* LockCore::find_current() const {
  const auto self = std::this_thread::get_id();
  for (const auto& [thread, held] : holds_) {
    if (thread == self && held.record->owned_by_this_process()) return &held;
  }
  return nullptr;
}

// A nested acquire counts on the hold this thread already has: when that hold may have been
// lost, admitting the nested one would report a lock held with nothing on the server.
void LockCore::throw_if_lost(const HoldRecord& record) const {
  if (record.hold_state() != HoldState::lost) return;
  throw HoldLost("this thread's hold of '" + name_ + "' may have been lost (" + record.loss_reason() +
                 "); a nested acquire cannot count on it: release it and acquire again");
}

void LockCore::erase(Holds::iterator it) {
  if (it != holds_.end() - 1) *it = std::move(holds_.back());
  holds_.pop_back();
}

bool LockCore::acquire_exclusive(LockFlavor flavor, Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      auto& held = it->second;
      if (held.exclusive_count > 0) {
        if (flavor == LockFlavor::plain || held.exclusive_flavor == LockFlavor::plain) {
          throw WouldDeadlock("this thread already holds '" + name_ + "' and Mutex is not reentrant");
        }
        throw_if_lost(*held.record);
        ++held.exclusive_count;
        return true;
      }
      throw WouldDeadlock("this thread holds the read lock of '" + name_ +
                          "'; asking for the write lock would deadlock (upgrades are not supported)");
    }
  }
  auto record = client_->acquire({name_, EntryKind::exclusive, 1, 0, flavor == LockFlavor::read_write ? Primitive::shared_mutex : Primitive::mutex, std::move(stop)}, deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
  holds_.emplace_back(std::this_thread::get_id(), ThreadHold{std::move(record), flavor, 1, 0});
  return true;
}

void LockCore::release_exclusive() {
  std::unique_lock lock(mutex_);
  const auto it = find_mine();
  if (it == holds_.end() || it->second.exclusive_count == 0) {
    throw NotHeld("this thread does not hold '" + name_ + "'");
  }
  auto& held = it->second;
  if (--held.exclusive_count > 0) return;
  if (held.shared_count > 0) {
    // The network call and any callbacks run without the mutex, so they neither hold up other
    // threads nor deadlock a callback that looks at this lock. Only this thread removes its
    // record, so the pointer stays valid.
    auto* record = held.record.get();
    lock.unlock();
    try {
      record->backend_hold().downgrade();  // the reads keep the entry, now shared
    } catch (const Error& error) {
      // Its outcome is unknown: the entry may still be a writer's. Rather than leave a write
      // entry behind for the client's life, release it whole (retried in the background if need
      // be) and tell the remaining reads that their hold is lost.
      record->lose(std::string("its downgrade to a read lock failed (") + error.what() +
                   "), so the hold was released whole");
      try {
        record->release();
      } catch (const Error&) {
        // HoldLost (just reported above) or BackendUnavailable (now retried in the background).
      }
      throw;
    }
    return;
  }
  auto record = std::move(held.record);
  erase(it);
  lock.unlock();
  record->release();
}

bool LockCore::acquire_shared(Deadline deadline, std::stop_token stop) {
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_mine(); it != holds_.end()) {
      throw_if_lost(*it->second.record);
      ++it->second.shared_count;  // reentrant read, or a writer reading (downgrade path)
      return true;
    }
  }
  auto record = client_->acquire({name_, EntryKind::shared, 1, 0, Primitive::shared_mutex, std::move(stop)}, deadline);
  if (!record) return false;
  std::lock_guard lock(mutex_);
  holds_.emplace_back(std::this_thread::get_id(), ThreadHold{std::move(record), LockFlavor::read_write, 0, 1});
  return true;
}

void LockCore::release_shared() {
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

bool LockCore::owns_exclusive() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  return held && held->exclusive_count > 0;
}

bool LockCore::owns_shared() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  return held && held->shared_count > 0;
}

const HoldRecord& LockCore::current_record() const {
  std::lock_guard lock(mutex_);
  const auto* held = find_current();
  if (!held) throw NotHeld("this thread does not hold '" + name_ + "'");
  // Only this thread can release its record, so it outlives the caller's use of it.
  return *held->record;
}

std::uint64_t LockCore::fencing_token() const { return current_record().fencing_token(); }
std::stop_token LockCore::lost_token() const { return current_record().lost_token(); }
HoldState LockCore::hold_state() const { return current_record().hold_state(); }

LockHandle::LockHandle(std::shared_ptr<LockCore> core, LockFlavor flavor)
    : core_(std::move(core)), flavor_(flavor) {}

const std::string& LockHandle::name() const { return core_->name(); }
bool LockHandle::owns_lock() const { return core_->owns_exclusive(); }
bool LockHandle::owns_shared_lock() const { return core_->owns_shared(); }
std::uint64_t LockHandle::fencing_token() const { return core_->fencing_token(); }
std::stop_token LockHandle::lost_token() const { return core_->lost_token(); }
HoldState LockHandle::hold_state() const { return core_->hold_state(); }
bool LockHandle::acquire_exclusive(Deadline deadline, std::stop_token stop) {
  return core_->acquire_exclusive(flavor_, deadline, std::move(stop));
}
void LockHandle::release_exclusive() { core_->release_exclusive(); }
bool LockHandle::acquire_shared(Deadline deadline, std::stop_token stop) {
  return core_->acquire_shared(deadline, std::move(stop));
}
void LockHandle::release_shared() { core_->release_shared(); }

void LockHandle::unlock_exclusive() noexcept {
  try {
    core_->release_exclusive();
  } catch (const Error& error) {
    core_->client().report(error);
  } catch (const std::exception& error) {
    core_->client().report(BackendUnavailable(error.what()));
  }
}

void LockHandle::unlock_shared_noexcept() noexcept {
  try {
    core_->release_shared();
  } catch (const Error& error) {
    core_->client().report(error);
  } catch (const std::exception& error) {
    core_->client().report(BackendUnavailable(error.what()));
  }
}

}  // namespace detail
}  // namespace turnstile
