// SPDX-License-Identifier: Apache-2.0
// Leader election on Consul with candidates that follow Consul's leader-election guide, written
// with Debian's python3-consul (consul_election_peer.py) against the suite's stand-in: one
// leader among them and turnstile's candidates, each side seeing the other's leader and value.
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>

#include "consul/consul_test_support.hpp"
#include "support/peer_process.hpp"
#include "turnstile/election.hpp"

namespace {

using namespace std::chrono_literals;
using namespace consul_tests;
using turnstile::Client;

// The peer on the suite's stand-in: `python3 consul_election_peer.py HOST PORT`.
std::unique_ptr<turnstile_test::PeerProcess> start_peer() {
  const auto address = base().substr(std::string("http://").size());
  const auto colon = address.rfind(':');
  return std::make_unique<turnstile_test::PeerProcess>(std::vector<std::string>{
      "/usr/bin/python3", TURNSTILE_CONSUL_ELECTION_PEER, address.substr(0, colon), address.substr(colon + 1)});
}

#define REQUIRE_PEER(peer)                                                                                      \
  if (std::system("/usr/bin/python3 -c 'import consul' 2>/dev/null") != 0) GTEST_SKIP() << "no python3-consul"; \
  auto peer = start_peer();                                                                                     \
  ASSERT_TRUE(peer->ready()) << "the python3-consul peer did not start"

// A peer that leads `name` (a new one) with `value`, and a turnstile client.
#define PEER_LEADS(value, flags)                                                        \
  REQUIRE_PEER(peer);                                                                   \
  const auto name = unique("elect");                                                    \
  ASSERT_EQ(peer->ask("campaign " + name + " " + (value) + " 5000" + flags), "leader"); \
  auto client = Client::connect(url())

// The python candidate leads (with the guide's flags 0, or api.Lock's): a turnstile candidate
// waits behind it and reads its value; once it resigns, turnstile leads and the peer reads
// turnstile's value.
void peer_leads_then_turnstile(const std::string& flags) {
  PEER_LEADS("py-one", flags);
  auto election = client.election(name);
  ASSERT_TRUE(election.leader());
  EXPECT_EQ(election.leader()->value, "py-one");
  EXPECT_FALSE(election.leader()->ours);
  EXPECT_EQ(client.inspect(name).mode, "election");
  // The peer's own proclaim (acquire again with its session) is the leader's value.
  ASSERT_EQ(peer->ask("proclaim " + name + " py-one-b" + flags), "true");
  EXPECT_EQ(election.leader()->value, "py-one-b");
  EXPECT_FALSE(election.campaign_for("t-one", 500ms)) << "led while the peer holds the key";
  auto campaign = election.campaign_async("t-one");
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 10s));
  EXPECT_FALSE(campaign.ready());  // it really waits for the peer
  EXPECT_EQ(peer->ask("resign " + name), "true");
  ASSERT_TRUE(campaign.wait_for(10s)) << "turnstile did not lead after the peer resigned";
  EXPECT_TRUE(campaign.get());
  EXPECT_EQ(peer->ask("leader " + name), "leader t-one");
  EXPECT_EQ(peer->ask("campaign " + name + " py-two 300" + flags), "timeout");
  election.resign();
  EXPECT_EQ(peer->ask("leader " + name), "none");
  EXPECT_EQ(peer->ask("campaign " + name + " py-two 5000" + flags), "leader");
  EXPECT_EQ(election.leader()->value, "py-two");
}

TEST(ConsulElection, AGuideCandidateWithFlagsZeroAndTurnstileElectOneLeader) { peer_leads_then_turnstile(""); }

TEST(ConsulElection, AnApiLockCandidateAndTurnstileElectOneLeader) { peer_leads_then_turnstile(" " + kLockFlags); }

// turnstile leads: the peer times out; a proclaim is what the peer reads, on the same lock
// (LockIndex and session unchanged), with the same fencing token.
TEST(ConsulElection, TurnstileProclaimIsReadByThePeerOnTheSameLock) {
  REQUIRE_PEER(peer);
  const auto name = unique("elect");
  auto client = Client::connect(url());
  auto election = client.election(name);
  ASSERT_TRUE(election.campaign_for("t-one", 5s));
  EXPECT_EQ(peer->ask("leader " + name), "leader t-one");
  EXPECT_EQ(peer->ask("campaign " + name + " py 500"), "timeout");
  const auto lock_before = peer->ask("lockindex " + name);
  const auto token = election.fencing_token();
  election.proclaim("t-two");
  EXPECT_EQ(peer->ask("leader " + name), "leader t-two");
  EXPECT_EQ(peer->ask("lockindex " + name), lock_before);
  EXPECT_EQ(election.fencing_token(), token);
  EXPECT_EQ(election.leader()->fencing_token, token);
  EXPECT_EQ(election.leader()->value, "t-two");
  EXPECT_TRUE(election.leader()->ours);
  election.resign();
  EXPECT_EQ(peer->ask("campaign " + name + " py 5000"), "leader");
}

// The peer's session destroyed while it leads: the key is released and Consul's lock-delay
// refuses every acquire for a while; the waiting turnstile candidate leads after it, without
// an error, and an observer sees the peer's leadership end and turnstile's begin.
TEST(ConsulElection, TurnstileLeadsAfterTheLockDelayOfAPeerSessionDestroyed) {
  PEER_LEADS("doomed", "");
  auto election = client.election(name);
  auto observer = election.observe();
  auto seen = observer.next(std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, "doomed");
  auto campaign = election.campaign_async("after");
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 10s));
  EXPECT_FALSE(campaign.ready());
  EXPECT_EQ(peer->ask("kill-session"), "destroyed");
  ASSERT_TRUE(campaign.wait_for(15s)) << "turnstile did not lead after the peer's session ended";
  EXPECT_TRUE(campaign.get());
  for (int i = 0; i < 3 && seen && *seen && (*seen)->value != "after"; ++i) {
    seen = observer.next(std::chrono::steady_clock::now() + 5s);
  }
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, "after");
  EXPECT_EQ(peer->ask("leader " + name), "leader after");
}

// A guide peer's key (Flags 0) is a leader's to a candidate, and someone else's to a Mutex.
TEST(ConsulElection, AMutexOnAGuidePeersLeaderKeyIsAKindMismatch) {
  PEER_LEADS("py", "");
  auto mutex = client.mutex(name);
  EXPECT_THROW(static_cast<void>(mutex.try_lock_for(300ms)), turnstile::KindMismatch);
  EXPECT_EQ(peer->ask("leader " + name), "leader py");
}

}  // namespace
