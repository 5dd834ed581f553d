// SPDX-License-Identifier: Apache-2.0
// redis+cluster://: names spread over every primary, slots as the servers compute them, MOVED
// after a slot is moved, ASK while it is being moved, holds reported lost when their slot's
// primary changes (CLUSTER FAILOVER, kill -9 of a primary) before a waiter is admitted on the new
// one, ?min_replicas=N, and bad URLs and secrets.
//
// Tests that disturb the cluster start one of their own (tests/servers/redis_cluster.sh); the
// others use the suite's fixture (TURNSTILE_REDIS_CLUSTER_URL_FILE).
#include <atomic>
#include <future>
#include <set>
#include <thread>

#include "backends/redis/cluster.hpp"
#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using turnstile::detail::redis::key_slot;
using turnstile::detail::redis::tag_for_slot;

// The key of a name's queue (the backend's layout: turnstile:{NAME}:q).
std::string queue_key(const std::string& name) { return "turnstile:{" + name + "}:q"; }

// A cluster set-up: n1..n6 (three primaries, a replica each), its directory and its script.
class ClusterNodes {
 public:
  ClusterNodes(std::string dir, std::string url) : dir_(std::move(dir)), url_(std::move(url)) {}
  const std::string& url() const { return url_; }
  std::string script(const std::string& action, const std::string& argument = "") const {
    return shell(std::string(TURNSTILE_REDIS_CLUSTER_SCRIPT) + " " + action + " " + dir_ + " " + quoted(argument));
  }
  int run(const std::string& action, const std::string& argument = "") const {
    return std::system((std::string(TURNSTILE_REDIS_CLUSTER_SCRIPT) + " " + action + " " + dir_ +
                        (argument.empty() ? "" : " " + quoted(argument)) + " >/dev/null 2>&1")
                           .c_str());
  }
  std::string port(const std::string& id) const {
    return shell("awk '$1 == \"" + id + "\" { print $4 }' " + dir_ + "/nodes");
  }
  // redis-cli on node ID.
  std::string cli(const std::string& id, const std::string& arguments) const {
    return shell("redis-cli -h 127.0.0.1 -p " + port(id) + " " + arguments);
  }
  // The node serving `key`'s slot, by the cluster's own view.
  std::string owner(const std::string& key) const { return script("owner", key); }
  bool healthy_within(std::chrono::milliseconds bound) const {
    return eventually([&] { return run("healthy") == 0; }, bound);
  }

 private:
  std::string dir_;
  std::string url_;
};

// A cluster of a test's own.
class OwnCluster {
 public:
  OwnCluster() : nodes_(server_.dir(), server_.url()) {}
  const ClusterNodes& nodes() const { return nodes_; }

 private:
  OwnServer server_{TURNSTILE_REDIS_CLUSTER_SCRIPT};
  ClusterNodes nodes_;
};

class RedisCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_CLUSTER_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_CLUSTER_URL_FILE
                               << " (did the redis_cluster_server fixture run?)";
    nodes_.emplace(std::filesystem::path(TURNSTILE_REDIS_CLUSTER_URL_FILE).parent_path().string(), url_);
  }
  std::string url_;
  std::optional<ClusterNodes> nodes_;
};

TEST_F(RedisCluster, SlotsAreTheServersOwn) {
  // Names with and without hash tags of their own, as the backend's keys carry them.
  std::vector<std::string> keys{"", "a", "123456789", "{}", "{}x", "x{}", "{a}b", "c{a}", "{{a}}", "a{b}{c}", "}{x}"};
  for (int i = 0; i < 40; ++i) keys.push_back(queue_key(unique_name("slot") + std::to_string(i)));
  for (const auto& key : keys) {
    EXPECT_EQ(std::to_string(key_slot(key)), nodes_->cli("n1", "CLUSTER KEYSLOT " + quoted(key))) << key;
  }
  EXPECT_EQ(key_slot("123456789"), 0x31C3 % 16384);
}

