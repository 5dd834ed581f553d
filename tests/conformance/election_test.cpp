// SPDX-License-Identifier: Apache-2.0
// Leader election (turnstile/election.hpp) on every backend that has an election layout; the
// others must refuse Client::election with a typed error naming the backend.
#include <signal.h>

#include <fstream>
#include <stop_token>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Client;
using turnstile::Election;

// Whether `client` has elections; a backend without them must say which backend it is.
bool has_elections(Client& client, const std::string& name) {
  try {
    static_cast<void>(client.election(name));
    return true;
  } catch (const turnstile::InvalidArgument& error) {
    const std::string scheme = client.url().substr(0, client.url().find(':'));
    EXPECT_NE(std::string(error.what()).find(scheme + "://"), std::string::npos) << error.what();
    return false;
  }
}

#define REQUIRE_ELECTIONS()                                                  \
  do {                                                                       \
    if (!has_elections(client(), name("probe"))) {                           \
      GTEST_SKIP() << "no election layout on this backend (refused, typed)"; \
    }                                                                        \
  } while (false)

// A leader of an election and, on a second client, another candidate's Election object.
struct Contest {
  Election leader;
  Client other_client;
  Election other;
};
Contest contest(Client& client, Client other_client, const std::string& name, const std::string& value) {
  auto leader = client.election(name);
  leader.campaign(value);
  auto other = other_client.election(name);
  return Contest{std::move(leader), std::move(other_client), std::move(other)};
}

// A child's client whose holds outlive it by one short TTL.
Client connect_short_lived(const std::string& url) {
  turnstile::ClientOptions short_lived;
  short_lived.ttl = 2s;
  return Client::connect(url, short_lived);
}

// Campaigns with `value`, writes the fencing token to `token_file` and says so through `leading`.
Election lead_and_tell(Client& client, const std::string& name, const std::string& value, const std::string& token_file,
                       Pipe& leading) {
  auto election = client.election(name);
  election.campaign(value);
  std::ofstream(token_file) << election.fencing_token();
  leading.send();
  return election;
}

}  // namespace

TEST_P(Conformance, ElectionIsRefusedWithATypedErrorWhereItHasNoLayout) {
  // Either it works, or it refuses at once with InvalidArgument naming the backend (checked in
  // has_elections): never a lock whose value is lost.
  if (has_elections(client(), name("e"))) {
    auto election = client().election(name("e"));
    EXPECT_TRUE(election.campaign_for("v", 5s));
    EXPECT_EQ(election.leader()->value, "v");
  }
}

TEST_P(Conformance, ElectionHasOneLeaderAtATimeAmongProcesses) {
  const auto history = scratch_path("history");
  const auto election_name = name("e");
  std::vector<Child> children;
  for (int c = 0; c < 3; ++c) {
    children.push_back(Child::spawn_gated([&, c] {  // forked before this process has client threads
      auto own = Client::connect(url());
      auto election = own.election(election_name);
      th::FileHoldRecorder recorder(history);
      for (int i = 0; i < 8; ++i) {
        Stopwatch watch;
        election.campaign("child " + std::to_string(c));
        watch.held();
        const auto token = election.fencing_token();
        if (election.leader()->value != "child " + std::to_string(c)) return 3;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        recorder.record(watch.finish(election_name, "exclusive", 1, token));
        election.resign();
      }
      return 0;
    }));
  }
  REQUIRE_ELECTIONS();
  for (auto& child : children) child.start();
  for (auto& child : children) EXPECT_EQ(child.wait(30s), 0);
  const auto records = th::load_history(history);
  EXPECT_EQ(records.size(), 3u * 8);
  expect_sound(records);
}

