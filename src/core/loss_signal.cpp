// SPDX-License-Identifier: Apache-2.0
// A hold's state machine and how its holder is told (loss_signal.hpp).
#include "core/loss_signal.hpp"

#include "turnstile/error.hpp"

namespace turnstile::detail {

void LossSignal::lose(const std::string& reason, std::chrono::milliseconds margin) noexcept {
  std::lock_guard order(tell_mutex_);  // so a callback of this thread may lose it again (recursive)
  if (mark_lost(reason, margin)) tell_lost();
}

bool LossSignal::mark_lost(const std::string& reason, std::chrono::milliseconds margin) noexcept {
  std::lock_guard lock(mutex_);
  if (lost()) return false;  // only the first report counts, and calls back once
  reason_ = reason.empty() ? "unknown reason" : reason;
  margin_ = margin;
  state_.store(HoldState::lost, std::memory_order_release);
  return true;
}

void LossSignal::tell_lost() noexcept {
  std::lock_guard order(tell_mutex_);
  std::stop_source source{std::nostopstate};
  std::string reason;
  std::chrono::milliseconds margin;
  {
    std::lock_guard lock(mutex_);
    source = source_;  // a token() from now on sees the state and makes its state stopped
    reason = reason_;
    margin = margin_;
  }
  if (source.stop_possible()) source.request_stop();  // outside the lock: runs stop_callbacks
  tell(HoldState::lost, reason, margin);
}

void LossSignal::suspend(const std::string& reason) noexcept {
  std::lock_guard order(tell_mutex_);
  if (change_state(HoldState::suspended)) tell(HoldState::suspended, reason);
}

void LossSignal::resume() noexcept {
  std::lock_guard order(tell_mutex_);
  if (change_state(HoldState::held)) tell(HoldState::held, {});
}

bool LossSignal::change_state(HoldState next) noexcept {
  std::lock_guard lock(mutex_);
  if (lost() || state() == next) return false;
  state_.store(next, std::memory_order_release);
  return true;
}

void LossSignal::tell(HoldState state, const std::string& reason, std::chrono::milliseconds margin) noexcept {
  if (!callbacks_) return;
  const auto token = fencing_token_.load(std::memory_order_relaxed);
  // A throwing user callback must not take the backend's watcher thread down.
  try {
    if (state == HoldState::lost && callbacks_->on_lost) {
      callbacks_->on_lost(HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token) +
                                   ") may have been lost: " + reason));
    }
  } catch (...) {
  }
  try {
    if (callbacks_->on_state) {
      callbacks_->on_state(
          HoldStateChange{.name = name_, .fencing_token = token, .state = state, .reason = reason, .margin = margin});
    }
  } catch (...) {
  }
}

std::stop_token LossSignal::token() const {
  std::lock_guard lock(mutex_);
  if (!source_.stop_possible()) {
    source_ = std::stop_source();
    // No callback can be registered yet, so requesting here runs nothing under the lock.
    if (lost() || past_due()) source_.request_stop();
  }
  return source_.get_token();
}

std::string LossSignal::reason() const {
  std::lock_guard lock(mutex_);
  if (reason_.empty() && past_due()) return "no renewal was confirmed before its loss deadline";
  return reason_;
}

}  // namespace turnstile::detail
