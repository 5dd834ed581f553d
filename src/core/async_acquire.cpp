// SPDX-License-Identifier: Apache-2.0
// The core's async driver (async_acquire.hpp).
#include "core/async_acquire.hpp"

#include <vector>

namespace turnstile::detail {

bool AsyncDriver::add(const std::shared_ptr<AsyncAcquire>& acquire) {
  {
    std::lock_guard lock(mutex_);
    if (!closed_) {
      acquire->listed_ = acquire;
      acquire->next_ = first_;
      if (first_) first_->previous_ = acquire.get();
      first_ = acquire.get();
      acquire->registered_ = true;
      return true;
    }
  }
  acquire->client_ending();
  acquire->end_at_client_end(SteadyClock::now() + kLeavesAtEnd);
  return false;
}

void AsyncDriver::remove(AsyncAcquire* acquire) {
  std::shared_ptr<AsyncAcquire> removed;  // released after the mutex
  std::lock_guard lock(mutex_);
  if (!acquire->listed_) return;
  removed = std::move(acquire->listed_);
  if (acquire->previous_) acquire->previous_->next_ = acquire->next_;
  if (acquire->next_) acquire->next_->previous_ = acquire->previous_;
  if (first_ == acquire) first_ = acquire->next_;
  acquire->previous_ = acquire->next_ = nullptr;
}

void AsyncDriver::close() noexcept {
  if (generation_ != fork_generation()) {
    // A forked child's copy: the pending acquires are the parent's. Destroying one would end
    // its place in the queue and its wake-up (both the parent's, some on open file descriptions
    // the child shares), and the mutex may have been held by a parent's thread at the fork:
    // leaked on purpose (each listed acquire keeps itself), never touched, as the pool's threads.
    return;
  }
  std::vector<std::shared_ptr<AsyncAcquire>> pending;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    for (auto* acquire = first_; acquire; acquire = acquire->next_) pending.push_back(acquire->listed_);
  }
  // The storage calls in flight end on the machines' stop, so the threads end soon.
  for (const auto& acquire : pending) acquire->client_ending();
  pool_.close();
  const Deadline leave_by = SteadyClock::now() + kLeavesAtEnd;
  for (const auto& acquire : pending) acquire->end_at_client_end(leave_by);
}

namespace {
thread_local int inline_continuations = 0;
}  // namespace

InlineContinuation::InlineContinuation() noexcept { ++inline_continuations; }
InlineContinuation::~InlineContinuation() { --inline_continuations; }

bool AsyncDriver::first_step_here() const {
  return inline_continuations < kMaxInlineContinuations && pool_.on_pool_thread();
}

void AsyncAcquire::start(const std::stop_token& user_stop) {
  const bool here = driver_.first_step_here();
  // Posted, it is pending from now on; taken here, only once its first step has not ended it.
  if (!here && !register_pending()) return;  // the client is ending: ended already
  // Before the first step: a step that ends the acquire drops this callback. It may run at once
  // (a stop already requested): the first step then ends the acquire.
  if (user_stop.stop_possible()) follow_user_stop_.emplace(user_stop, [this] { cancel(); });
  {
    std::lock_guard lock(mutex_);
    if (finished_) return;
    if (!here) return post_drive_locked();
    scheduled_ = true;  // this thread steps it: wakes and timers only mark it woken meanwhile
  }
  drive();
}

bool AsyncAcquire::register_pending() {
  if (!driver_.add(shared_from_this())) return false;
  std::lock_guard lock(mutex_);
  if (!deadline_) return true;
  if (passed(deadline_)) {
    woken_ = true;  // it passed during the first step: the next step ends the acquire
  } else {
    deadline_timer_ = driver_.pool().post_at(*deadline_, waker());
  }
  return true;
}

void AsyncAcquire::cancel() noexcept {
  if (inherited()) return;  // the parent's acquire goes on in the parent
  stop_.request_stop();     // a storage call in flight ends; the next step ends the acquire
  wake();
}

