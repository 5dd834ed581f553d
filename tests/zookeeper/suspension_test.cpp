// SPDX-License-Identifier: Apache-2.0
// A ZooKeeper connection lost while the session lives on suspends the holds of that session
// (Curator's SUSPENDED): they are not to be trusted until the same session reconnects, when
// they are held again, or until it may have expired, when they are lost.
//
// Each test runs a server of its own (tests/servers/zookeeper.sh) that it stops and restarts
// on the same port with its data: a standalone server keeps its sessions across a restart.
#include <gtest/gtest.h>

#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using turnstile::HoldState;
using namespace server_tests;

TEST(ZookeeperSuspension, ConnectionRegainedInTimeSuspendsThenResumesEveryHold) {
  OwnServer server(TURNSTILE_ZOOKEEPER_SCRIPT);
  // A session timeout long enough for the JVM to restart well within it.
  expect_outage_suspends_then_resumes(
      server.url(), 40s, [&] { ASSERT_EQ(server.stop(), 0); }, [&] { ASSERT_EQ(server.restart(), 0); });
}

TEST(ZookeeperSuspension, ConnectionDownPastTheSessionTimeoutLosesTheSuspendedHold) {
  OwnServer server(TURNSTILE_ZOOKEEPER_SCRIPT);
  HoldStateLog log;
  auto client = Client::connect(server.url(), log.options(2s));
  const auto name = unique_name("m");
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto lost = mutex.lost_token();

  ASSERT_EQ(server.stop(), 0);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 20s));
  EXPECT_EQ(log.states_of(name), (std::vector{HoldState::suspended, HoldState::lost}));
  EXPECT_EQ(mutex.hold_state(), HoldState::lost);

  // Reconnecting later does not make it held again (the server may have let another in
  // meanwhile); its release reports the loss and still removes its node.
  ASSERT_EQ(server.restart(), 0);
  auto other = Client::connect(server.url());
  EXPECT_EQ(mutex.hold_state(), HoldState::lost);
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  auto other_mutex = other.mutex(name);
  EXPECT_TRUE(other_mutex.try_lock_for(20s));
  other_mutex.unlock();
}

// The same outage as seen by Client::metrics(): one suspension for the lost connection, one loss
// by the loss rule (no renewal confirmed in time), and a reconnect once the server is back.
TEST(ZookeeperSuspension, MetricsCountTheSuspensionAndTheLossByCause) {
  OwnServer server(TURNSTILE_ZOOKEEPER_SCRIPT);
  auto options = with_ttl(2s);
  std::mutex events_mutex;
  std::vector<turnstile::EventKind> events;
  options.on_event = [&](const turnstile::Event& event) {
    std::lock_guard lock(events_mutex);
    if (!event.name.empty()) events.push_back(event.kind);
  };
  auto client = Client::connect(server.url(), options);
  auto mutex = client.mutex(unique_name("m"));
  mutex.lock();
  const auto lost = mutex.lost_token();
  const auto counted = [&](const char* family, const char* cause) {
    return client.metrics().value(family, {{"primitive", "mutex"}, {"cause", cause}});
  };

  ASSERT_EQ(server.stop(), 0);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 20s));
  EXPECT_EQ(counted("turnstile_holds_suspended_total", "connection_lost"), 1);
  EXPECT_EQ(client.metrics().value("turnstile_holds_suspended_total"), 1);
  EXPECT_EQ(counted("turnstile_holds_lost_total", "renewal_timeout"), 1);
  EXPECT_EQ(client.metrics().value("turnstile_holds_lost_total"), 1);

  ASSERT_EQ(server.restart(), 0);
  EXPECT_TRUE(eventually([&] { return client.metrics().value("turnstile_reconnects_total") >= 1; }, 30s));
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  // The hook runs on the client's own thread: its events come a moment later.
  EXPECT_TRUE(eventually([&] {
    std::lock_guard lock(events_mutex);
    return events.size() >= 4;
  }));
  std::lock_guard lock(events_mutex);
  EXPECT_EQ(events, (std::vector{turnstile::EventKind::acquired, turnstile::EventKind::suspended,
                                 turnstile::EventKind::lost, turnstile::EventKind::released}));
}

}  // namespace
