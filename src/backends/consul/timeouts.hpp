// SPDX-License-Identifier: Apache-2.0
// The Consul backend's waits, each in one place with why: its values of the core's TimePolicy
// (core/time_policy.hpp), then the few only Consul has (blocking queries, lock-delays, resends).
#pragma once

#include <chrono>

#include "core/call_budget.hpp"
#include "core/time_policy.hpp"

namespace turnstile::detail::consul {

using std::chrono::milliseconds;

inline constexpr TimePolicy kConsulTimes{
    // A Consul answer takes milliseconds; past 10 s the server is unreachable for this call (the
    // caller's deadline may end it sooner). A passed deadline sends nothing.
    .call = {.floor = milliseconds(0), .cap = milliseconds(10000)},
    // A call that must reach Consul once to mean anything (a try-once join, a hold's take, the
    // look after a wait, a settling) gets 1 s however little is left: it may overrun its caller's
    // deadline by that much when the server stalls, rather than fail a call a healthy server
    // answers at once.
    .one_shot = {.floor = milliseconds(1000), .cap = milliseconds(10000)},
    // A release or a downgrade: then the core retries a failed release in the background.
    .release_try = milliseconds(2000),
    // A leave (a waiter that gave up): then the background takes it over.
    .leave_try = milliseconds(500),
    // What a leave, a given-up join or an unknown outcome left: tried again soon (a lost reply
    // on a link that is back at once), less often on a long outage, given up after a minute
    // (the entries and markers are on sessions that end with the client anyway).
    .background = {.first_pause = milliseconds(100), .last_pause = milliseconds(2000), .give_up = milliseconds(60000)},
    // A client's end tries the pending removals this long, before its sessions are destroyed.
    .drain_at_end = milliseconds(1000),
};

// A release of a hold already reported lost gets only this: its caller is not kept waiting on a
// dead link for what the session's end removes anyway.
inline constexpr milliseconds kLostReleaseTry{250};
// A blocking query's longest `wait`: the waiter then looks again (Consul's default is 5 min).
inline constexpr milliseconds kBlockingWaitMax{60000};
// Beyond `wait`, Consul adds up to wait/16 of jitter; plus room for the answer itself.
inline constexpr milliseconds kBlockingSlack{2000};
// A blocking query cut at the caller's deadline may end this much later (curl's own timer).
inline constexpr milliseconds kDeadlineGrace{50};
// After an acquire refused by a lock-delay, look again this soon (api.Lock waits 5 s).
inline constexpr milliseconds kLockDelayRetry{1000};
// A call that found no server, or a CAS that lost to someone else's change, is tried again after
// this pause, doubling up to kResendBackoffMax: an outage (a restart) is waited through within
// the caller's deadline, and a busy peer is never answered with a hot loop.
inline constexpr milliseconds kResendBackoff{50};
inline constexpr milliseconds kResendBackoffMax{1000};
// How many times a CAS that lost a race (a release's `.lock`, a counter's value) is tried
// before its caller hears of it: each try follows the pause above.
inline constexpr int kCasRaces = 32;

// One background removal's call: kConsulTimes.one_shot.floor, or less when the removal service
// says so (a client's end drains for drain_at_end); nullopt once that has passed (not sent).
inline std::optional<milliseconds> removal_timeout(const CallBudget& budget) {
  if (budget.passed()) return std::nullopt;
  const auto timeout = budget.call_timeout({.floor = milliseconds(0), .cap = kConsulTimes.one_shot.floor});
  return std::max(timeout, milliseconds(1));
}

}  // namespace turnstile::detail::consul