void AsyncAcquire::client_ending() noexcept {
  if (inherited()) return;
  client_ended_ = true;
  stop_.request_stop();
}

void AsyncAcquire::end_at_client_end(Deadline leave_by) noexcept {
  // A forked child's copy of the client ends without leaving the parent's queue entries.
  if (inherited()) return;
  finish(nullptr, leave_by);
}

Wake AsyncAcquire::waker() {
  return [weak = weak_from_this()] {
    if (auto self = weak.lock()) self->wake();
  };
}

void AsyncAcquire::wake() noexcept {
  std::lock_guard lock(mutex_);
  if (finished_) return;
  woken_ = true;
  if (waiting_ && !scheduled_) post_drive_locked();
}

void AsyncAcquire::post_drive_locked() {
  // Refused once the pool is closed: the client's end then ends this acquire.
  scheduled_ = driver_.pool().post([self = shared_from_this()] { self->drive(); });
}

void AsyncAcquire::drive() noexcept {
  for (;;) {
    std::unique_ptr<WakeArm> disarm;
    std::optional<AsyncPool::TimerId> pause;
    {
      std::lock_guard lock(mutex_);
      if (finished_ || (waiting_ && !woken_)) {
        scheduled_ = false;
        return;
      }
      woken_ = false;
      waiting_ = false;
      disarm = std::move(arm_);
      pause = std::exchange(pause_timer_, std::nullopt);
    }
    if (pause) driver_.pool().cancel(*pause);
    disarm.reset();  // its wake is neither running nor will it run
    MachineStep next;
    std::unique_ptr<WakeArm> armed;
    std::exception_ptr failure;
    try {
      next = step();
      if (next.kind == MachineStep::Kind::done) return finish(nullptr);
      if (!registered_ && !register_pending()) return;  // the client is ending: ended already
      if (next.kind == MachineStep::Kind::wait) armed = arm(waker());
    } catch (...) {
      failure = std::current_exception();
    }
    // Told outside the handler: the handler's own reference to the error would otherwise be the
    // last one, dropped on this thread after the waiting thread has read and released it.
    if (failure) {
      abandon();
      return finish(std::move(failure));
    }
    if (!wait_for_event(next, std::move(armed))) return;
  }
}

bool AsyncAcquire::wait_for_event(const MachineStep& next, std::unique_ptr<WakeArm> armed) {
  std::lock_guard lock(mutex_);
  // No arm for a wait: the storage threw instead, and the next step tells what it means.
  if (next.kind == MachineStep::Kind::wait && !armed) woken_ = true;
  waiting_ = true;
  arm_ = std::move(armed);
  if (next.kind == MachineStep::Kind::pause) pause_timer_ = driver_.pool().post_at(next.until, waker());
  if (woken_) return true;  // an event came while the step ran (a wake, the deadline, a stop)
  scheduled_ = false;
  return false;
}

void AsyncAcquire::finish(std::exception_ptr error, std::optional<Deadline> leave_by) noexcept {
  std::unique_ptr<WakeArm> disarm;
  std::optional<AsyncPool::TimerId> timers[2];
  {
    std::lock_guard lock(mutex_);
    if (finished_) return;
    finished_ = true;
    scheduled_ = false;
    disarm = std::move(arm_);
    timers[0] = std::exchange(deadline_timer_, std::nullopt);
    timers[1] = std::exchange(pause_timer_, std::nullopt);
  }
  for (const auto& timer : timers) {
    if (timer) driver_.pool().cancel(*timer);
  }
  disarm.reset();
  follow_user_stop_.reset();  // a callback running on another thread is waited for
  if (leave_by) abandon(*leave_by);
  // Out of the driver before the handle is told: telling it may end the client (a callback
  // dropping its last handle), and with it the driver.
  auto self = shared_from_this();
  if (registered_) driver_.remove(this);
  deliver(std::move(error));
}

}  // namespace turnstile::detail