TEST_P(Conformance, ElectionCampaignTimeoutAndStopLeaveTheQueue) {
  REQUIRE_ELECTIONS();
  const auto election_name = name("e");
  auto [leader, other_client, late] = contest(client(), connect(), election_name, "leader");
  EXPECT_FALSE(late.campaign_for("late", 300ms));
  EXPECT_EQ(waiter_count(election_name), 0u);

  std::stop_source stop;
  std::atomic<int> outcome{-1};
  std::thread candidate([&] { outcome = late.campaign_for("stopped", 20s, stop.get_token()) ? 1 : 0; });
  OnExit join([&] {
    stop.request_stop();
    candidate.join();
  });
  ASSERT_TRUE(wait_for_waiters(election_name, 1)) << "the candidate never queued";
  EXPECT_EQ(outcome.load(), -1);  // it really waits
  stop.request_stop();
  candidate.join();
  join.dismiss();
  EXPECT_EQ(outcome.load(), 0);
  EXPECT_EQ(waiter_count(election_name), 0u);
  EXPECT_EQ(leader.leader()->value, "leader");
  EXPECT_TRUE(leader.is_leader());
}

TEST_P(Conformance, ElectionResignHandsOverInArrivalOrder) {
  REQUIRE_ELECTIONS();
  const auto election_name = name("e");
  auto first = client().election(election_name);
  first.campaign("first");
  std::mutex order_mutex;
  std::vector<int> order;
  std::vector<std::thread> threads;
  OnExit join([&] {
    for (auto& t : threads) t.join();
  });
  OnExit resign_first([&] { first.resign(); });
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      auto own = connect();
      auto election = own.election(election_name);
      if (!election.campaign_for("c" + std::to_string(i), 20s)) return;
      {
        std::lock_guard lock(order_mutex);
        order.push_back(i);
      }
      election.resign();
    });
    ASSERT_TRUE(wait_for_waiters(election_name, static_cast<std::size_t>(i) + 1)) << "candidate " << i;
  }
  resign_first.dismiss();
  const auto token = first.fencing_token();
  first.resign();
  EXPECT_FALSE(first.is_leader());
  EXPECT_THROW(static_cast<void>(first.fencing_token()), turnstile::NotHeld);
  for (auto& t : threads) t.join();
  threads.clear();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  auto again = client().election(election_name);
  ASSERT_TRUE(again.campaign_for("again", 5s));
  EXPECT_GT(again.fencing_token(), token);
}

TEST_P(Conformance, ElectionCampaignAsyncLeadsWhenTheLeaderResigns) {
  REQUIRE_ELECTIONS();
  const auto election_name = name("e");
  auto [first, other_client, second] = contest(client(), connect(), election_name, "first");
  auto campaign = second.campaign_async("second");
  ASSERT_TRUE(wait_for_waiters(election_name, 1));
  EXPECT_FALSE(campaign.ready());
  EXPECT_THROW(static_cast<void>(second.campaign_for("twice", 0ms)), turnstile::WouldDeadlock);
  first.resign();
  ASSERT_TRUE(campaign.wait_for(10s));
  EXPECT_TRUE(campaign.get());
  EXPECT_TRUE(second.is_leader());
  const auto leader = first.leader();
  ASSERT_TRUE(leader);
  EXPECT_EQ(leader->value, "second");
  EXPECT_FALSE(leader->ours);
  EXPECT_TRUE(second.leader()->ours);
}

