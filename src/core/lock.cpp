// Mutex, RecursiveMutex and SharedMutex: the public lock types, over the calling process's
// per-thread holds of the name (thread_holds.cpp).
#include "turnstile/lock.hpp"

#include "core/client_state.hpp"
#include "core/thread_holds.hpp"

namespace turnstile::detail {

LockHandle::LockHandle(std::shared_ptr<ThreadHolds> holds, Primitive primitive)
    : holds_(std::move(holds)), primitive_(primitive) {}

const std::string& LockHandle::name() const { return holds_->name(); }
bool LockHandle::owns_lock() const { return holds_->owns_exclusive(); }
bool LockHandle::owns_shared_lock() const { return holds_->owns_shared(); }
std::uint64_t LockHandle::fencing_token() const { return holds_->fencing_token(); }
std::stop_token LockHandle::lost_token() const { return holds_->lost_token(); }
HoldState LockHandle::hold_state() const { return holds_->hold_state(); }
bool LockHandle::acquire_exclusive(Deadline deadline, std::stop_token stop) {
  return holds_->acquire_exclusive(primitive_, deadline, std::move(stop));
}
void LockHandle::release_exclusive() { holds_->release_exclusive(); }
bool LockHandle::acquire_shared(Deadline deadline, std::stop_token stop) {
  return holds_->acquire_shared(deadline, std::move(stop));
}
void LockHandle::release_shared_hold() { holds_->release_shared(); }

namespace {
// What an unlock() cannot throw goes to the client's error handler.
template <typename Release>
void release_reporting(ThreadHolds& holds, Release release) noexcept {
  try {
    release();
  } catch (const Error& error) {
    holds.client().report(error);
  } catch (const std::exception& error) {
    holds.client().report(BackendUnavailable(error.what()));
  }
}
}  // namespace

void LockHandle::unlock_exclusive() noexcept {
  release_reporting(*holds_, [this] { holds_->release_exclusive(); });
}

void LockHandle::unlock_shared_noexcept() noexcept {
  release_reporting(*holds_, [this] { holds_->release_shared(); });
}

}  // namespace turnstile::detail
