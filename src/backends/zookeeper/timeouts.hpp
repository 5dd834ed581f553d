// SPDX-License-Identifier: Apache-2.0
// The ZooKeeper backend's fixed waits, all in one place: its values of the core's TimePolicy,
// then the few that only ZooKeeper has.
#pragma once

#include <chrono>

#include "core/time_policy.hpp"

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

inline constexpr TimePolicy kZookeeperTimes{
    // Calls without a deadline of their own (counters, inspect, the first connection) wait this,
    // or a session timeout when that is longer (ZookeeperBackend::call_limits): a reconnect takes
    // the C client seconds, and a call must not give up on a session that is still alive.
    .call = {.floor = milliseconds(0), .cap = milliseconds(5000)},
    // A caller whose deadline has passed still waits this long for a new session, for its one
    // try (Connection::session); capped like any call.
    .one_shot = {.floor = milliseconds(1000), .cap = milliseconds(5000)},
    // A release, a downgrade, a leave and a background removal wait a third of the granted
    // timeout for their reply, at most this (Session::short_wait): long enough for a busy
    // server, short enough that an unlock never hangs on a silent link.
    .release_try = milliseconds(2000),
    // A leave is the same single delete as a release: the same wait (Session::short_wait).
    .leave_try = milliseconds(2000),
    // Removals whose outcome was unknown (GuaranteedRemoval), until done or their session ends
    // (it takes the nodes with it): within half a second of the link healing, as the old janitor did
    // (an entry left behind holds up everyone behind it). An attempt while the link is down sends
    // nothing (Session::connected), so the short pause costs no traffic.
    .background = {.first_pause = milliseconds(200), .last_pause = milliseconds(500), .give_up = std::nullopt},
    // Nothing is drained at the end: closing the session deletes every node a removal was for
    // (all of them are ephemeral), at once.
    .drain_at_end = milliseconds(0),
};

// The short wait (Session::short_wait) is a third of the granted timeout, at least this.
inline constexpr milliseconds kShortWaitMin{500};
// The first connection waits at most this (unless the session timeout is shorter).
inline constexpr milliseconds kMaxConnectWait{15000};
// A first connection not made this soon asks the refusal probe (core/refusal_probe.hpp)
// whether every server refuses: a local server answers well within it, so a healthy connect
// costs the servers no probe, and a refused one still fails within ~1/10 s.
inline constexpr milliseconds kRefusalProbeAfter{25};
// The probe waits this long at most for a server that neither accepts nor refuses (a dropped
// SYN): then the connect waits on, as for any server that might still answer.
inline constexpr milliseconds kRefusalProbeBound{1000};
// Between attempts after connection trouble: no busy loop while the link is down.
inline constexpr milliseconds kRetryPause{50};
// A call waiting for its reply looks this often whether its session expired meanwhile.
inline constexpr milliseconds kExpiryPoll{250};
// The keeper pings every third of the granted timeout, within these.
inline constexpr milliseconds kPingPeriodMin{50};
inline constexpr milliseconds kPingPeriodMax{1000};
// The C client resolves the host list at most this often (see Connection::open_session).
inline constexpr milliseconds kResolutionDelay{60'000};

}  // namespace turnstile::detail::zookeeper
