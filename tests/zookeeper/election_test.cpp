// SPDX-License-Identifier: Apache-2.0
// Elections in Curator LeaderLatch's layout: turnstile candidates and a Curator LeaderLatch
// (CuratorPeer.java, Debian's libcurator-recipes-java) elect one leader among them, see each
// other's values, and a proclaim never costs a Curator follower its watch.
#include <signal.h>
#include <zookeeper/zookeeper.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <regex>

#include "conformance/support.hpp"
#include "curator_peer.hpp"
#include "raw_zk.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using turnstile::HoldState;
using namespace server_tests;
using zookeeper_tests::CuratorPeer;
using zookeeper_tests::host_port;
using zookeeper_tests::RawZk;
using zookeeper_tests::server_url;

// The name's children, after waiting (bounded) until there are `count`.
std::vector<std::string> children_once(RawZk& raw, const std::string& path, std::size_t count) {
  auto children = raw.children(path);
  for (int i = 0; i < 500 && children.size() != count; ++i) {
    std::this_thread::sleep_for(10ms);
    children = raw.children(path);
  }
  return children;
}

// (a) A Curator latch leads; a turnstile candidate waits, reads Curator's value, and leads once
// the latch closes; a second Curator latch then reads turnstile's value as its leader.
TEST(ZookeeperElection, CuratorLatchLeadsThenTurnstileFollows) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-a");
  ASSERT_EQ(curator.ask("latch start /" + name + " C1"), "started");
  ASSERT_EQ(curator.ask("latch await /" + name + " 5000"), "leader");
  auto client = Client::connect(server_url());
  auto election = client.election(name);
  EXPECT_FALSE(election.campaign_for("t1", 300ms)) << "turnstile led beside a Curator leader";
  const auto leader = election.leader();
  ASSERT_TRUE(leader.has_value());
  EXPECT_EQ(leader->value, "C1");
  EXPECT_FALSE(leader->ours);

  auto campaign = std::async(std::launch::async, [&] { return election.campaign_for("t1", 20s); });
  RawZk raw(host_port());
  ASSERT_EQ(children_once(raw, "/" + name, 2).size(), 2u) << "the turnstile candidate never joined";
  EXPECT_EQ(campaign.wait_for(200ms), std::future_status::timeout) << "turnstile led while Curator did";
  ASSERT_EQ(curator.ask("latch close /" + name), "closed");
  ASSERT_TRUE(campaign.get());
  EXPECT_EQ(election.hold_state(), HoldState::held);

  ASSERT_EQ(curator.ask("latch start /" + name + " C2"), "started");
  EXPECT_EQ(curator.ask("latch await /" + name + " 300"), "timeout");
  EXPECT_EQ(curator.ask("latch leader /" + name), "leader t1");
  EXPECT_EQ(curator.ask("latch participants /" + name), "t1 C2");
  election.resign();
  EXPECT_EQ(curator.ask("latch await /" + name + " 5000"), "leader");
  EXPECT_EQ(election.leader()->value, "C2");
  EXPECT_EQ(curator.ask("latch close /" + name), "closed");
}

// (b), (c) turnstile leads: a Curator latch waits until it resigns. The node is LeaderLatch's,
// named as Curator names it, its data the value byte for byte, its uuid marked as turnstile's.
TEST(ZookeeperElection, TurnstileLeadsInLeaderLatchLayout) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-b");
  auto client = Client::connect(server_url());
  auto election = client.election(name);
  election.campaign("t1");
  RawZk raw(host_port());
  const auto children = raw.children("/" + name);
  ASSERT_EQ(children.size(), 1u);
  EXPECT_TRUE(std::regex_match(children[0], std::regex("^_c_[0-9a-f-]{36}-latch-[0-9]{10}$"))) << children[0];
  EXPECT_EQ(children[0].substr(3 + 24, 12), "7475726e7374") << "not marked as turnstile's";
  EXPECT_EQ(raw.data("/" + name + "/" + children[0]), "t1");

  ASSERT_EQ(curator.ask("latch start /" + name + " C1"), "started");
  EXPECT_EQ(curator.ask("latch await /" + name + " 1000"), "timeout");
  EXPECT_EQ(curator.ask("latch has /" + name), "false");
  EXPECT_EQ(curator.ask("latch leader /" + name), "leader t1");
  election.resign();
  EXPECT_EQ(curator.ask("latch await /" + name + " 5000"), "leader");
  EXPECT_EQ(curator.ask("latch close /" + name), "closed");
}

