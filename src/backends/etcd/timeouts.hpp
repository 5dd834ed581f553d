// SPDX-License-Identifier: Apache-2.0
// Every time limit of the etcd backend, in one place, with the reason for its value: the shared
// ideas in kEtcdTimes (core/time_policy.hpp), then those only a gRPC client of etcd has.
#pragma once

#include <chrono>
#include <optional>

#include "core/time_policy.hpp"

namespace turnstile::detail::etcd {

using std::chrono::milliseconds;
using std::chrono::seconds;

// One attempt of a call: a stuck endpoint gives way to the next one this soon.
constexpr milliseconds kAttemptCap{2000};

// --- the shared vocabulary (core/time_policy.hpp) ------------------------------------------
inline constexpr TimePolicy kEtcdTimes{
    // Every call ends within 5 s and by its caller's deadline: long enough for a fail-over to
    // the next endpoint, short enough that an untimed caller hears of an outage.
    .call = {.floor = milliseconds(0), .cap = milliseconds(5000)},
    // A call that must reach etcd once to mean anything (a try-once join, a grant, a take) gets
    // one second even when its caller's deadline has passed: a round trip plus a reconnect.
    .one_shot = {.floor = milliseconds(1000), .cap = milliseconds(5000)},
    // Room for one fail-over: a whole attempt at a member that does not answer (a paused or
    // cut-off follower, kAttemptCap), then one round trip with connecting at the next
    // (one_shot's floor). With only one attempt, a release never reached a healthy member while
    // the one in use stalled.
    .release_try = kAttemptCap + milliseconds(1000),
    // A leave or a clean-up is tried this long in the caller's thread before the background
    // takes it over: a caller is not held up by an outage.
    .leave_try = milliseconds(500),
    // Background removals (leaves, settles, revokes) pause from 100 ms to 2 s between attempts,
    // and are tried until done, moot (their lease is gone: its keys went with it) or the end.
    .background = {.first_pause = milliseconds(100), .last_pause = milliseconds(2000), .give_up = std::nullopt},
    // The client's end tries what is still pending for up to a second, before it revokes the
    // lease (which takes every key on it; a take given back is the one removal not on it).
    .drain_at_end = milliseconds(1000),
};

// The look after a wait, when the deadline has passed meanwhile: one round trip.
inline constexpr CallLimits kLastLook{.floor = milliseconds(250), .cap = kEtcdTimes.call.cap};
// --- gRPC calls (etcd only) ------------------------------------------------------------
// Resent idempotent calls back off from the first to the last pause, doubling.
constexpr milliseconds kRetryFirstPause{25};
constexpr milliseconds kRetryLastPause{500};
// A re-authentication in the middle of a call whose own deadline has passed still gets this.
constexpr milliseconds kReauthenticateFloor{100};
// Connecting with a user name authenticates at once: the caller learns of wrong credentials.
constexpr milliseconds kConnectAuthentication{5000};
// gRPC reconnects after a restart or fail-over within these (its defaults wait up to 2 min):
// waiters and keep-alives depend on the connection.
constexpr milliseconds kReconnectFirst{100};
constexpr milliseconds kReconnectLast{1000};

// A channel not connected this soon at connect asks the refusal probe (core/refusal_probe.hpp)
// whether every endpoint refuses: a local etcd is up well within it, so a healthy connect costs
// etcd no probe, and a refused one still fails within ~1/10 s.
constexpr milliseconds kRefusalProbeAfter{25};
// The probe waits this long at most for an endpoint that neither accepts nor refuses.
constexpr milliseconds kRefusalProbeBound{1000};

// --- fork --------------------------------------------------------------------------------
// fork() waits this long for calls in flight (all have deadlines) before forking anyway.
constexpr milliseconds kForkQuiesce{3000};
// A cancelled stream is torn down on gRPC's executor threads; grpc_prefork deadlocks if that
// is still running (Debian's 1.51), so fork waits this long after cancelling streams.
constexpr milliseconds kForkTeardown{50};

// --- clean-up ----------------------------------------------------------------------------
// A stopped acquire still settles its take within one_shot's floor (the stop itself cut the
// take's reply): an endpoint that does not answer gives way to the next after this, so a stuck
// member does not take all of it. Not settled by then, the background settles it.
constexpr milliseconds kStoppedSettleAttempt{400};
// One background attempt (a removal, a watch's re-authentication, a held key's check): one
// endpoint's whole attempt (kAttemptCap), so a stuck member gives way at the next attempt.
constexpr milliseconds kBackgroundTry = kAttemptCap;
// A release of a hold already reported lost: its caller is not kept waiting on a dead link
// (the core retries it in the background).
constexpr milliseconds kLostReleaseTry{250};
// The client's end revokes its lease (its keys go at once rather than after the TTL) within.
constexpr milliseconds kRevokeAtEnd{1000};

// --- keep-alive --------------------------------------------------------------------------
// A keep-alive round every TTL/3 (etcd's own client's period), but not more often than this.
constexpr milliseconds kKeepAliveShortestPeriod{200};
// A round unanswered after min(period, this) suspends the holds; tried again after the pause.
constexpr milliseconds kKeepAlivePatience{1000};
constexpr milliseconds kKeepAliveRetryPause{100};

// --- watches -----------------------------------------------------------------------------
// A waiter's watch is renewed this often, so that no wait depends on one connection forever.
constexpr seconds kWaitWatchLife{30};
// A wait's watch that ended sooner than this (etcd restarting, a fork) is followed by a pause,
// so that a waiter does not spin.
constexpr milliseconds kWatchEndedAtOnce{50};
constexpr milliseconds kWatchRetryPause{100};
// The held keys' watch stream is renewed this often, for the same reason as a wait's.
constexpr seconds kKeyWatchLife{60};
// How long a release waits for its key's watch cancel to be written on the stream before its
// delete goes out (KeyWatcher::unwatch): a thread hand-over, not a round trip.
constexpr milliseconds kCancelWriteWait{50};
// A held keys' stream that lived shorter than this is not reopened at once.
constexpr seconds kKeyWatchShortLife{1};
// A hold released sooner is never watched (its release still finds a key gone, and reports
// the loss): short holds cost etcd no watch. Later holds are watched from the revision at
// which they were read as ours, so what happened meanwhile is still seen.
constexpr milliseconds kFirstKeyWatchDelay{20};

}  // namespace turnstile::detail::etcd
