// SPDX-License-Identifier: Apache-2.0
// The named time limits every backend has, in one vocabulary. A backend fills one TimePolicy
// (in its own folder, each value with a one-line why); the core and the shared services
// (guaranteed_removal.hpp) read it. A backend keeps further constants of its own only for
// what no other backend has (a gRPC reconnect, a ZooKeeper container check, ...).
#pragma once

#include <chrono>
#include <optional>

#include "core/call_budget.hpp"

namespace turnstile::detail {

// Background retries: the pause before the first retry, doubling up to `last_pause`, and for
// how long an item is retried at all (nullopt: until done or the client ends).
struct Backoff {
  milliseconds first_pause{100};
  milliseconds last_pause{2000};
  std::optional<milliseconds> give_up{};
  // The wait before an item's first attempt, when it differs from `first_pause` (zero: at the
  // next chance, e.g. a caller-driven service's next round); the pauses still start at
  // `first_pause`.
  std::optional<milliseconds> first_try{};
};

struct TimePolicy {
  // Ordinary calls: capped at `call.cap`; a call past its caller's deadline is not sent.
  CallLimits call{.floor = milliseconds(0), .cap = milliseconds(5000)};
  // A call that must reach the server once to mean anything (a try-once join, a grant, the
  // look after a wait whose deadline passed meanwhile).
  CallLimits one_shot{.floor = milliseconds(1000), .cap = milliseconds(5000)};
  // A release is tried this long in the caller's thread; then the background takes it over.
  milliseconds release_try{2000};
  // Leaving a queue (a given-up or failed acquire) is tried this long in the caller's thread.
  milliseconds leave_try{500};
  // Removals the caller's thread could not finish (guaranteed_removal.hpp).
  Backoff background{};
  // A client's end tries what is still pending in the background for at most this long.
  milliseconds drain_at_end{1000};
};

}  // namespace turnstile::detail