// Red team, issue 22 round 3 (item 17): ?eviction=refuse (the default) checks each node when
// the client first uses it, not only the one asked at connect: a lock on an allkeys-lru primary
// was taken without a word while the seed node was noeviction.
TEST_F(RedisCluster, AnEvictingNodeIsRefusedWhenFirstUsed) {
  // A cluster of its own: an allkeys-lru node in the shared fixture refuses the tests running
  // beside this one.
  OwnCluster cluster;
  const auto& nodes = cluster.nodes();
  // The connect's own check asks the node of slot 0 (Router::command with no key): the seed.
  const auto seed_owner = nodes.owner("{" + tag_for_slot(0) + "}");
  std::string name, evicting;
  for (int i = 0; i < 200 && name.empty(); ++i) {
    const auto candidate = unique_name("evicting") + std::to_string(i);
    const auto owner = nodes.owner(queue_key(candidate));
    if (owner != seed_owner) name = candidate, evicting = owner;
  }
  ASSERT_FALSE(name.empty()) << "every name on one node";
  ASSERT_EQ(nodes.cli(evicting, "CONFIG SET maxmemory-policy allkeys-lru"), "OK");
  struct Restore {
    const ClusterNodes& nodes;
    std::string id;
    ~Restore() { nodes.cli(id, "CONFIG SET maxmemory-policy noeviction"); }
  } restore{nodes, evicting};
  // Seeded with a noeviction primary only, so the connect's own check passes.
  auto client = Client::connect("redis+cluster://127.0.0.1:" + nodes.port(seed_owner));
  auto mutex = client.mutex(name);
  try {
    const bool got = mutex.try_lock_for(2s);
    ADD_FAILURE() << "a lock on an allkeys-lru node was " << (got ? "taken" : "waited for");
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("maxmemory-policy allkeys-lru"), std::string::npos) << error.what();
  }
}

TEST_F(RedisCluster, NamesSpreadOverEveryPrimaryAndHandOver) {
  auto client = Client::connect(url_);
  auto other = Client::connect(url_);
  std::set<std::string> owners;
  for (int i = 0; i < 24; ++i) {
    const auto name = unique_name("spread") + std::to_string(i);
    auto mutex = client.mutex(name);
    ASSERT_TRUE(mutex.try_lock_for(5s)) << name;
    const auto owner = nodes_->owner(queue_key(name));
    owners.insert(owner);
    // The entry is on the node the cluster says serves the name's slot.
    EXPECT_EQ(nodes_->cli(owner, "EXISTS " + quoted(queue_key(name))), "1") << name << " on " << owner;
    EXPECT_FALSE(other.mutex(name).try_lock()) << name;
    mutex.unlock();
  }
  EXPECT_EQ(owners.size(), 3u) << "24 names all on fewer than three primaries";

  const auto name = unique_name("handover");
  expect_handover(client, other, name);
  auto counter = client.permit_counter(unique_name("counter"));
  EXPECT_TRUE(counter.try_set_permits(3));
  EXPECT_EQ(counter.available_permits(), 3);
}

// Issue 24 item 9: the names in use are SCANned on every primary, never only the node a first
// call happens to reach: names spread over all three are listed, each with its holder.
TEST_F(RedisCluster, NamesInUseAreListedFromEveryPrimary) {
  auto client = Client::connect(url_);
  const auto prefix = unique_name("listed") + "/";
  std::vector<turnstile::Mutex> held;
  std::set<std::string> owners, names;
  for (int i = 0; i < 12; ++i) {
    const auto name = prefix + std::to_string(i);
    held.push_back(client.mutex(name));
    ASSERT_TRUE(held.back().try_lock_for(5s)) << name;
    owners.insert(nodes_->owner(queue_key(name)));
    names.insert(name);
  }
  ASSERT_EQ(owners.size(), 3u) << "12 names all on fewer than three primaries";
  const auto listed = client.names_in_use(prefix, 100, std::chrono::steady_clock::now() + 10s);
  EXPECT_FALSE(listed.truncated);
  std::set<std::string> found;
  for (const auto& n : listed.names) {
    found.insert(n.name);
    EXPECT_EQ(n.holders, 1u) << n.name;
    EXPECT_EQ(n.waiters, 0u) << n.name;
  }
  EXPECT_EQ(found, names);
  for (auto& mutex : held) mutex.unlock();
  EXPECT_TRUE(client.names_in_use(prefix, 100, std::chrono::steady_clock::now() + 10s).names.empty());
}

