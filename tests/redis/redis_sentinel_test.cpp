// SPDX-License-Identifier: Apache-2.0
// redis+sentinel://: the primary found through the sentinels, holds reported lost when the primary
// changes (SENTINEL FAILOVER, kill -9), waiters served by the new primary, and ?min_replicas=N.
//
// Tests that disturb the set-up start one of their own (tests/servers/redis_sentinel.sh); the
// others use the suite's fixture (TURNSTILE_REDIS_SENTINEL_URL_FILE).
#include <cstdlib>
#include <filesystem>
#include <future>
#include <thread>

#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;

// A sentinel set-up of a test's own: p1 p2 (data), s1 s2 s3 (sentinels).
class SentinelSet {
 public:
  const std::string& url() const { return set_.url(); }
  int run(const std::string& action, const std::string& id = "") { return set_.action(action, id); }
  std::string leader() { return shell(std::string(TURNSTILE_REDIS_SENTINEL_SCRIPT) + " leader " + set_.dir()); }
  // redis://127.0.0.1:PORT of a data node.
  std::string node_url(const std::string& id) {
    return "redis://127.0.0.1:" + shell("awk '$1 == \"" + id + "\" { print $4 }' " + set_.dir() + "/nodes");
  }
  bool healthy_within(std::chrono::milliseconds bound) {
    return eventually([&] { return run("healthy") == 0; }, bound);
  }

 private:
  OwnServer set_{TURNSTILE_REDIS_SENTINEL_SCRIPT};
};

// The hash of a name's queue on a server, as redis-cli shows its fields.
std::string queue_fields(const std::string& node_url, const std::string& name) {
  return redis_cli(node_url, "HKEYS " + quoted("turnstile:{" + name + "}:q"));
}

class RedisSentinel : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_SENTINEL_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_SENTINEL_URL_FILE
                               << " (did the redis_sentinel_server fixture run?)";
  }
  std::string url_;
};

TEST_F(RedisSentinel, DiscoversThePrimaryLocksAndHandsOver) {
  auto client = Client::connect(url_);
  auto other = Client::connect(url_);
  const auto name = unique_name("basic");
  expect_handover(client, other, name);
}

TEST_F(RedisSentinel, MinReplicasWithTheReplicaUpAcquires) {
  auto client = Client::connect(url_ + "?min_replicas=1");
  auto mutex = client.mutex(unique_name("replicated"));
  ASSERT_TRUE(mutex.try_lock_for(5s));
  mutex.unlock();
  // On redis:// too (the primary's own address, found through the sentinels' answer).
  const auto sentinel = url_.substr(url_.find("//") + 2, url_.find(',') - url_.find("//") - 2);
  const auto address =
      shell("redis-cli -h " + sentinel.substr(0, sentinel.find(':')) + " -p " +
            sentinel.substr(sentinel.find(':') + 1) + " SENTINEL get-master-addr-by-name turnstile | paste -sd:");
  auto direct = Client::connect("redis://" + address + "?min_replicas=1");
  auto same = direct.mutex(mutex.name());
  ASSERT_TRUE(same.try_lock_for(5s));
  same.unlock();
}

