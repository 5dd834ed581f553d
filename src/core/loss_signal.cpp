// SPDX-License-Identifier: Apache-2.0
// A hold's state machine and how its holder is told (loss_signal.hpp).
#include "core/loss_signal.hpp"

#include "turnstile/error.hpp"

namespace turnstile::detail {

void LossSignal::lose(const std::string& reason, std::chrono::milliseconds margin, LossCause cause) noexcept {
  std::lock_guard order(tell_mutex_);  // so a callback of this thread may lose it again (recursive)
  if (mark_lost(reason, margin, cause)) tell_lost();
}

bool LossSignal::mark_lost(const std::string& reason, std::chrono::milliseconds margin, LossCause cause) noexcept {
  std::lock_guard lock(mutex_);
  if (lost()) return false;  // only the first report counts, and calls back once
  reason_ = reason.empty() ? "unknown reason" : reason;
  margin_ = margin;
  cause_ = cause;
  state_.store(HoldState::lost, std::memory_order_release);
  return true;
}

void LossSignal::tell_lost() noexcept {
  std::lock_guard order(tell_mutex_);
  std::stop_source source{std::nostopstate};
  std::string reason;
  std::chrono::milliseconds margin;
  LossCause cause = LossCause::other;
  {
    std::lock_guard lock(mutex_);
    source = source_;  // a token() from now on sees the state and makes its state stopped
    reason = reason_;
    margin = margin_;
    cause = cause_;
  }
  if (source.stop_possible()) source.request_stop();  // outside the lock: runs stop_callbacks
  if (cells_) count(cells_->lost[static_cast<std::size_t>(cause)]);
  meter(HoldState::lost, reason, to_string(cause));
  tell(HoldState::lost, reason, margin);
}

void LossSignal::suspend(const std::string& reason, SuspendCause cause) noexcept {
  std::lock_guard order(tell_mutex_);
  if (!change_state(HoldState::suspended)) return;
  if (cells_) count(cells_->suspended[static_cast<std::size_t>(cause)]);
  meter(HoldState::suspended, reason, to_string(cause));
  tell(HoldState::suspended, reason);
}

void LossSignal::resume() noexcept {
  std::lock_guard order(tell_mutex_);
  if (!change_state(HoldState::held)) return;
  meter(HoldState::held, {}, "");
  tell(HoldState::held, {});
}

void LossSignal::meter(HoldState state, const std::string& reason, const char* cause) noexcept {
  auto* telemetry = this->telemetry();
  if (!cells_ || !telemetry || !telemetry->tells_events()) return;
  try {
    const auto kind = state == HoldState::lost        ? EventKind::lost
                      : state == HoldState::suspended ? EventKind::suspended
                                                      : EventKind::resumed;
    auto event = Telemetry::event(kind, primitive_, name_, fencing_token_.load(std::memory_order_relaxed));
    event.outcome = cause;
    event.reason = reason;
    telemetry->tell(std::move(event));
  } catch (...) {
  }
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