// A PermitCounter's key is NAME itself (Redisson's); its waiter line must share NAME's slot even
// when NAME has a '}' but no hash tag, so that NAME cannot serve as the line's tag. Before: every
// call on such a name failed with CROSSSLOT.
TEST_F(RedisCluster, PermitCountersOfNamesWithAStrayBraceWork) {
  auto client = Client::connect(url_);
  auto other = Client::connect(url_);
  const auto base = unique_name("brace");
  for (const auto& name : {base + "x}y", base + "a{}b", "}" + base, "{}" + base, base + "}{", base + "{"}) {
    SCOPED_TRACE(name);
    auto counter = client.permit_counter(name);
    ASSERT_TRUE(counter.try_set_permits(0));
    auto waiter = std::async(std::launch::async, [&] { return other.permit_counter(name).try_acquire_for(20s, 2); });
    // Really waiting: queued on the server, and not done.
    ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 10s));
    EXPECT_EQ(waiter.wait_for(300ms), std::future_status::timeout);
    counter.release(1);
    EXPECT_EQ(waiter.wait_for(300ms), std::future_status::timeout) << "admitted with 1 permit of 2";
    counter.release(2);
    EXPECT_TRUE(waiter.get());
    EXPECT_EQ(counter.available_permits(), 1);
    EXPECT_EQ(client.inspect(name).permits, 1);
    EXPECT_EQ(counter.drain_permits(), 1);
  }
}

TEST_F(RedisCluster, HoldsOnEveryPrimaryStayHeldThroughManyRenewalRounds) {
  // TTL 1.5 s: a round every 500 ms, each split into one round trip per primary.
  HoldStateLog log;
  auto client = Client::connect(url_, log.options(1500ms));
  auto other = Client::connect(url_);
  std::vector<turnstile::Mutex> mutexes;
  std::set<std::string> owners;
  // At least 12 names, and more until every primary owns one (12 random names miss one of three
  // primaries in about 2 % of runs).
  for (int i = 0; i < 60 && (i < 12 || owners.size() < 3); ++i) {
    mutexes.push_back(client.mutex(unique_name("renewed") + std::to_string(i)));
    ASSERT_TRUE(mutexes.back().try_lock_for(5s));
    owners.insert(nodes_->owner(queue_key(mutexes.back().name())));
  }
  EXPECT_EQ(owners.size(), 3u) << mutexes.size() << " names all on fewer than three primaries";
  std::this_thread::sleep_for(4500ms);  // three TTLs: unrenewed entries would have run out
  for (auto& mutex : mutexes) {
    EXPECT_EQ(mutex.hold_state(), turnstile::HoldState::held) << mutex.name();
    EXPECT_TRUE(log.states_of(mutex.name()).empty() || log.reached(mutex.name(), turnstile::HoldState::held))
        << mutex.name() << " was suspended or lost";
    EXPECT_FALSE(other.mutex(mutex.name()).try_lock()) << mutex.name() << " is free on the server";
    mutex.unlock();
  }
}