// (d) A leading turnstile process killed with -9: the Curator latch leads only once the dead
// leader's node is gone (its session expired), never beside it.
TEST(ZookeeperElection, CuratorLeadsOnlyAfterKilledLeadersSessionEnds) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-d");
  const auto url = server_url();
  conformance::Pipe ready;
  auto child = conformance::Child::spawn([&]() -> int {
    auto own = Client::connect(url, with_ttl(1s));
    auto election = own.election(name);
    election.campaign("t1");
    ready.send();
    conformance::linger_in_child();
  });
  ASSERT_TRUE(ready.receive());
  RawZk raw(host_port());
  const auto dead = raw.children("/" + name);
  ASSERT_EQ(dead.size(), 1u);
  ASSERT_EQ(curator.ask("latch start /" + name + " C1"), "started");
  EXPECT_EQ(curator.ask("latch await /" + name + " 300"), "timeout");
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  // Asked again and again: whenever Curator says it leads, the dead leader's node is gone.
  bool leads = false;
  for (int i = 0; i < 100 && !leads; ++i) {
    leads = curator.ask("latch has /" + name) == "true";
    const auto now = raw.children("/" + name);
    if (leads) {
      EXPECT_EQ(std::count(now.begin(), now.end(), dead[0]), 0) << "two leaders at once";
    } else {
      std::this_thread::sleep_for(50ms);
    }
  }
  EXPECT_TRUE(leads) << "Curator never took over from the killed leader";
  EXPECT_EQ(curator.ask("latch close /" + name), "closed");
}

// (e) The proclaim rule: refused while a Curator latch is next in line (it would lose its watch
// on our changed node and never take over), allowed with a turnstile candidate there; our own
// change is no loss of the leadership, and Curator reads the new value.
TEST(ZookeeperElection, ProclaimIsRefusedWithCuratorLatchNextInLine) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-e");
  auto client = Client::connect(server_url());
  auto first = client.election(name);
  first.campaign("t1");
  auto second = client.election(name);
  auto campaign = std::async(std::launch::async, [&] { return second.campaign_for("t2", 20s); });
  RawZk raw(host_port());
  ASSERT_EQ(children_once(raw, "/" + name, 2).size(), 2u);
  ASSERT_EQ(curator.ask("latch start /" + name + " C1"), "started");
  ASSERT_EQ(children_once(raw, "/" + name, 3).size(), 3u);

  first.proclaim("t1b");  // a turnstile candidate is next: allowed
  EXPECT_EQ(curator.ask("latch leader /" + name), "leader t1b");
  EXPECT_EQ(first.leader()->value, "t1b");
  std::this_thread::sleep_for(300ms);  // the held node's watch has fired for our own change
  EXPECT_EQ(first.hold_state(), HoldState::held) << "our own proclaim read as a loss";

  first.resign();
  ASSERT_TRUE(campaign.get());
  EXPECT_THROW(second.proclaim("t2b"), turnstile::InvalidArgument) << "Curator's latch is next in line";
  EXPECT_EQ(second.leader()->value, "t2") << "a refused proclaim changed the value";
  EXPECT_EQ(second.hold_state(), HoldState::held);
  second.resign();
  EXPECT_EQ(curator.ask("latch await /" + name + " 5000"), "leader") << "Curator's latch lost its watch";
  EXPECT_EQ(curator.ask("latch close /" + name), "closed");
}

