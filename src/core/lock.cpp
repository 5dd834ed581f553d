// SPDX-License-Identifier: Apache-2.0
// Mutex, RecursiveMutex and SharedMutex: the public lock types, over the calling process's
// per-thread holds of the name (thread_holds.cpp).
#include "turnstile/lock.hpp"

#include "core/async_holds.hpp"
#include "core/client_state.hpp"
#include "core/thread_holds.hpp"

namespace turnstile::detail {

LockHandle::LockHandle(std::shared_ptr<ThreadHolds> holds, Primitive primitive)
    : holds_(std::move(holds)), primitive_(primitive), async_holds_(std::make_shared<AsyncHolds>()) {}

const std::string& LockHandle::name() const { return holds_->name(); }
bool LockHandle::owns_lock() const { return holds_->owns_exclusive(); }
bool LockHandle::owns_shared_lock() const { return holds_->owns_shared(); }
std::uint64_t LockHandle::fencing_token() const { return holds_->fencing_token(); }
std::string LockHandle::release_receipt() const { return holds_->release_receipt(); }
std::stop_token LockHandle::lost_token() const { return holds_->lost_token(); }
HoldState LockHandle::hold_state() const { return holds_->hold_state(); }
bool LockHandle::acquire_exclusive(Deadline deadline, std::stop_token stop) {
  return holds_->acquire_exclusive(primitive_, deadline, std::move(stop));
}
void LockHandle::release_exclusive(std::optional<std::chrono::milliseconds> keep_for) {
  holds_->release_exclusive(/*early=*/true, keep_for);
}
bool LockHandle::acquire_shared(Deadline deadline, std::stop_token stop) {
  return holds_->acquire_shared(deadline, std::move(stop));
}
void LockHandle::release_shared_hold(std::optional<std::chrono::milliseconds> keep_for) {
  holds_->release_shared(/*early=*/true, keep_for);
}

Acquiring<std::optional<Lease>> LockHandle::acquire_async(bool shared, AsyncOptions options) {
  if (auto held = async_holds_->nested(holds_->name(), primitive_, shared)) {
    auto state = std::make_shared<AsyncState<std::optional<Lease>>>();
    state->complete(Lease(std::move(held)));  // counted on this object's hold, at once
    return Acquiring<std::optional<Lease>>(std::move(state));
  }
  QueueRequest request{.name = holds_->name(),
                       .kind = shared ? EntryKind::shared : EntryKind::exclusive,
                       .primitive = shared ? Primitive::shared_mutex : primitive_};
  const AsyncLockObject object{.holds = async_holds_, .shared = shared, .thread_holds = holds_};
  return holds_->client().acquire_async(std::move(request), options, &object);
}

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
  release_reporting(*holds_, [this] { holds_->unlock_exclusive(); });
}

void LockHandle::unlock_shared_noexcept() noexcept {
  release_reporting(*holds_, [this] { holds_->unlock_shared(); });
}

}  // namespace turnstile::detail