TEST_F(RedisCluster, MinReplicasWithEveryReplicaUpAcquires) {
  auto client = Client::connect(url_ + "?min_replicas=1");
  for (int i = 0; i < 6; ++i) {
    auto mutex = client.mutex(unique_name("replicated") + std::to_string(i));
    ASSERT_TRUE(mutex.try_lock_for(5s));
    mutex.unlock();
  }
  // Two replicas are more than any primary has: refused, and nothing taken.
  auto greedy = Client::connect(url_ + "?min_replicas=2");
  auto mutex = greedy.mutex(unique_name("unreplicated"));
  EXPECT_THROW(mutex.try_lock_for(500ms), turnstile::NotReplicated);
  auto plain = Client::connect(url_);
  EXPECT_TRUE(plain.mutex(mutex.name()).try_lock());
}

TEST_F(RedisCluster, BadUrlsAreRefusedAndSecretsNeverShown) {
  for (const auto* bad : {"?min_replicas=-1", "?min_replicas=x", "?bogus=1", "?sentinel_password=x", "/1", "/0/x"}) {
    EXPECT_THROW(Client::connect(url_ + bad), turnstile::InvalidUrl) << bad;
  }
  EXPECT_THROW(Client::connect("redis+cluster://"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis+cluster://127.0.0.1:99999"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("rediss+cluster://127.0.0.1:1"), turnstile::BackendNotBuilt);
  const auto hosts = url_.substr(url_.find("//") + 2);
  // These nodes have no password: one given is refused, and never shown.
  const auto secret_url = "redis+cluster://:s3cr3t-cluster@" + hosts;
  try {
    Client::connect(secret_url);
    ADD_FAILURE() << "a wrong password connected";
  } catch (const turnstile::Error& error) {
    EXPECT_EQ(error.code(), turnstile::ErrorCode::access_denied) << error.what();
    EXPECT_EQ(std::string(error.what()).find("s3cr3t-cluster"), std::string::npos) << error.what();
  }
  try {
    Client::connect("redis+cluster://:s3cr3t-cluster@127.0.0.1:1,127.0.0.1:2");
    ADD_FAILURE() << "unreachable nodes connected";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_EQ(std::string(error.what()).find("s3cr3t-cluster"), std::string::npos) << error.what();
  }
  // A server that is no cluster node.
  OwnServer single{TURNSTILE_REDIS_SCRIPT};
  const auto single_hosts = single.url().substr(single.url().find("//") + 2);
  EXPECT_THROW(Client::connect("redis+cluster://" + single_hosts), turnstile::BackendUnavailable);
  auto client = Client::connect(url_ + "?ttl=5");
  EXPECT_EQ(client.url(), url_ + "?ttl=5");
  const auto inspected = client.inspect(unique_name("inspected"));
  EXPECT_TRUE(inspected.holders.empty());
}

// A name whose slot is `slot`, found by trying.
std::string name_in_slot(int slot, const std::string& leaf) {
  for (int i = 0;; ++i) {
    auto name = unique_name(leaf) + "-" + std::to_string(i);
    if (key_slot(queue_key(name)) == slot) return name;
  }
}

// The slot of `name` moves from its primary to another, by hand (CLUSTER SETSLOT and MIGRATE, as
// redis-cli --cluster reshard does it): while it moves, a new name of that slot is created on the
// target through ASK; once moved, a client whose map is stale follows MOVED; the hold taken
// before the move follows its entry to the target (lost only when the entry is gone), and the
// name is served on the target.
TEST(RedisClusterFaults, MovedAndAskAreFollowedWhenASlotMoves) {
  OwnCluster cluster;
  const auto& nodes = cluster.nodes();
  auto client = Client::connect(nodes.url(), with_ttl(6s));
  // Reads the map before the move; its watchdog reads it again only every TTL/3 (200 s here).
  auto stale = Client::connect(nodes.url(), with_ttl(600s));
  const auto name = unique_name("moving");
  const auto slot = key_slot(queue_key(name));
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto lost = mutex.lost_token();
  const auto token = mutex.fencing_token();
  const auto source = nodes.owner(queue_key(name));
  std::string target;
  for (const auto* id : {"n1", "n2", "n3", "n4", "n5", "n6"}) {
    if (id != source && nodes.cli(id, "ROLE").rfind("master", 0) == 0) {
      target = id;
      break;
    }
  }
  ASSERT_FALSE(target.empty());
  const auto source_id = nodes.cli(source, "CLUSTER MYID");
  const auto target_id = nodes.cli(target, "CLUSTER MYID");
  const auto s = std::to_string(slot);
  ASSERT_EQ(nodes.cli(target, "CLUSTER SETSLOT " + s + " IMPORTING " + source_id), "OK");
  ASSERT_EQ(nodes.cli(source, "CLUSTER SETSLOT " + s + " MIGRATING " + target_id), "OK");
  // ASK: a name of the same slot that the source does not have goes to the target.
  const auto fresh = name_in_slot(slot, "asked");
  auto fresh_mutex = client.mutex(fresh);
  ASSERT_TRUE(fresh_mutex.try_lock_for(5s));
  // The source does not have it (it answers ASK), the target does (asked with ASKING).
  EXPECT_EQ(nodes.cli(source, "EXISTS " + quoted(queue_key(fresh))).rfind("ASK ", 0), 0u)
      << "the new name's entry is on the source, not created through ASK on the target";
  EXPECT_EQ(shell("printf 'ASKING\\nEXISTS %s\\n' " + quoted(queue_key(fresh)) + " | redis-cli -h 127.0.0.1 -p " +
                  nodes.port(target)),
            "OK\n1")
      << "the new name's entry is not on the target";
  fresh_mutex.unlock();
  // The rest of the slot moves, then every primary learns its new owner.
  const auto keys = nodes.cli(source, "CLUSTER GETKEYSINSLOT " + s + " 100");
  std::string migrate = "MIGRATE 127.0.0.1 " + nodes.port(target) + " \"\" 0 5000 KEYS";
  for (std::size_t at = 0, end; at < keys.size(); at = end + 1) {
    end = keys.find('\n', at);
    if (end == std::string::npos) end = keys.size();
    migrate += " " + quoted(keys.substr(at, end - at));
  }
  if (!keys.empty()) {
    ASSERT_EQ(nodes.cli(source, migrate), "OK");
  }
  for (const auto* id : {"n1", "n2", "n3", "n4", "n5", "n6"}) {
    nodes.cli(id, "CLUSTER SETSLOT " + s + " NODE " + target_id);
  }
  ASSERT_TRUE(eventually([&] { return nodes.owner(queue_key(name)) == target; }, 10s));
  // The entry moved with its slot (MIGRATE keeps its expiry): the hold follows it, renewed on the
  // target past its TTL (before, it was reported lost at the next round).
  std::this_thread::sleep_for(7s);
  EXPECT_FALSE(lost.stop_requested()) << "a resharded hold was reported lost";
  EXPECT_EQ(mutex.hold_state(), turnstile::HoldState::held);
  // A client that read the map before the move follows MOVED (its first call goes to the
  // source) and finds the name held.
  auto again = stale.mutex(name);
  EXPECT_FALSE(again.try_lock_for(1s)) << "the resharded hold's name was free";
  // Its entry really gone (deleted on the target): lost at the next round, as on one server.
  EXPECT_EQ(nodes.cli(target, "DEL " + quoted(queue_key(name))), "1");
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 6s)) << "a hold whose entry is gone was not lost";
  try {
    mutex.unlock();
  } catch (const turnstile::HoldLost&) {
  }
  ASSERT_TRUE(again.try_lock_for(10s));
  EXPECT_GT(again.fencing_token(), token);
  EXPECT_EQ(nodes.cli(target, "EXISTS " + quoted(queue_key(name))), "1");
  again.unlock();
  EXPECT_TRUE(client.mutex(name).try_lock());
}