TEST_P(Conformance, ElectionProclaimIsSeenByLeaderAndObservers) {
  REQUIRE_ELECTIONS();
  const auto election_name = name("e");
  auto election = client().election(election_name);
  EXPECT_THROW(election.proclaim("not leading"), turnstile::NotHeld);
  auto observer = election.observe();
  auto seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen);
  EXPECT_FALSE(*seen);  // nobody leads yet
  const std::string too_long(turnstile::max_election_value + 1, 'x');
  EXPECT_THROW(election.campaign(too_long), turnstile::InvalidArgument);
  EXPECT_EQ(waiter_count(election_name) + holder_count(election_name), 0u);
  election.campaign("one");
  seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, "one");
  const auto token = election.fencing_token();
  EXPECT_THROW(election.proclaim(too_long), turnstile::InvalidArgument);
  election.proclaim(std::string("two\0bytes", 9));
  EXPECT_EQ(election.fencing_token(), token);
  auto other_client = connect();
  const auto leader = other_client.election(election_name).leader();
  ASSERT_TRUE(leader);
  EXPECT_EQ(leader->value, std::string("two\0bytes", 9));
  EXPECT_EQ(leader->fencing_token, token);
  seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, std::string("two\0bytes", 9));
  EXPECT_EQ((*seen)->fencing_token, token);
  // Nothing changes: next() waits out its deadline.
  EXPECT_FALSE(observer.next(Clock::now() + 300ms));
}

TEST_P(Conformance, ElectionObserveSeesEachLeader) {
  REQUIRE_ELECTIONS();
  const auto election_name = name("e");
  auto observer_client = connect();
  auto observer = observer_client.election(election_name).observe();
  auto seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen);
  EXPECT_FALSE(*seen);
  auto a = client().election(election_name);
  a.campaign("a");
  seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, "a");
  auto b_client = connect();
  auto b = b_client.election(election_name);
  auto b_campaign = b.campaign_async("b");
  ASSERT_TRUE(wait_for_waiters(election_name, 1));
  a.resign();
  ASSERT_TRUE(b_campaign.get());
  seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen && *seen);
  EXPECT_EQ((*seen)->value, "b");
  EXPECT_EQ((*seen)->fencing_token, b.fencing_token());
  b.resign();
  seen = observer.next(Clock::now() + 5s);
  ASSERT_TRUE(seen);
  EXPECT_FALSE(*seen);
}

TEST_P(Conformance, ElectionAndMutexOfOneNameAreAKindMismatch) {
  REQUIRE_ELECTIONS();
  const auto lock_name = name("m");
  auto mutex = client().mutex(lock_name);
  mutex.lock();
  auto other_client = connect();
  auto election = other_client.election(lock_name);
  EXPECT_THROW(static_cast<void>(election.campaign_for("v", 1s)), turnstile::KindMismatch);
  EXPECT_THROW(static_cast<void>(election.leader()), turnstile::KindMismatch);
  mutex.unlock();

  const auto election_name = name("e");
  auto leader = client().election(election_name);
  leader.campaign("v");
  auto other_mutex = other_client.mutex(election_name);
  EXPECT_THROW(static_cast<void>(other_mutex.try_lock_for(1s)), turnstile::KindMismatch);
  auto semaphore = other_client.semaphore(election_name, 2);
  EXPECT_THROW(static_cast<void>(semaphore.try_acquire_for(1s)), turnstile::KindMismatch);
  EXPECT_EQ(client().inspect(election_name).mode, "election");
  EXPECT_TRUE(leader.is_leader());
}

TEST_P(Conformance, ElectionOfManyCandidatesKeepsEachValueInArrivalOrder) {
  REQUIRE_ELECTIONS();
  // More candidates than a short queue has (Redis indexes a longer one: its joins and leaves
  // then take another path, which must keep, check and remove the values alike).
  const auto election_name = name("e");
  constexpr int kCandidates = 12;
  auto first = client().election(election_name);
  first.campaign("c0");
  std::vector<Election> candidates;
  std::vector<turnstile::Acquiring<bool>> campaigns;
  for (int i = 1; i < kCandidates; ++i) {
    candidates.push_back(client().election(election_name));
    campaigns.push_back(candidates.back().campaign_async("c" + std::to_string(i)));
    ASSERT_TRUE(wait_for_waiters(election_name, static_cast<std::size_t>(i)));
  }
  const auto inspection = client().inspect(election_name);
  EXPECT_EQ(inspection.mode, "election");
  ASSERT_EQ(inspection.waiters.size(), static_cast<std::size_t>(kCandidates - 1));
  for (int i = 1; i < kCandidates; ++i) EXPECT_EQ(inspection.waiters[i - 1].value, "c" + std::to_string(i));
  auto mutex = connect().mutex(election_name);
  EXPECT_THROW(static_cast<void>(mutex.try_lock_for(1s)), turnstile::KindMismatch);
  first.resign();
  for (int i = 1; i < kCandidates; ++i) {
    ASSERT_TRUE(campaigns[i - 1].wait_for(10s)) << "candidate " << i;
    EXPECT_TRUE(campaigns[i - 1].get());
    EXPECT_EQ(first.leader()->value, "c" + std::to_string(i));
    candidates[i - 1].resign();
  }
  EXPECT_FALSE(first.leader());
  EXPECT_EQ(client().inspect(election_name).mode, "");
  EXPECT_TRUE(mutex.try_lock());  // the name is free for any use again
  mutex.unlock();
}