// Red team (rt27-a): a proclaim allowed with a turnstile candidate next in line, whose write
// reaches the server after that candidate left, would change our node while the Curator latch
// behind it watches it now (its watch used up: it never took over). The candidate behind is
// checked in the write's own transaction: the proclaim reads again and is refused.
TEST(ZookeeperElection, ProclaimWhoseCandidateBehindLeftMeanwhileSparesCuratorsWatch) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-r");
  const auto url = server_url();
  turnstile_test::TcpProxy proxy(url);
  auto through = Client::connect(proxy.url_through(url));
  auto client = Client::connect(url);
  auto leader = through.election(name);
  leader.campaign("L");
  auto behind = client.election(name);
  std::stop_source leave;
  auto campaign = std::async(std::launch::async, [&] { return behind.campaign_for("T2", 20s, leave.get_token()); });
  RawZk raw(host_port());
  ASSERT_EQ(children_once(raw, "/" + name, 2).size(), 2u);
  ASSERT_EQ(curator.ask("latch start /" + name + " C"), "started");
  ASSERT_EQ(children_once(raw, "/" + name, 3).size(), 3u);

  const std::string value = "proclaimed-" + name;
  auto held = proxy.hold_request(value);
  auto proclaim = std::async(std::launch::async, [&] {
    try {
      leader.proclaim(value);
      return std::string("proclaimed");
    } catch (const turnstile::InvalidArgument&) {
      return std::string("refused");
    }
  });
  ASSERT_TRUE(held->wait_held(5s)) << "the proclaim's write never passed the proxy: nothing tested";
  leave.request_stop();  // the turnstile candidate behind leaves: Curator's latch watches ours now
  EXPECT_FALSE(campaign.get());
  ASSERT_EQ(children_once(raw, "/" + name, 2).size(), 2u);
  std::this_thread::sleep_for(300ms);  // Curator's latch has moved its watch onto our node
  held->deliver();
  EXPECT_EQ(proclaim.get(), "refused") << "proclaimed with a Curator latch next in line";
  EXPECT_EQ(leader.leader()->value, "L");
  leader.resign();
  EXPECT_EQ(curator.ask("latch await /" + name + " 5000"), "leader") << "Curator's latch lost its watch";
  EXPECT_EQ(curator.ask("latch close /" + name), "closed");
}

// After a proclaim the held node is watched again: its deletion by hand still loses it at once.
TEST(ZookeeperElection, ProclaimedLeaderStillLearnsItsNodeWasDeleted) {
  const auto name = unique_name("elect-w");
  auto client = Client::connect(server_url());
  auto election = client.election(name);
  election.campaign("t1");
  election.proclaim("t2");
  election.proclaim("t3");
  RawZk raw(host_port());
  const auto children = raw.children("/" + name);
  ASSERT_EQ(children.size(), 1u);
  EXPECT_EQ(raw.data("/" + name + "/" + children[0]), "t3");
  std::this_thread::sleep_for(200ms);  // the keeper sets the watch again
  ASSERT_EQ(raw.remove("/" + name + "/" + children[0]), ZOK);
  const auto start = std::chrono::steady_clock::now();
  while (election.hold_state() != HoldState::lost && std::chrono::steady_clock::now() - start < 10s)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(election.hold_state(), HoldState::lost);
  EXPECT_THROW(election.proclaim("t4"), turnstile::HoldLost);
}

// One path is never both a Curator lock and an election, whichever came first.
TEST(ZookeeperElection, CuratorMutexAndLatchAreKindMismatches) {
  REQUIRE_CURATOR();
  const auto name = unique_name("elect-k");
  auto client = Client::connect(server_url());
  ASSERT_EQ(curator.ask("acquire mutex /" + name + " 5000"), "acquired");
  EXPECT_THROW(client.election(name).campaign_for("t1", 2s), turnstile::KindMismatch);
  ASSERT_EQ(curator.ask("release"), "released");
  ASSERT_EQ(curator.ask("latch start /" + name + "x C1"), "started");
  ASSERT_EQ(curator.ask("latch await /" + name + "x 5000"), "leader");
  EXPECT_THROW(client.mutex(name + "x").try_lock_for(2s), turnstile::KindMismatch);
  EXPECT_EQ(client.election(name + "x").leader()->value, "C1");
  EXPECT_EQ(curator.ask("latch close /" + name + "x"), "closed");
}

// An observer is woken by the watches: a proclaim and a hand-over are each seen.
TEST(ZookeeperElection, ObserverSeesProclaimAndHandOver) {
  const auto name = unique_name("elect-o");
  auto client = Client::connect(server_url());
  auto leader = client.election(name);
  leader.campaign("t1");
  auto observer = client.election(name).observe();
  const auto first = observer.next(std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(first && *first);
  EXPECT_EQ((*first)->value, "t1");
  leader.proclaim("t2");
  const auto second = observer.next(std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(second && *second);
  EXPECT_EQ((*second)->value, "t2");
  leader.resign();
  const auto third = observer.next(std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(third);
  EXPECT_FALSE(third->has_value()) << "nobody leads after the only candidate resigned";
}

}  // namespace
