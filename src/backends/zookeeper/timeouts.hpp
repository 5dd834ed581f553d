// The ZooKeeper backend's fixed waits, all in one place.
#pragma once

#include <chrono>

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

// A housekeeping call (release, downgrade, removals, the janitor's, a try-once acquire's) waits
// a third of the granted timeout for its reply, within these: long enough for a busy server,
// short enough that an unlock never hangs on a silent link.
inline constexpr milliseconds kShortWaitMin{500};
inline constexpr milliseconds kShortWaitMax{2000};
// Calls without a deadline of their own (counters, inspect, the first connection, waiting for a
// new session) wait a session timeout, and at least this: a reconnect takes the C client seconds.
inline constexpr milliseconds kMinCallWait{5000};
// The first connection waits at most this (unless the session timeout is shorter).
inline constexpr milliseconds kMaxConnectWait{15000};
// A caller whose deadline has passed still waits this long for a new session, for its one try.
inline constexpr milliseconds kMinSessionWait{1000};
// Between attempts after connection trouble: no busy loop while the link is down.
inline constexpr milliseconds kRetryPause{50};
// A call waiting for its reply looks this often whether its session expired meanwhile.
inline constexpr milliseconds kExpiryPoll{250};
// The keeper pings every third of the granted timeout, within these.
inline constexpr milliseconds kPingPeriodMin{50};
inline constexpr milliseconds kPingPeriodMax{1000};
// The janitor tries again this often to remove orphans it could not remove.
inline constexpr milliseconds kJanitorRetry{200};
// The C client resolves the host list at most this often (see Connection::open_session).
inline constexpr milliseconds kResolutionDelay{60'000};

}  // namespace turnstile::detail::zookeeper
