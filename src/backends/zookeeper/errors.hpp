// SPDX-License-Identifier: Apache-2.0
// The one place where ZooKeeper's answers become turnstile's typed errors, read by their code
// (never by where they came from): what the server said, connection trouble (the outcome is
// unknown), or the session gone. Every other file of the backend calls these.
#pragma once

#include <string>

#include "backends/zookeeper/session.hpp"
#include "core/backend.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::zookeeper {

// True when `rc` came from the server (so the server heard us), false for connection trouble.
bool server_answered(int rc);
// Connection trouble that a later attempt may not have: the outcome of the call is unknown.
bool connection_trouble(int rc);
// The session is gone (expired or closed): its ephemeral nodes are gone or going.
bool session_gone(int rc);

// Thrown by a wait on the connection that its bound's stop ended (the caller gave up; it never
// leaves the backend).
struct CallStopped {};

// Thrown inside the backend when its session went away. It never leaves the backend: a queue
// step makes it QueueEntryGone (our ephemeral entry went with the session: the core joins again,
// on a new one), any other call BackendUnavailable.
struct SessionGone {};

// Throws SessionGone when `rc` says the session is gone, or it is seen expired.
void check_session(const Session& session, int rc);

// A call given up at its bound while the connection was down (a BackendUnavailable to anyone
// but a waiter's look, which waits through the outage: EntryPlace::through_outages).
struct ConnectionGaveUp : BackendUnavailable {
  using BackendUnavailable::BackendUnavailable;
};

// `what` answered with `rc` (not ZOK, the session alive). `consequence` says what became of the
// call's effects, where that is not obvious.
[[noreturn]] void throw_error(const std::string& what, int rc, const std::string& consequence = "");

// A call that failed with `rc` and will not be tried again: the stop of its bound ends the step
// (CallStopped), else it is the server's or the link's error.
[[noreturn]] void give_up(const CallBudget& bound, const std::string& what, int rc);

// A change whose reply was lost and whose effect could not be read back in time.
[[noreturn]] void unconfirmed(const std::string& what, const std::string& consequence);

// Runs one step of a queue or counter line. A step that its stop ended is presented as our
// entry gone: the core, seeing the stop, gives up (and leaves) instead of joining again.
template <class Step>
auto queue_step(Step&& step) {
  try {
    return step();
  } catch (const SessionGone&) {
    throw QueueEntryGone{};
  } catch (const CallStopped&) {
    throw QueueEntryGone{};
  }
}

// Runs a call that is no queue step (inspect, the counter's changes).
template <class Call>
auto outside_queue(const std::string& what, Call&& call) {
  try {
    return call();
  } catch (const SessionGone&) {
    throw BackendUnavailable("the ZooKeeper session expired during " + what + "; a new one is being opened");
  }
}

}  // namespace turnstile::detail::zookeeper
