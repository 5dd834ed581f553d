// SPDX-License-Identifier: Apache-2.0
// The options of `turnstile run` and `turnstile hold` checked before anything is touched, and
// the bounds they set on a lost hold.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

#include "commands.hpp"

namespace turnstile::cli {

// How long turnstile lets the group go on after the hold may have been lost, and what it then
// gives the release.
struct LossBounds {
  std::chrono::steady_clock::duration kill_after;  // SIGTERM, then SIGKILL this much later
  // After the group is gone or got SIGKILL: what is left for reaping it and the release.
  static constexpr auto kCleanUp = std::chrono::seconds(1);
};

// On loss, SIGKILL follows SIGTERM after --grace, but never later than half the safety margin
// by which the loss is reported before the server can hand the hold to someone else (the other
// half is left for the kill itself and the clocks' drift). The library tells that margin with
// the loss (HoldStateChange::margin, the granted TTL's); this bound from the TTL turnstile knows,
// max(TTL/10, 50 ms), is the fallback should it not arrive. Without a known TTL: half the margin
// of the shortest default TTL (etcd's 10 s).
LossBounds loss_bounds(const RunOptions& options, std::string_view url);

// What flock(1) users type, as given: a bare NAME (as `hold NAME`), -s/--shared,
// -x/-e/--exclusive, -n/--nonblock and -w/--wait SECONDS.
struct FlockForms {
  std::optional<std::string> name;
  bool shared = false, exclusive = false, nonblock = false;
  std::optional<double> wait_sec;
};

// Sets in `o` what the flock forms stand for: NAME is --lock NAME, with -s --read NAME, with -x
// --write NAME (-s and -x are the two sides of one SharedMutex, as flock's shared and exclusive
// locks on one file); -n is --timeout 0, -w is --timeout. The problem when they contradict the
// other options (nothing is set then), else "".
std::string adopt_flock_forms(const FlockForms& forms, RunOptions& o);

// --hold-at-least DURATION: a number of seconds, or one with a unit (ms, s, m, h, d); none
// when it is not a duration (0 to 1e9 s).
std::optional<std::chrono::milliseconds> parse_duration(std::string_view text);

// Bad usage found before anything is touched; empty when the options are fine. `run` needs a
// command; `hold` takes none.
std::string usage_problem(const RunOptions& o, bool needs_command);

}  // namespace turnstile::cli
