// SPDX-License-Identifier: Apache-2.0
// PermitCounter changes on Consul applied at most once (counter_markers.hpp): a change whose
// reply was lost is told applied by its own request marker, however many other changes came
// between, and the markers of settled changes do not pile up. Against the Consul test stand-in.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "consul/consul_test_support.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using namespace consul_tests;

// Changes another client makes while a change's reply is held: more than the 32 request ids the
// counter's value once kept, so a test passes only if at-most-once does not depend on them.
constexpr int kChangesBetween = 40;

void add_one_each(const std::string& name, int times) {
  auto counter = turnstile::Client::connect(url()).permit_counter(name);
  for (int i = 0; i < times; ++i) counter.add_permits(1);
}

// A client whose calls go through a proxy, and its PermitCounter (the name's key in `key`).
class ConsulCounter : public ::testing::Test {
 protected:
  turnstile_test::TcpProxy proxy{url()};
  turnstile::Client client = turnstile::Client::connect(proxy.url_through(url()));
  std::string name = unique("counter");
  std::string key = "turnstile/c/" + name;
  turnstile::PermitCounter counter = client.permit_counter(name);
};

// Red team (issue 12): the reply of a counter change was lost after it applied; the resend's (or
// the retry's) CAS failed and was read as someone else's change, so the permits went twice.
TEST_F(ConsulCounter, AChangeWhoseReplyWasLostIsAppliedOnce) {
  ASSERT_EQ(counter.add_permits(1), 1);
  EXPECT_EQ(with_lost_reply<std::int64_t>(proxy, key, 1, [&] { return counter.add_permits(5); }), 6);
  EXPECT_EQ(counter.available_permits(), 6);
}

TEST_F(ConsulCounter, ATakeWhoseReplyWasLostTakesOnce) {
  ASSERT_EQ(counter.add_permits(10), 10);
  // The acquire reads the counter and its line, then takes.
  EXPECT_TRUE(with_lost_reply<bool>(proxy, key, 2, [&] { return counter.try_acquire(3); }));
  EXPECT_EQ(counter.available_permits(), 7);
}

// Issue 22 item 8 (red team, round 3): the reply of an add lost after it applied, then 40
// changes by another client, then the client's resend (or its look at the outcome): applied once.
TEST_F(ConsulCounter, AnAddWhoseReplyWasLostIsAppliedOnceHoweverManyChangesCameBetween) {
  ASSERT_TRUE(counter.try_set_permits(100));
  EXPECT_EQ(with_lost_reply<std::int64_t>(
                proxy, key, 1, [&] { return counter.add_permits(1); }, [&] { add_one_each(name, kChangesBetween); }),
            101);
  EXPECT_EQ(counter.available_permits(), 100 + 1 + kChangesBetween);
}

// The same for a take: an acquire of 1 reports taken once and takes 1, not 2.
TEST_F(ConsulCounter, ATakeWhoseReplyWasLostTakesOnceHoweverManyChangesCameBetween) {
  ASSERT_TRUE(counter.try_set_permits(100));
  EXPECT_TRUE(with_lost_reply<bool>(
      proxy, key, 2, [&] { return counter.try_acquire(1); }, [&] { add_one_each(name, kChangesBetween); }));
  EXPECT_EQ(counter.available_permits(), 100 - 1 + kChangesBetween);
}

// The same for a drain: it drains what it found once, and reports that amount.
TEST_F(ConsulCounter, ADrainWhoseReplyWasLostDrainsOnceHoweverManyChangesCameBetween) {
  ASSERT_TRUE(counter.try_set_permits(100));
  EXPECT_EQ(with_lost_reply<std::int64_t>(
                proxy, key, 1, [&] { return counter.drain_permits(); }, [&] { add_one_each(name, kChangesBetween); }),
            100);
  EXPECT_EQ(counter.available_permits(), kChangesBetween);
}

// The session of the client whose ClientOptions::holder_label is `label` ("" when none).
std::string session_named(const std::string& label) {
  const auto sessions = nlohmann::json::parse(curl("GET", "/v1/session/list"), nullptr, false);
  for (const auto& session : sessions) {
    if (session.value("Name", std::string()) == label) return session.value("ID", std::string());
  }
  return "";
}

// Every change writes a marker on the client's session; those of settled changes are removed
// in batches, so a long-lived client does not pile them up (and none is left after it ends).
TEST(ConsulCounterMarkers, TheMarkersOfSettledChangesAreRemoved) {
  const auto label = unique("markers-label");
  turnstile::ClientOptions options;
  options.holder_label = label;
  const auto name = unique("counter-markers");
  std::string session;
  {
    auto client = turnstile::Client::connect(url(), options);
    session = session_named(label);
    ASSERT_FALSE(session.empty());
    auto counter = client.permit_counter(name);
    constexpr int kChanges = 100;
    for (int i = 0; i < kChanges; ++i) counter.add_permits(1);
    const auto markers = "turnstile/x/" + session;
    ASSERT_GT(keys_under(markers), 0u) << "no markers written";
    EXPECT_TRUE(eventually([&] { return keys_under(markers) <= 32u; }, 5s)) << keys_under(markers) << " markers left";
    for (int i = 0; i < kChanges; ++i) ASSERT_TRUE(counter.try_acquire(1));
    EXPECT_TRUE(eventually([&] { return keys_under(markers) <= 32u; }, 5s)) << keys_under(markers) << " markers left";
    EXPECT_EQ(counter.available_permits(), 0);
  }
  EXPECT_EQ(keys_under("turnstile/x/" + session), 0u);
}

}  // namespace
