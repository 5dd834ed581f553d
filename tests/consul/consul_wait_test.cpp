// SPDX-License-Identifier: Apache-2.0
// Consul waiters wake on every change that can admit them (issue 22, item 12), against the
// Consul test stand-in (tests/servers/consul_server.py; not Consul).
#include <gtest/gtest.h>

#include <future>

#include <nlohmann/json.hpp>

#include "consul/consul_test_support.hpp"

namespace {

using namespace std::chrono_literals;
using namespace consul_tests;

// Limit 2: one lease holds, and a lease ahead of ours is admitted (1 + 1 fits) but does not hold
// yet: it has only its queue entry (turnstile/q/…), as a turnstile client between its admission
// and its hold transaction. Ours (1 more) waits for any holder to leave. The lease ahead leaves
// before holding, which changes only turnstile/q/…, not NAME/: a permit is free and ours must be
// admitted at once, not after the blocking query's 60 s wait.
TEST(ConsulWait, ALeaseWaiterIsAdmittedWhenAnAdmittedLeaseAheadLeavesBeforeHolding) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("admitted-ahead");
  auto semaphore = client.semaphore(name, 2);
  auto held = semaphore.try_acquire();
  ASSERT_TRUE(held.has_value());
  const auto session = peer_session();
  const auto ahead = "turnstile/q/" + name + "/" + session + "-1";
  ASSERT_EQ(curl("PUT", "/v1/kv/" + ahead + "?acquire=" + session, R"({"kind":"lease","permits":1,"limit":2})"),
            "true");

  auto other = turnstile::Client::connect(url());
  // No deadline: one would cut the blocking query short (at 16/17 of what is left) and its next
  // look would admit the waiter anyway. A stop ends it instead when the test has seen enough.
  std::stop_source give_up;
  auto waiter = std::async(std::launch::async,
                           [&] { return other.semaphore(name, 2).acquire(1, give_up.get_token()).has_value(); });
  // Really waiting: its entry is in the queue behind the one ahead, and it is not admitted.
  ASSERT_TRUE(eventually([&] { return keys_under("turnstile/q/" + name + "/") == 3; }, 5s));
  const auto not_yet = waiter.wait_for(1s);
  if (not_yet != std::future_status::timeout) give_up.request_stop();
  ASSERT_EQ(not_yet, std::future_status::timeout) << "admitted with no permit free";

  ASSERT_EQ(curl("DELETE", "/v1/kv/" + ahead), "true");
  const auto admitted = waiter.wait_for(7s);
  give_up.request_stop();
  EXPECT_EQ(admitted, std::future_status::ready) << "still waiting 7 s after a permit became free";
  EXPECT_TRUE(waiter.get());
  curl("PUT", "/v1/session/destroy/" + session);
}

}  // namespace