TEST_F(RedisSentinel, BadUrlsAreRefusedAndSecretsNeverShown) {
  const auto hosts = url_.substr(0, url_.rfind('/'));  // redis+sentinel://h1,h2,h3
  for (const auto* bad : {"?min_replicas=-1", "?min_replicas=101", "?min_replicas=x", "?min_replicas=", "?bogus=1"}) {
    EXPECT_THROW(Client::connect(url_ + bad), turnstile::InvalidUrl) << bad;
  }
  EXPECT_THROW(Client::connect(hosts), turnstile::InvalidUrl) << "no master name";
  EXPECT_THROW(Client::connect(hosts + "/a/b"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:1?min_replicas=two"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect(hosts + "/turnstile?sentinel_password="), turnstile::InvalidUrl);
  try {
    Client::connect(hosts + "/no-such-master");
    ADD_FAILURE() << "an unknown master name connected";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("no-such-master"), std::string::npos) << error.what();
  }
  // These sentinels have no password: one given is refused, and never shown.
  try {
    Client::connect(url_ + "?sentinel_password=s3cr3t-sentinel");
    ADD_FAILURE() << "a wrong sentinel password connected";
  } catch (const turnstile::AccessDenied& error) {
    EXPECT_EQ(std::string(error.what()).find("s3cr3t-sentinel"), std::string::npos) << error.what();
  }
  try {
    Client::connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/turnstile?sentinel_password=s3cr3t-sentinel");
    ADD_FAILURE() << "unreachable sentinels connected";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_EQ(std::string(error.what()).find("s3cr3t-sentinel"), std::string::npos) << error.what();
  }
  auto client = Client::connect(url_ + "?ttl=5");
  EXPECT_EQ(client.url(), url_ + "?ttl=5");
}

TEST(RedisSentinelFaults, FailoverReportsHoldsLostAndServesWaitersOnTheNewPrimary) {
  SentinelSet set;
  // The sentinels switch within about a second; the demoted primary keeps accepting writes
  // until they reconfigure it (about 10 s later), so the holder learns of it from its next
  // renewal round's question to the sentinels: within a renewal period (5 s) of the switch.
  expect_failover_reported(
      set.url(), unique_name("failover"), [&] { return set.leader(); },
      [&](const std::string&) { ASSERT_EQ(set.run("failover"), 0); }, 8s);
}

TEST(RedisSentinelFaults, KilledPrimaryReportsHoldsLostAndServesWaitersOnTheNewPrimary) {
  SentinelSet set;
  // down-after-milliseconds 1000, then a vote and a promotion: a few seconds, below the TTL's
  // 13.5 s loss bound, so only the change of primary can have reported the loss.
  expect_failover_reported(
      set.url(), unique_name("failover"), [&] { return set.leader(); },
      [&](const std::string& primary) { ASSERT_EQ(set.run("kill", primary), 0); }, 10s);
}

// Red team, issue 22 round 3 (item 17): ?eviction=refuse (the default) checks each primary a
// failover brings, not only the one found at connect: a client connected before the failover
// took new holds on an allkeys-lru primary without a word.
TEST(RedisSentinelFaults, AnEvictingPrimaryAfterAFailoverIsRefused) {
  SentinelSet set;
  ASSERT_TRUE(set.healthy_within(10s));
  const auto replica = set.leader() == "p1" ? "p2" : "p1";
  ASSERT_EQ(redis_cli(set.node_url(replica), "CONFIG SET maxmemory-policy allkeys-lru"), "OK");
  // Its watchdog asks the sentinels every 500 ms (TTL/3): the old primary, which may accept
  // writes for seconds after the failover, is left within that.
  auto client = Client::connect(set.url(), with_ttl(1500ms));
  auto before = client.mutex(unique_name("evicting-before"));
  ASSERT_TRUE(before.try_lock_for(2s)) << "the first primary does not evict";
  before.unlock();
  ASSERT_EQ(set.run("failover"), 0);
  ASSERT_EQ(set.leader(), replica);
  std::this_thread::sleep_for(800ms);
  auto after = client.mutex(unique_name("evicting-after"));
  try {
    const bool got = after.try_lock_for(3s);
    ADD_FAILURE() << "a lock on an allkeys-lru primary was " << (got ? "taken" : "waited for");
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("maxmemory-policy allkeys-lru"), std::string::npos) << error.what();
  }
}

TEST(RedisSentinelFaults, MinReplicasWithoutTheReplicaFailsAndLeavesNothing) {
  SentinelSet set;
  const auto primary = set.leader();
  const auto replica = primary == "p1" ? "p2" : "p1";
  ASSERT_EQ(set.run("kill", replica), 0);
  auto client = Client::connect(set.url() + "?min_replicas=1");
  const auto name = unique_name("unreplicated");
  auto mutex = client.mutex(name);
  const auto started = std::chrono::steady_clock::now();
  EXPECT_THROW(mutex.try_lock_for(1s), turnstile::NotReplicated);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 4s);
  try {
    mutex.try_lock_for(500ms);
  } catch (const turnstile::NotReplicated& error) {
    EXPECT_EQ(error.code(), turnstile::ErrorCode::not_replicated);
    EXPECT_NE(std::string(error.what()).find("min_replicas"), std::string::npos) << error.what();
  }
  // No entry left on the primary: only the fencing counter and release memory.
  const auto fields = queue_fields(set.node_url(primary), name);
  for (std::size_t at = 0, end; at < fields.size(); at = end + 1) {
    end = fields.find('\n', at);
    if (end == std::string::npos) end = fields.size();
    const auto field = fields.substr(at, end - at);
    EXPECT_TRUE(field == "seq" || field.rfind("r:", 0) == 0) << "left behind: " << field << " in\n" << fields;
  }
  // Without min_replicas the same name is free at once.
  auto plain = Client::connect(set.url());
  auto same = plain.mutex(name);
  EXPECT_TRUE(same.try_lock());
  same.unlock();
  // With the replica back, min_replicas=1 acquires again.
  ASSERT_EQ(set.run("start-node", replica), 0);
  ASSERT_TRUE(set.healthy_within(30s));
  EXPECT_TRUE(mutex.try_lock_for(5s));
  mutex.unlock();
}

}  // namespace
