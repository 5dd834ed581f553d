// The options of `turnstile run` and `turnstile hold` checked before anything is touched, and
// the bounds they set on a lost hold.
#pragma once

#include <chrono>
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

// Bad usage found before anything is touched; empty when the options are fine. `run` needs a
// command; `hold` takes none.
std::string usage_problem(const RunOptions& o, bool needs_command);

}  // namespace turnstile::cli
