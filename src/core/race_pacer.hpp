// SPDX-License-Identifier: Apache-2.0
// Pacing for an acquire that lost a race: its versioned write was refused because someone moved
// first (QueueChanged, a counter take that found the value changed) or its entry vanished.
// Retrying is right — the state moved on, not wrong — but retrying at once, again and again, is
// a hot loop against a busy or flapping server. So: the first retry at once, then pauses that
// double from kFirstPause to kLastPause, none past the caller's deadline or stop; an acquire
// that will not wait (a try-once) gets kTryOnceRetries quick retries, then is not admitted.
#pragma once

#include <chrono>
#include <optional>

#include "core/call_budget.hpp"

namespace turnstile::detail {

class RacePacer {
 public:
  static constexpr milliseconds kFirstPause{10};
  static constexpr milliseconds kLastPause{500};
  static constexpr int kTryOnceRetries = 3;

  RacePacer(CallBudget budget, bool try_once) : budget_(std::move(budget)), try_once_(try_once) {}

  // Waits before the next retry. False when the acquire should end instead (not admitted).
  bool next() {
    const auto at = retry_at();
    if (!at) return false;
    pause_within(CallBudget(std::nullopt, budget_.stop()), std::chrono::ceil<milliseconds>(*at - SteadyClock::now()));
    return retry_after_pause();
  }

  // next() in two halves, for a driver that pauses without blocking a thread (the async one
  // sets a timer): when to retry (nullopt: end the acquire instead, not admitted), then, once
  // that time has come, whether to retry after all.
  std::optional<SteadyClock::time_point> retry_at() {
    ++retries_;
    if (budget_.stopped()) return std::nullopt;
    late_ = try_once_ || budget_.passed();
    std::optional<SteadyClock::time_point> at;
    if (late_) {
      if (retries_ > kTryOnceRetries) return std::nullopt;
      at = SteadyClock::now() + pause_ / 4;  // past the deadline: short, bounded
    } else {
      at = *budget_.until(SteadyClock::now() + pause_).deadline();
    }
    pause_ = pause_ == milliseconds(0) ? kFirstPause : std::min(pause_ * 2, kLastPause);
    return at;
  }
  bool retry_after_pause() const { return !budget_.stopped() && (late_ || !budget_.passed()); }

 private:
  CallBudget budget_;
  bool try_once_;
  milliseconds pause_{0};
  int retries_ = 0;
  bool late_ = false;  // the retry was granted past the deadline (a try-once's quick ones)
};

}  // namespace turnstile::detail
