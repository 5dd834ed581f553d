// Pacing for an acquire that lost a race: its versioned write was refused because someone moved
// first (QueueChanged, a counter take that found the value changed) or its entry vanished.
// Retrying is right — the state moved on, not wrong — but retrying at once, again and again, is
// a hot loop against a busy or flapping server. So: the first retry at once, then pauses that
// double from kFirstPause to kLastPause, none past the caller's deadline or stop; an acquire
// that will not wait (a try-once) gets kTryOnceRetries quick retries, then is not admitted.
#pragma once

#include <chrono>

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
    ++retries_;
    if (budget_.stopped()) return false;
    if (try_once_ || budget_.passed()) {
      if (retries_ > kTryOnceRetries) return false;
      pause_within(CallBudget(std::nullopt, budget_.stop()), pause_ / 4);  // past the deadline: short, bounded
    } else {
      pause_within(budget_, pause_);
      if (budget_.passed()) return false;
    }
    pause_ = pause_ == milliseconds(0) ? kFirstPause : std::min(pause_ * 2, kLastPause);
    return !budget_.stopped();
  }

 private:
  CallBudget budget_;
  bool try_once_;
  milliseconds pause_{0};
  int retries_ = 0;
};

}  // namespace turnstile::detail
