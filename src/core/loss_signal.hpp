// SPDX-License-Identifier: Apache-2.0
// A hold's state machine (held, suspended, lost) and how its holder is told (loss_signal.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>

#include "core/telemetry.hpp"
#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

// How a hold learns its state: lost (final; a stop_source the holder's stop_token watches) or
// suspended (the backend cannot confirm it now, but it may be alive), plus the client's
// callbacks. Backends call lose(), suspend() and resume(); each is idempotent, and the last two
// do nothing once lost. Made on every acquire, so it is cheap: the stop state is allocated
// only when someone asks for a token, and the callbacks are shared with the client.
class LossSignal {
 public:
  struct Callbacks {
    ErrorHandler on_lost;
    HoldStateHandler on_state;
    // Counts the holds' suspensions and losses and tells them as events (a hold's own signal
    // has one; a backend's internal signals have none).
    std::shared_ptr<Telemetry> telemetry;
  };
  // `cells`: where a hold of `primitive` (a metered() index) counts its suspensions, losses and
  // hold time; owned by the callbacks' telemetry.
  LossSignal(std::string name, std::shared_ptr<const Callbacks> callbacks, std::size_t primitive = 0,
             PrimitiveCells* cells = nullptr)
      : name_(std::move(name)), callbacks_(std::move(callbacks)), primitive_(primitive), cells_(cells) {}
  void lose(const std::string& reason, std::chrono::milliseconds margin = std::chrono::milliseconds(0),
            LossCause cause = LossCause::other) noexcept;
  void lose(const std::string& reason, LossCause cause) noexcept { lose(reason, std::chrono::milliseconds(0), cause); }
  // lose() in two steps, so that many holds can all be marked lost before any one's callbacks
  // run (a slow callback must not delay another hold's report): mark_lost() changes the state
  // (false when it was lost already), tell_lost() signals the token and calls the callbacks.
  // `margin`: how long before the server could hand the hold to someone else (0: it may have).
  bool mark_lost(const std::string& reason, std::chrono::milliseconds margin, LossCause cause) noexcept;
  void tell_lost() noexcept;
  void suspend(const std::string& reason, SuspendCause cause = SuspendCause::renewal_unanswered) noexcept;
  void resume() noexcept;
  HoldState state() const noexcept { return state_.load(std::memory_order_acquire); }
  // What the holder is shown: state(), except that a hold whose loss deadline has passed is
  // lost already, even before the loss clock's thread has run to say so (a process resumed
  // from a pause past its TTL may read its state first).
  HoldState observed_state() const noexcept {
    const auto state = this->state();
    return state != HoldState::lost && past_due() ? HoldState::lost : state;
  }
  bool past_due() const noexcept {
    const auto due = due_.load(std::memory_order_acquire);
    return due != kNoDue && SteadyClock::now().time_since_epoch().count() >= due;
  }
  // When the hold's server lease may be gone (set by its ServerLease; none by default).
  void set_due(SteadyClock::time_point due) noexcept {
    due_.store(due.time_since_epoch().count(), std::memory_order_release);
  }
  bool lost() const noexcept { return state() == HoldState::lost; }
  // lost(), or past its loss deadline (what a release must report: its call may have been cut
  // by token() before the loss clock's thread marked the hold lost).
  bool lost_by_now() const noexcept { return observed_state() == HoldState::lost; }
  std::string reason() const;  // why it was lost (or that its deadline passed)
  // Stopped once lost, and when first asked for past the deadline (as observed_state); a token
  // asked for earlier is stopped by the loss clock's thread, which is due then too.
  std::stop_token token() const;
  // Called once the hold exists, while the backend's watcher may already be calling lose().
  void set_fencing_token(std::uint64_t token) { fencing_token_.store(token, std::memory_order_relaxed); }
  const std::string& name() const { return name_; }
  // The hold's metering (see the constructor): nullptr cells when it has none.
  std::size_t primitive() const { return primitive_; }
  PrimitiveCells* cells() const { return cells_; }
  Telemetry* telemetry() const { return callbacks_ ? callbacks_->telemetry.get() : nullptr; }

 private:
  // Moves to `next` unless lost; false when nothing changed.
  bool change_state(HoldState next) noexcept;
  void tell(HoldState state, const std::string& reason, std::chrono::milliseconds margin = {}) noexcept;
  // Counts the change in the hold's cells and tells it to the event hook, if any.
  void meter(HoldState state, const std::string& reason, const char* cause) noexcept;

  std::string name_;
  std::shared_ptr<const Callbacks> callbacks_;
  std::size_t primitive_;
  PrimitiveCells* cells_;
  std::atomic<std::uint64_t> fencing_token_{0};
  std::atomic<HoldState> state_{HoldState::held};
  static constexpr SteadyClock::rep kNoDue = std::numeric_limits<SteadyClock::rep>::max();
  std::atomic<SteadyClock::rep> due_{kNoDue};
  mutable std::mutex mutex_;
  mutable std::stop_source source_{std::nostopstate};  // made by the first token()
  std::string reason_;
  std::chrono::milliseconds margin_{0};
  LossCause cause_ = LossCause::other;
  // Held from a change through its callbacks, so a hold's changes are told in order.
  // Recursive: a callback may release the hold, and the release may find it lost.
  std::recursive_mutex tell_mutex_;
};

}  // namespace turnstile::detail
