// Every inline wait of the Redis backend, in one place.
#pragma once

#include <algorithm>
#include <chrono>

#include "backends/redis/settings.hpp"
#include "backends/redis/wire.hpp"

namespace turnstile::detail::redis {

using std::chrono::milliseconds;

// A call outside any acquire (downgrade, inspect, counter changes): one reply timeout.
inline constexpr milliseconds kCallPatience = kReplyTimeout;
// How long a release waits for the server (see RedisHold::release and the README); a hold
// already reported lost gets one short try.
inline constexpr milliseconds kReleasePatience{1000};
inline constexpr milliseconds kLostReleasePatience{250};
// Leaving a queue or a counter's line: bounded, so a giving-up waiter returns soon; what fails
// is retired by the watchdog (retire_later).
inline constexpr milliseconds kLeavePatience{1000};
// How long the server remembers a client's requests (memory_ms in common_prelude.lua): at
// least this, and 2 TTLs (request_memory()). A request given up without an answer is retired
// in the background (an orphan) until it is answered, for as long at most: after that nothing
// could tell a late copy of it anyway.
inline constexpr milliseconds kMinRequestMemory{120'000};
// A client being destroyed gives its pending retirements (orphans) this long in all, each try
// at most kExitAttempt (a link that stopped answering is left for a new one), trying again
// after kExitRetryPause while they go unanswered.
inline constexpr milliseconds kExitRetirePatience{1000};
inline constexpr milliseconds kExitAttempt{250};
inline constexpr milliseconds kExitRetryPause{50};
// How long a waiter waits for the server to confirm its SUBSCRIBE; unconfirmed, the watchdog's
// rounds (which wake a waiter whose entry is admitted) cover what it may miss.
inline constexpr milliseconds kSubscribeConfirm{1000};
// While this client has waiters, the watchdog's round (which renews their entries too, and wakes
// those it finds admitted or gone) comes at least this often (and every TTL/3), so no lost
// message strands a waiter.
inline constexpr milliseconds kMaxRecheck{2000};
// Renewals: every TTL/3 but not more often than this; a round unanswered is retried after
// kMaxRenewalRetry at most (also the renewal connection's longest reconnect backoff, so a
// server back after a restart is found within it); a round waits kRenewalPatience at most.
inline constexpr milliseconds kMinRenewalPeriod{100};
inline constexpr milliseconds kMaxRenewalRetry{250};
inline constexpr milliseconds kRenewalPatience{1000};
// A call that must reach the server once (a join, a counter's look, take or last try) gets at
// least this to be answered even when the caller's deadline is nearer: on a healthy server a
// short deadline then ends in the server's answer (admitted, or not: a timeout), never in
// BackendUnavailable. A second covers a loaded server; an unreachable one holds it up no longer.
inline constexpr milliseconds kOneShotFloor{1000};
// ?min_replicas=N: WAIT gets the caller's time left, but at least this.
inline constexpr milliseconds kMinReplicaWait{200};

inline milliseconds request_memory(const Settings& settings) { return std::max<milliseconds>(kMinRequestMemory, 2 * settings.ttl); }
}  // namespace turnstile::detail::redis