// A leader paused past its TTL (SIGSTOP) loses leadership: the next candidate leads, and the
// old leader, continued, finds its leadership lost, and a proclaim refused with HoldLost.
TEST_P(Conformance, ElectionLeaderPausedPastItsTtlFindsItselfLost) {
  if (!has_server()) GTEST_SKIP() << "no lease to outlive here";
  const auto election_name = name("e");
  const auto token_file = scratch_path("token");
  Pipe leading, resumed;
  // Forked before this process has a client's threads; started once elections are known here.
  auto child = Child::spawn_gated([&]() -> int {
    auto own = connect_short_lived(url());
    auto election = lead_and_tell(own, election_name, "paused", token_file, leading);
    if (!resumed.receive(30s)) return 2;
    if (!eventually([&] { return election.lost_token().stop_requested(); }, 10s)) return 3;
    if (election.is_leader() || election.hold_state() != turnstile::HoldState::lost) return 4;
    try {
      election.proclaim("too late");
      return 5;
    } catch (const turnstile::HoldLost&) {
    }
    return 0;
  });
  REQUIRE_ELECTIONS();
  child.start();
  ASSERT_TRUE(leading.receive(15s)) << "the child never led";
  child.kill(SIGSTOP);
  auto next = client().election(election_name);
  const bool led = next.campaign_for("next", 15s);
  child.kill(SIGCONT);
  resumed.send();
  ASSERT_TRUE(led) << "the next candidate did not lead while the leader was paused";
  std::uint64_t paused_token = 0;
  std::ifstream(token_file) >> paused_token;
  EXPECT_GT(next.fencing_token(), paused_token);
  EXPECT_EQ(child.wait(20s), 0) << "the paused leader did not find itself lost (see the child's exit codes)";
  EXPECT_EQ(next.leader()->value, "next");
}

TEST_P(Conformance, ElectionKilledLeaderIsFollowedByTheNext) {
  const auto election_name = name("e");
  const auto token_file = scratch_path("token");
  Pipe leading;
  auto child = Child::spawn_gated([&]() -> int {
    auto own = connect_short_lived(url());  // its leadership outlives it by one short TTL
    auto election = lead_and_tell(own, election_name, "doomed", token_file, leading);
    linger_in_child();
  });
  REQUIRE_ELECTIONS();
  child.start();
  ASSERT_TRUE(leading.receive(15s)) << "the child never led";
  auto next = client().election(election_name);
  auto campaign = next.campaign_async("next");
  ASSERT_TRUE(wait_for_waiters(election_name, 1));
  EXPECT_FALSE(campaign.ready());  // the child leads: the campaign really waits
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  ASSERT_TRUE(campaign.wait_for(15s)) << "the next candidate did not lead after its leader died";
  EXPECT_TRUE(campaign.get());
  std::uint64_t killed_token = 0;
  std::ifstream(token_file) >> killed_token;
  EXPECT_GT(next.fencing_token(), killed_token);
  EXPECT_EQ(next.leader()->value, "next");
}

}  // namespace conformance
