// SPDX-License-Identifier: Apache-2.0
// Every wait of the Redis backend, in one place: the core's TimePolicy (kRedisTimes) and the
// constants only this backend has, each with its why.
#pragma once

#include <algorithm>
#include <chrono>

#include "backends/redis/settings.hpp"
#include "backends/redis/wire.hpp"
#include "core/time_policy.hpp"

namespace turnstile::detail::redis {

using std::chrono::milliseconds;

// Renewals: every TTL/3 but not more often than this; a round unanswered is retried after
// kMaxRenewalRetry at most (also the renewal connection's longest reconnect backoff, so a
// server back after a restart is found within it); a round waits kRenewalPatience at most.
inline constexpr milliseconds kMinRenewalPeriod{100};
// How long a reply owed on an idle command connection (a pipelined release's) may wait for a
// call on that connection to read it before the watchdog does; and how long that read may take.
inline constexpr milliseconds kCollectOwed{20};
inline constexpr milliseconds kCollectPatience{1000};
inline constexpr milliseconds kMaxRenewalRetry{250};
inline constexpr milliseconds kRenewalPatience{1000};

// The backend's time policy (core/time_policy.hpp).
inline constexpr TimePolicy kRedisTimes{
    // A call outside any acquire (downgrade, inspect, counter changes): one reply timeout, and a
    // passed deadline stays passed (one try within the connection's caps).
    .call = {.floor = milliseconds(0), .cap = kReplyTimeout},
    // A call that must reach the server once (a join, a counter's look, take or last try) gets
    // at least the floor to be answered even when the caller's deadline is nearer: on a healthy
    // server a short deadline then ends in the server's answer (admitted, or not: a timeout),
    // never in BackendUnavailable. A second covers a loaded server; an unreachable one holds it
    // up no longer. (Only the floor for an acquire's own call: see at_least_floor below.)
    .one_shot = {.floor = milliseconds(1000), .cap = kReplyTimeout},
    // How long a release waits for the server (see RedisHold::release and docs/backends/redis.md); then the
    // core retries it in the background.
    .release_try = milliseconds(1000),
    // Leaving a queue or a counter's line: bounded, so a giving-up waiter returns soon; what
    // fails is retired in the background (RedisBackend::retire_later).
    .leave_try = milliseconds(1000),
    // Retirements: first tried in the watchdog's next round (at once: before a late copy of the
    // request can land), then after pauses from 50 ms doubling up to a renewal round's retry;
    // tried for as long as the server remembers the request (request_memory(), set per client:
    // after that nothing could tell a late copy of it anyway).
    .background = {.first_pause = milliseconds(50),
                   .last_pause = kMaxRenewalRetry,
                   .give_up = std::nullopt,
                   .first_try = milliseconds(0)},
    // A client being destroyed gives its pending retirements this long in all.
    .drain_at_end = milliseconds(1000),
};

// A hold already reported lost gets one short release try (the caller must hear of the loss).
inline constexpr milliseconds kLostReleasePatience{250};
// How long the server remembers a client's requests (memory_ms in common_prelude.lua): at
// least this, and 2 TTLs (request_memory()).
inline constexpr milliseconds kMinRequestMemory{120'000};
// At a client's end each retirement try takes at most this (a link that stopped answering is
// left for a new one), so several tries fit in kRedisTimes.drain_at_end.
inline constexpr milliseconds kExitAttempt{250};
// How long a waiter waits for the server to confirm its SUBSCRIBE; unconfirmed, the watchdog's
// rounds (which wake a waiter whose entry is admitted) cover what it may miss.
inline constexpr milliseconds kSubscribeConfirm{1000};
// While this client has waiters, the watchdog's round (which renews their entries too, and wakes
// those it finds admitted or gone) comes at least this often (and every TTL/3), so no lost
// message strands a waiter.
inline constexpr milliseconds kMaxRecheck{2000};
// ?min_replicas=N: WAIT gets the caller's time left, but at least this.
inline constexpr milliseconds kMinReplicaWait{200};

// The deadline of an acquire's own call (a join, a look of a counter's line): the caller's, but
// at least the one-shot floor from now (none stays none). A deadline already passed (a
// try-once) gets the floor too, not the connection's own caps: a try-once ends within it (and
// its clean-up goes to the watchdog, see RedisPlace::join). Unlike CallBudget::call_end there
// is no cap: this call is the acquire's wait itself, which waits through an outage (reconnecting)
// until the caller's deadline, as docs/backends/redis.md promises; a cap would turn a long outage into an
// error before the deadline the caller chose.
inline Deadline at_least_floor(Deadline deadline) {
  if (!deadline) return deadline;
  return std::max(*deadline, SteadyClock::now() + kRedisTimes.one_shot.floor);
}

inline milliseconds request_memory(const Settings& settings) {
  return std::max<milliseconds>(kMinRequestMemory, 2 * settings.ttl);
}
}  // namespace turnstile::detail::redis
