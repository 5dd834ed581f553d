// SPDX-License-Identifier: Apache-2.0
#include "turnstile/multi_lock.hpp"

#include <stop_token>

namespace turnstile {
namespace {

// One MultiLock::lock_async in progress: its members' async acquires, one after another, each
// on the same deadline and on this acquire's own stop (which cancel() and the caller's stop
// request). Kept alive by the member acquire it waits for.
class MultiAcquire final : public detail::AsyncOperation, public std::enable_shared_from_this<MultiAcquire> {
 public:
  using Keep = std::function<void(std::vector<Lease>)>;
  MultiAcquire(std::vector<MultiLock::AsyncStart> starts, Deadline deadline,
               std::shared_ptr<detail::AsyncState<bool>> state, Keep keep)
      : starts_(std::move(starts)), deadline_(deadline), state_(std::move(state)), keep_(std::move(keep)) {}
  void start(const std::stop_token& user_stop) {
    if (user_stop.stop_possible()) follow_user_stop_.emplace(user_stop, [this] { cancel(); });
    next();
  }
  void cancel() noexcept override { stop_.request_stop(); }

 private:
  void next() {
    if (taken_.size() == starts_.size()) return end(true, nullptr);
    std::exception_ptr failure;
    try {
      starts_[taken_.size()]({.deadline = deadline_, .stop = stop_.get_token()},
                             [self = shared_from_this()](Lease lease, std::exception_ptr error) {
                               if (error || !lease.held()) return self->end(false, std::move(error));
                               self->taken_.push_back(std::move(lease));
                               self->next();
                             });
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) end(false, std::move(failure));  // outside the handler (see AsyncAcquire::drive)
  }
  void end(bool all, std::exception_ptr error) {
    follow_user_stop_.reset();
    // A cancel or stop that came while the last member was being taken: not acquired, as it
    // would have been a moment earlier (red team rt26file F5: true after cancel()).
    if (stop_.stop_requested()) all = false;
    while (!all && !taken_.empty()) taken_.pop_back();  // given back in reverse order
    if (error) return state_->fail(std::move(error));
    if (all) keep_(std::move(taken_));
    state_->complete(all);
  }

  std::vector<MultiLock::AsyncStart> starts_;
  Deadline deadline_;
  std::shared_ptr<detail::AsyncState<bool>> state_;
  Keep keep_;
  std::stop_source stop_;
  std::optional<std::stop_callback<std::function<void()>>> follow_user_stop_;
  std::vector<Lease> taken_;
};

}  // namespace

bool MultiLock::acquire_until(Deadline deadline) {
  std::size_t taken = 0;
  const auto give_back = [&] {
    while (taken > 0) members_[--taken].unlock();
  };
  try {
    for (; taken < members_.size(); ++taken) {
      if (!members_[taken].acquire(deadline)) {
        give_back();
        return false;
      }
    }
  } catch (...) {
    give_back();
    throw;
  }
  return true;
}

Acquiring<bool> MultiLock::lock_async(AsyncOptions options) {
  std::vector<AsyncStart> starts;
  for (const auto& member : members_) {
    if (!member.acquire_async) {
      throw InvalidArgument(
          "MultiLock::lock_async: a member has no async form whose hold is a Lease (a "
          "PermitCounter::Lockable, another MultiLock or a std::timed_mutex)");
    }
    starts.push_back(member.acquire_async);
  }
  {
    std::lock_guard lock(*async_mutex_);
    if (!async_held_->empty()) throw InvalidArgument("this MultiLock holds through lock_async already");
  }
  auto state = std::make_shared<detail::AsyncState<bool>>();
  Acquiring<bool> handle(state);
  auto keep = [mutex = async_mutex_, held = async_held_](std::vector<Lease> leases) {
    std::lock_guard lock(*mutex);
    *held = std::move(leases);
  };
  auto acquire = std::make_shared<MultiAcquire>(std::move(starts), options.deadline, state, std::move(keep));
  state->set_operation(acquire);
  acquire->start(options.stop);
  return handle;
}

void MultiLock::unlock() noexcept {
  std::vector<Lease> held;
  {
    std::lock_guard lock(*async_mutex_);
    held.swap(*async_held_);
  }
  if (!held.empty()) {
    while (!held.empty()) held.pop_back();  // in reverse order; each Lease's end reports its failures
    return;
  }
  for (std::size_t i = members_.size(); i-- > 0;) members_[i].unlock();
}

}  // namespace turnstile