// The subscriber's node (the URL's first) is killed while a waiter waits: the subscription moves
// to another node, and the release still admits the waiter.
TEST(RedisClusterFaults, WaitersResubscribeElsewhereWhenTheSubscribersNodeDies) {
  OwnCluster cluster;
  const auto& nodes = cluster.nodes();
  std::string name;
  for (int i = 0; name.empty(); ++i) {
    const auto candidate = unique_name("subscribed") + std::to_string(i);
    if (nodes.owner(queue_key(candidate)) != "n1") name = candidate;
  }
  const auto channel = "turnstile:{" + name + "}:w:0";
  const auto listeners = [&](const std::string& id) { return nodes.cli(id, "PUBSUB NUMSUB " + quoted(channel)); };
  auto holder = Client::connect(nodes.url());
  auto waiting = Client::connect(nodes.url());
  auto mutex = holder.mutex(name);
  mutex.lock();
  auto theirs = waiting.mutex(name);
  auto waiter = lock_in_background(theirs, 60s);
  ASSERT_TRUE(eventually([&] { return listeners("n1") == channel + "\n1"; }, 10s))
      << "the waiter's subscription is not on the URL's first node: " << listeners("n1");
  ASSERT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "a waiter got in while the lock was held";
  ASSERT_EQ(nodes.run("kill", "n1"), 0);
  EXPECT_TRUE(eventually([&] { return listeners("n2") == channel + "\n1" || listeners("n3") == channel + "\n1"; }, 20s))
      << "the subscription did not move to another node";
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "a waiter got in while the lock was held";
  mutex.unlock();
  EXPECT_TRUE(waiter.get()) << "the waiter was not admitted after the release";
}

