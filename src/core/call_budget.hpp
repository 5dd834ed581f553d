// SPDX-License-Identifier: Apache-2.0
// How long one network call may wait, decided once for every backend.
//
// A caller brings a deadline (none: no limit of its own) and a stop token (a signal, a client's
// end, a MultiLock giving up). Every call it makes on the network ends by the earliest of the
// two, and within the backend's cap. One rule says how a call's own limit follows from the
// caller's: see CallBudget::call_end.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <utility>

#include "turnstile/deadline.hpp"

namespace turnstile::detail {

using std::chrono::milliseconds;

// True once `deadline` has come (never for "no deadline").
inline bool passed(const Deadline& deadline) { return deadline && *deadline <= SteadyClock::now(); }

// How one kind of call is bounded (values per backend in its time policy, time_policy.hpp).
struct CallLimits {
  // A call that must reach the server once to mean anything (a try-once join, a release, a
  // grant) still gets this much when its caller's deadline has passed or is nearer. Zero keeps
  // a passed deadline passed: the call is then not sent at all.
  milliseconds floor{0};
  // No single call waits longer, whatever its caller's deadline: an untimed caller hears of an
  // outage, and a stuck server gives way to the next one.
  milliseconds cap{5000};
};

// A caller's deadline and stop, carried together through every call it makes.
class CallBudget {
 public:
  CallBudget() = default;
  // A deadline alone is a budget (no stop): implicit so that `Deadline` arguments still fit.
  CallBudget(Deadline deadline) : deadline_(deadline) {}  // NOLINT(google-explicit-constructor)
  CallBudget(Deadline deadline, std::stop_token stop) : deadline_(deadline), stop_(std::move(stop)) {}

  const Deadline& deadline() const { return deadline_; }
  const std::stop_token& stop() const { return stop_; }
  bool stopped() const { return stop_.stop_requested(); }
  // The caller gave up or its time is over: no new call should start.
  bool passed() const { return stopped() || detail::passed(deadline_); }
  // Time left before the deadline (zero once passed); nullopt without a deadline.
  std::optional<milliseconds> left() const {
    if (!deadline_) return std::nullopt;
    const auto rest = std::chrono::ceil<milliseconds>(*deadline_ - SteadyClock::now());
    return std::max(rest, milliseconds(0));
  }

  // The one clamp rule: a call ends when the caller's deadline comes, but no later than `cap`
  // from now and no sooner than `floor` from now. So an untimed caller is still capped, a
  // passed deadline becomes `floor` (zero: stays passed), and a near one is lifted to `floor`.
  SteadyClock::time_point call_end(const CallLimits& limits) const { return call_end(limits, SteadyClock::now()); }
  // The same end as a timeout from now, for libraries that take one (libcurl, gRPC, zoo_*).
  // One reading of the clock: a passed deadline without a floor is a zero timeout, never 1 ms.
  milliseconds call_timeout(const CallLimits& limits) const {
    const auto now = SteadyClock::now();
    return std::max(std::chrono::ceil<milliseconds>(call_end(limits, now) - now), milliseconds(0));
  }
  // The budget of one call: the clamped end, the same stop.
  CallBudget for_call(const CallLimits& limits) const { return {call_end(limits), stop_}; }
  // A budget that ends by `other_end` too (whichever comes first), the same stop.
  CallBudget until(SteadyClock::time_point other_end) const {
    return {deadline_ ? std::min(*deadline_, other_end) : other_end, stop_};
  }

 private:
  SteadyClock::time_point call_end(const CallLimits& limits, SteadyClock::time_point now) const {
    const auto latest = now + limits.cap;
    const auto earliest = now + std::min(limits.floor, limits.cap);
    if (!deadline_) return latest;
    return std::clamp(*deadline_, earliest, latest);
  }

  Deadline deadline_;
  std::stop_token stop_;
};

// Sleeps `how_long`, but not past the budget's deadline, and ends at once on its stop: the one
// pause before a retry (a lost race, a node that did not answer, a dropped wait).
inline void pause_within(const CallBudget& budget, milliseconds how_long) {
  const auto until = *budget.until(SteadyClock::now() + how_long).deadline();
  if (until <= SteadyClock::now()) return;
  std::mutex mutex;
  std::condition_variable_any never_notified;
  std::unique_lock lock(mutex);
  never_notified.wait_until(lock, budget.stop(), until, [] { return false; });
}

}  // namespace turnstile::detail
