// SPDX-License-Identifier: Apache-2.0
// What the conformance suite's network-fault tests share (faults_test.cpp, async_loss_test.cpp):
// a loopback proxy between a client and its server (tests/support/tcp_proxy.hpp), the TTLs and
// the documented loss bound, and the moment a hold was told it was lost (support/loss_time.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <stop_token>

#include "conformance/support.hpp"
#include "support/loss_time.hpp"
#include "support/tcp_proxy.hpp"

namespace conformance::faults {

using turnstile_test::LossTime;
using turnstile_test::TcpProxy;

inline constexpr auto kShortTtl = 3000ms;
// A TTL no test waits out: an entry gone well within it was removed, not expired.
inline constexpr auto kLongTtl = 10000ms;
// The proxy cuts the link only after this long without a request, so the last renewal the
// server confirmed was sent at least this long before the cut: room for the loss report's own
// scheduling, without loosening the bound asserted from the cut.
inline constexpr auto kQuiet = 50ms;

#define SKIP_WITHOUT_SERVER()                                                                                          \
  if (!has_server()) GTEST_SKIP() << "file:// holds live as long as their process: no server lease, no reply to lose"; \
  if (url().rfind("redis+sentinel:", 0) == 0 || url().rfind("redis+cluster:", 0) == 0)                                 \
  GTEST_SKIP() << "the proxy would stand between the client and the sentinels or one cluster node, not the nodes "     \
                  "serving the names (the redis family covers these faults; redis_sentinel_test and "                  \
                  "redis_cluster_test the failovers)"

// The documented loss rule: reported no later than the send time of the last confirmed renewal
// + TTL - max(TTL/10, 50 ms).
inline std::chrono::milliseconds loss_margin(std::chrono::milliseconds ttl) {
  return std::max<std::chrono::milliseconds>(ttl / 10, 50ms);
}

inline long long ms(Clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

inline turnstile::ClientOptions with_ttl(std::chrono::milliseconds ttl) {
  turnstile::ClientOptions options;
  options.ttl = ttl;
  return options;
}

// A client whose every connection goes through `proxy`.
inline turnstile::Client connect_through(const TcpProxy& proxy, const std::string& url,
                                         turnstile::ClientOptions options) {
  return turnstile::Client::connect(proxy.url_through(url), std::move(options));
}

// Client options with `ttl` that count every HoldLost reported, by on_hold_lost or the error
// handler (a background release that "finds its hold gone").
inline turnstile::ClientOptions counting_losses(std::chrono::milliseconds ttl, std::atomic<int>& losses) {
  auto options = with_ttl(ttl);
  options.on_hold_lost = [&losses](const turnstile::Error&) { ++losses; };
  options.error_handler = [&losses](const turnstile::Error& error) {
    if (error.code() == turnstile::ErrorCode::hold_lost) ++losses;
  };
  return options;
}

}  // namespace conformance::faults