TEST(RedisClusterFaults, ClusterFailoverReportsHoldsLostAndServesWaitersOnTheNewPrimary) {
  OwnCluster cluster;
  // A manual failover: the replica catches up first, then takes over within a second or two;
  // the holder learns it from its next renewal round's map (every 5 s).
  const auto& nodes = cluster.nodes();
  const auto name = unique_name("failover");
  expect_failover_reported(
      nodes.url(), name, [&] { return nodes.owner(queue_key(name)); },
      [&](const std::string& primary) { ASSERT_EQ(nodes.run("failover", primary), 0); }, 9s);
}

TEST(RedisClusterFaults, KilledPrimaryReportsHoldsLostAndServesWaitersOnTheNewPrimary) {
  OwnCluster cluster;
  // cluster-node-timeout 1000 ms, then an election: a few seconds, below the TTL's 13.5 s loss
  // bound, so only the change of primary can have reported the loss.
  const auto& nodes = cluster.nodes();
  const auto name = unique_name("failover");
  expect_failover_reported(
      nodes.url(), name, [&] { return nodes.owner(queue_key(name)); },
      [&](const std::string& primary) { ASSERT_EQ(nodes.run("kill", primary), 0); }, 11s);
}

// Red team: a primary killed and restarted empty before any failover (node-timeout 1 s, the
// restart quicker) forgets the hold. Its holder is told at once, as on a single redis (the
// watchdog watches every node's idle connection, and opens one to a new hold's node), not at
// its next regular round: TTL/3 = 20 s here, after another contender may have got in.
TEST(RedisClusterFaults, APrimaryRestartedEmptyIsNoticedAtOnceNotAtTheNextRound) {
  OwnCluster cluster;
  const auto& nodes = cluster.nodes();
  const auto name = unique_name("restarted");
  auto client = turnstile::Client::connect(nodes.url(), with_ttl(60s));
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto lost = mutex.lost_token();
  std::this_thread::sleep_for(500ms);  // the watchdog's first look at the new hold's node
  const auto primary = nodes.owner(queue_key(name));
  ASSERT_FALSE(primary.empty());
  const auto started = std::chrono::steady_clock::now();
  ASSERT_EQ(nodes.run("kill", primary), 0);
  ASSERT_EQ(nodes.run("start-node", primary), 0);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 10s))
      << "a primary restarted empty went unnoticed (the next regular round is 20 s after the lock)";
  std::printf(
      "hold reported lost %lld ms after the kill\n",
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count()));
  try {
    mutex.unlock();
  } catch (const turnstile::Error&) {
  }
}

}  // namespace
