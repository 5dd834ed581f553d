// SPDX-License-Identifier: Apache-2.0
// Converting the standard's timeout forms into one steady-clock deadline.
#pragma once

#include <chrono>
#include <optional>

#include "turnstile/error.hpp"

namespace turnstile {

using SteadyClock = std::chrono::steady_clock;
// nullopt waits forever; a time in the past means "try once".
using Deadline = std::optional<SteadyClock::time_point>;

namespace detail {

// Anything longer than a century is "forever": it keeps the arithmetic from overflowing.
inline constexpr auto kForever = std::chrono::hours(24 * 365 * 100);

template <class Rep, class Period>
Deadline deadline_after(const std::chrono::duration<Rep, Period>& timeout) {
  if (timeout < std::chrono::duration<Rep, Period>::zero()) throw InvalidArgument("timeout must not be negative");
  if (timeout >= kForever) return std::nullopt;
  return SteadyClock::now() + std::chrono::ceil<SteadyClock::duration>(timeout);
}

template <class Clock, class Duration>
Deadline deadline_at(const std::chrono::time_point<Clock, Duration>& when) {
  if constexpr (std::is_same_v<Clock, SteadyClock>) {
    return std::chrono::time_point_cast<SteadyClock::duration>(when);
  } else {
    const auto left = when - Clock::now();
    if (left >= kForever) return std::nullopt;
    return SteadyClock::now() + std::chrono::ceil<SteadyClock::duration>(left);
  }
}

}  // namespace detail
}  // namespace turnstile
