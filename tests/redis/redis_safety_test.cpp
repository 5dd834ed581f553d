// SPDX-License-Identifier: Apache-2.0
// The Redis backend's safety under the conditions operators really run it in: a message only
// wakes a waiter (never admits it; database-scoped channels), a name's state evicted, deleted
// or restored from an older snapshot (the holder is told, fencing tokens keep growing), a
// restart with its data (holds survive), lost replies (a resent release is recognised, an
// acquire's orphan entry is removed), idle connections closed by the server (counter changes
// are resent safely), numbers up to max_permits, Redisson's channel rule, and key aliasing.
//
// Tests that need a server configured their own way start one (RedisServer below); the others
// use the suite's fixture server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>

#include "conformance/support.hpp"
#include "redis/own_server.hpp"
#include "support/loss_time.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using redis_tests::RedisServer;
using redis_tests::Thaw;

using redis_tests::state_key;

class RedisSafety : public redis_tests::FixtureServerTest {};

// A thread that waits for a Mutex of its own client and says whether it got it (then unlocks).
std::future<bool> wait_for_lock(const std::string& url, const std::string& name, std::chrono::seconds timeout) {
  return std::async(std::launch::async, [=] {
    auto client = Client::connect(url);
    auto mutex = client.mutex(name);
    const bool got = mutex.try_lock_for(timeout);
    if (got) mutex.unlock();
    return got;
  });
}

// A waiter of `name` (in `client`'s database), woken by a message that proves nothing, still
// waits while `holder` holds, and gets in once it unlocks.
void expect_admitted_only_once_released(Client& client, turnstile::Mutex& holder, std::future<bool>& waiter,
                                        const std::string& name) {
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "admitted while the holder held";
  const auto seen = client.inspect(name);
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_EQ(seen.holders.front().fencing_token, holder.fencing_token());
  holder.unlock();
  ASSERT_EQ(waiter.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
}

// Red team (wake-ups): a waiter that no longer looks by itself (the watchdog renews its entry)
// still hears what the server answers about its name: with the state key overwritten by a
// string, every renewal gets WRONGTYPE, and the waiter without a deadline fails with
// BackendUnavailable, as a new acquire would, instead of sleeping on for good.
TEST_F(RedisSafety, AWaiterHearsAnErrorReplyToItsRenewals) {
  const auto name = unique_name("wrongtype");
  auto holder_client = Client::connect(url_);
  auto holder = holder_client.mutex(name);
  holder.lock();
  auto waiting = std::async(std::launch::async, [&] {
    auto client = Client::connect(url_, with_ttl(1500ms));
    try {
      client.mutex(name).lock();
      return std::string("admitted");
    } catch (const turnstile::BackendUnavailable& error) {
      return std::string("BackendUnavailable: ") + error.what();
    } catch (const std::exception& error) {
      return std::string("other: ") + error.what();
    }
  });
  ASSERT_TRUE(eventually([&] { return holder_client.inspect(name).waiters.size() == 1; }));
  ASSERT_EQ(waiting.wait_for(1s), std::future_status::timeout) << "the waiter did not wait";
  // One SET (it replaces a key of any type): a DEL first left a moment with no state at all,
  // in which the waiter could queue afresh on an empty name and be admitted (seen under ASan).
  redis_cli(url_, "SET " + quoted(state_key(name)) + " junk");
  ASSERT_EQ(waiting.wait_for(20s), std::future_status::ready) << "the waiter never heard the error";
  const auto outcome = waiting.get();
  EXPECT_EQ(outcome.rfind("BackendUnavailable", 0), 0u) << outcome;
  EXPECT_NE(outcome.find("WRONGTYPE"), std::string::npos) << outcome;
  redis_cli(url_, "DEL " + quoted(state_key(name)));
  try {
    holder.unlock();  // its hold was lost with the state: not what this test is about
  } catch (const turnstile::Error&) {
  }
}

// Issue 10.1: Pub/Sub ignores the database. A release in db 0 must not admit db 1's waiter of
// the same name while db 1's holder holds.
TEST_F(RedisSafety, AReleaseInOneDatabaseDoesNotAdmitAWaiterInAnother) {
  const auto name = unique_name("db");
  auto client0 = Client::connect(url_ + "/0");
  auto client1 = Client::connect(url_ + "/1");
  auto holder0 = client0.mutex(name);
  auto holder1 = client1.mutex(name);
  holder0.lock();
  holder1.lock();
  auto waiter0 = wait_for_lock(url_ + "/0", name, 20s);
  ASSERT_TRUE(eventually([&] { return client0.inspect(name).waiters.size() == 1; }));
  auto waiter1 = wait_for_lock(url_ + "/1", name, 20s);
  ASSERT_TRUE(eventually([&] { return client1.inspect(name).waiters.size() == 1; }));
  holder0.unlock();
  ASSERT_EQ(waiter0.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(waiter0.get()) << "db 0's waiter was not admitted by db 0's release";
  // db 0's release went out (its waiter got in); db 1's waiter must still wait.
  expect_admitted_only_once_released(client1, holder1, waiter1, name);
}

// Issue 10.1: anyone allowed to PUBLISH must not be able to grant a lock.
TEST_F(RedisSafety, AForgedWakeUpMessageDoesNotAdmitAWaiter) {
  const auto name = unique_name("forged");
  auto client = Client::connect(url_);
  auto holder = client.mutex(name);
  holder.lock();
  auto waiter = wait_for_lock(url_, name, 20s);
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }));
  const auto seq = std::to_string(client.inspect(name).waiters.front().fencing_token);
  // Every channel form turnstile used or uses for the name.
  for (const std::string& channel : {"turnstile:{" + name + "}:w", "turnstile:{" + name + "}:w:0"}) {
    redis_cli(url_, "PUBLISH " + quoted(channel) + " " + seq);
  }
  expect_admitted_only_once_released(client, holder, waiter, name);
}

// Issue 16.1: the name's state deleted by hand while held. The holder is told; the next
// contender's token is still larger than the holder's.
TEST_F(RedisSafety, StateDeletedWhileHeldIsReportedLostAndTokensKeepGrowing) {
  const auto name = unique_name("deleted");
  auto holder_client = Client::connect(url_, with_ttl(1500ms));
  auto holder = holder_client.mutex(name);
  holder.lock();
  const auto lost = holder.lost_token();
  EXPECT_EQ(redis_cli(url_, "DEL " + quoted(state_key(name))), "1");
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 10s)) << "the holder was never told";
  auto other_client = Client::connect(url_);
  auto other = other_client.mutex(name);
  ASSERT_TRUE(other.try_lock_for(5s));
  EXPECT_GT(other.fencing_token(), holder.fencing_token());
  other.unlock();
  EXPECT_THROW(holder.release(), turnstile::HoldLost);
}

// Issue 22.17: a server that may evict lock state is refused by default, with an error naming
// its policy; ?eviction=allow and ?eviction=warn accept it (warn through the error handler).
TEST(RedisSafetyOwnServer, AServerThatMayEvictIsRefusedUnlessAllowed) {
  RedisServer server("--save '' --appendonly no --maxmemory 3mb --maxmemory-policy allkeys-lru");
  for (const std::string query : {"", "?eviction=refuse"}) {
    try {
      Client::connect(server.url() + query);
      ADD_FAILURE() << "connected to a server with allkeys-lru" << query;
    } catch (const turnstile::BackendUnavailable& error) {
      EXPECT_NE(std::string(error.what()).find("maxmemory-policy allkeys-lru"), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find("eviction=allow"), std::string::npos) << error.what();
    }
  }
  std::atomic<int> reports{0};
  turnstile::ClientOptions options;
  options.error_handler = [&](const turnstile::Error&) { ++reports; };
  auto allowed = Client::connect(server.url() + "?eviction=allow", options);
  EXPECT_EQ(reports.load(), 0) << "eviction=allow still warned";
  EXPECT_THROW(Client::connect(server.url() + "?eviction=maybe"), turnstile::InvalidUrl);
  // Repeated (red team, round 3): a clear error, not silently one of them.
  EXPECT_THROW(Client::connect(server.url() + "?eviction=allow&eviction=refuse"), turnstile::InvalidUrl);
  RedisServer safe("--save '' --appendonly no --maxmemory 3mb --maxmemory-policy volatile-lru");
  auto fine = Client::connect(safe.url());
  auto mutex = fine.mutex(unique_name("safe"));
  ASSERT_TRUE(mutex.try_lock_for(1s));
  mutex.unlock();
}

// Issue 16.1: maxmemory with allkeys-lru evicts a held lock's state. Connecting with
// ?eviction=warn warns; the holder is told; the next contender's token is larger.
TEST(RedisSafetyOwnServer, EvictedStateIsReportedLostAndTokensKeepGrowing) {
  RedisServer server("--save '' --appendonly no --maxmemory 3mb --maxmemory-policy allkeys-lru");
  std::vector<std::string> warnings;
  std::mutex warnings_mutex;
  auto options = with_ttl(3s);
  options.error_handler = [&](const turnstile::Error& error) {
    std::lock_guard lock(warnings_mutex);
    warnings.push_back(error.what());
  };
  auto holder_client = Client::connect(server.url() + "?eviction=warn", options);
  {
    std::lock_guard lock(warnings_mutex);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings.front().find("maxmemory-policy allkeys-lru"), std::string::npos) << warnings.front();
  }
  const auto name = unique_name("evicted");
  auto holder = holder_client.mutex(name);
  holder.lock();
  const auto lost = holder.lost_token();
  // Filler until the name's key is evicted: 1.5 MB of new keys per round.
  const auto filler = server.dir() + "/filler";
  const std::string value(1000, 'x');
  for (int round = 0; round < 100 && server.cli("EXISTS " + quoted(state_key(name))) == "1"; ++round) {
    {
      std::ofstream out(filler);
      for (int i = 0; i < 1500; ++i) out << "SET f" << round << ":" << i << " " << value << "\n";
    }
    server.cli("< " + filler + " > /dev/null");
  }
  ASSERT_EQ(server.cli("EXISTS " + quoted(state_key(name))), "0") << "the filler never evicted the lock's state";
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 10s)) << "the holder was never told";
  auto other_client = Client::connect(server.url() + "?eviction=allow", with_ttl(3s));
  auto other = other_client.mutex(name);
  ASSERT_TRUE(other.try_lock_for(5s));
  EXPECT_GT(other.fencing_token(), holder.fencing_token());
  other.unlock();
}

// Issue 16.2: a restart from an older snapshot (RDB) forgets a hold. The next holder's token is
// still larger, and the old holder is told as soon as its client sees the server changed (not
// at its next renewal, TTL/3 = 10 s later).
TEST(RedisSafetyOwnServer, RestartFromAnOlderSnapshotKeepsTokensGrowingAndTellsTheHolderAtOnce) {
  RedisServer server("--save '' --appendonly no --dbfilename dump.rdb");
  const auto name = unique_name("snapshot");
  auto holder_client = Client::connect(server.url(), with_ttl(30s));
  auto holder = holder_client.mutex(name);
  for (int i = 0; i < 3; ++i) {
    holder.lock();
    holder.unlock();
  }
  ASSERT_EQ(server.cli("SAVE"), "OK");
  holder.lock();
  const auto lost = holder.lost_token();
  server.shutdown("NOSAVE");
  server.start();
  auto other_client = Client::connect(server.url());
  auto other = other_client.mutex(name);
  ASSERT_TRUE(other.try_lock_for(5s));
  EXPECT_GT(other.fencing_token(), holder.fencing_token()) << "the same token was handed out twice";
  // Any call of the holder's client finds the new server: its holds are checked at once.
  const auto seen = std::chrono::steady_clock::now();
  holder_client.inspect(name);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 5s)) << "the holder was not told at once";
  EXPECT_LT(std::chrono::steady_clock::now() - seen, 5s);
  other.unlock();
}

// Issue 16.5: a restart that keeps the data (appendonly) keeps the holds: loss is decided by
// the entries, not by the server's run_id.
TEST(RedisSafetyOwnServer, RestartWithItsDataKeepsTheHolds) {
  RedisServer server("--save '' --appendonly yes --appendfsync always");
  HoldStateLog log;
  const auto name = unique_name("appendonly");
  // TTL 3 s: renewed every second, so several renewals reach the restarted server below.
  auto holder_client = Client::connect(server.url(), log.options(3s));
  auto holder = holder_client.mutex(name);
  holder.lock();
  server.shutdown("SAVE");
  server.start();
  holder_client.inspect(name);  // sees the new run_id: the holds are renewed at once
  std::this_thread::sleep_for(2500ms);
  EXPECT_FALSE(holder.lost_token().stop_requested()) << "a restart with intact data reported the hold lost";
  EXPECT_TRUE(eventually([&] { return holder.hold_state() == turnstile::HoldState::held; }, 5s));
  auto other_client = Client::connect(server.url());
  EXPECT_FALSE(other_client.mutex(name).try_lock()) << "the kept hold must still exclude";
  EXPECT_NO_THROW(holder.release());
}

// Issue 10.16/16.11: a release whose reply was lost is resent (by the connection or the
// background retry) and must be recognised as done, not reported as a lost hold.
TEST_F(RedisSafety, AReleaseResentAfterALostReplyIsNotALoss) {
  turnstile_test::TcpProxy proxy(url_);
  const auto name = unique_name("lost-release-reply");
  std::atomic<int> losses{0};
  auto options = with_ttl(30s);
  options.on_hold_lost = [&](const turnstile::Error&) { ++losses; };
  options.error_handler = [](const turnstile::Error&) {};  // the first attempt's failure
  auto client = Client::connect(proxy.url_through(url_), options);
  auto mutex = client.mutex(name);
  mutex.lock();
  proxy.drop_next_reply();
  mutex.unlock();
  auto observer = Client::connect(url_);
  ASSERT_TRUE(eventually([&] { return observer.inspect(name).holders.empty(); }, 15s));
  std::this_thread::sleep_for(300ms);  // a background retry may still be reporting
  EXPECT_EQ(losses.load(), 0) << "the resent release was reported as a lost hold";
  EXPECT_GT(proxy.dropped_bytes(), 0u);
}

// Issue 10.16/16.11: an acquire whose reply was lost made an entry nobody owns: it is found by
// its request id and removed before the call returns, not left to hold up the name for a TTL.
TEST_F(RedisSafety, AnAcquireWhoseReplyWasLostLeavesNoEntry) {
  turnstile_test::TcpProxy proxy(url_);
  const auto name = unique_name("lost-acquire-reply");
  auto holder_client = Client::connect(url_);
  auto holder = holder_client.mutex(name);
  holder.lock();
  auto client = Client::connect(proxy.url_through(url_), with_ttl(30s));
  auto mutex = client.mutex(name);
  proxy.drop_next_reply();
  try {
    EXPECT_FALSE(mutex.try_lock_for(1500ms));
  } catch (const turnstile::BackendUnavailable&) {
  }
  EXPECT_GT(proxy.dropped_bytes(), 0u);
  EXPECT_TRUE(holder_client.inspect(name).waiters.empty()) << "an unowned entry was left in the queue";
  holder.unlock();
}

// Issue 16.6: a server that closed our idle connection (its `timeout`) must not cost permits:
// counter changes carry request ids and are resent safely.
TEST(RedisSafetyOwnServer, CounterChangesSurviveAnIdleConnectionClosedByTheServer) {
  RedisServer server("--save '' --appendonly no --timeout 1");
  auto client = Client::connect(server.url());
  auto counter = client.permit_counter(unique_name("idle"));
  ASSERT_TRUE(counter.try_set_permits(5));
  counter.acquire(2);
  std::this_thread::sleep_for(2500ms);  // the server closes idle clients after 1 s
  EXPECT_NO_THROW(counter.release(2));
  EXPECT_EQ(counter.available_permits(), 5);
  std::this_thread::sleep_for(2500ms);
  EXPECT_EQ(counter.add_permits(3), 8);
  EXPECT_EQ(counter.drain_permits(), 8);
}

// Issue 10.5: limits and permits up to max_permits are carried exactly through Lua; a count a
// peer pushed beyond it does not wedge the counter.
TEST_F(RedisSafety, NumbersUpToMaxPermitsAreExact) {
  constexpr auto max = turnstile::max_permits;
  auto client = Client::connect(url_);
  const auto name = unique_name("big");
  auto semaphore = client.semaphore(name, max);
  auto most = semaphore.acquire(max - 1);
  auto last = semaphore.try_acquire(1);
  ASSERT_TRUE(last.has_value()) << "the last permit below the limit was refused";
  EXPECT_FALSE(semaphore.try_acquire(1).has_value()) << "a permit beyond the limit was granted";
  const auto seen = client.inspect(name);
  EXPECT_EQ(seen.limit, max);
  ASSERT_EQ(seen.holders.size(), 2u);
  EXPECT_EQ(seen.holders.front().permits, max - 1);
  most.release();
  last->release();
  auto again = semaphore.try_acquire(max);
  EXPECT_TRUE(again.has_value()) << "the name was wedged";

  auto counter = client.permit_counter(unique_name("big-counter"));
  EXPECT_TRUE(counter.try_set_permits(max));
  EXPECT_EQ(counter.available_permits(), max);
  EXPECT_THROW(counter.release(1), turnstile::InvalidArgument);
  EXPECT_EQ(counter.available_permits(), max);
  EXPECT_TRUE(counter.try_acquire(max));
  EXPECT_EQ(counter.add_permits(-max), -max);
  EXPECT_THROW(counter.add_permits(-1), turnstile::InvalidArgument);
  // A peer (Redisson) pushed the count far beyond the maximum: moving it back still works.
  redis_cli(url_, "SET " + quoted(counter.name()) + " 5000000000000000");
  EXPECT_TRUE(counter.try_acquire(max));
  EXPECT_EQ(counter.add_permits(-max), 5000000000000000 - 2 * max);
  EXPECT_THROW(counter.release(1), turnstile::InvalidArgument);
  redis_cli(url_, "DEL " + quoted(counter.name()));
}

// Issue 16.4: state no script wrote (a hand edit, a partial write) is dropped, never fatal.
TEST_F(RedisSafety, UnreadableStateIsDroppedNotFatal) {
  const auto name = unique_name("garbage");
  auto client = Client::connect(url_);
  auto mutex = client.mutex(name);
  mutex.lock();
  mutex.unlock();
  redis_cli(url_, "HSET " + quoted(state_key(name)) + " 123 garbage 1 'x0 1 0 nonsense' stray field");
  EXPECT_TRUE(mutex.try_lock_for(5s));
  EXPECT_EQ(client.inspect(name).holders.size(), 1u);
  mutex.unlock();
  EXPECT_TRUE(client.inspect(name).holders.empty());
}

// Issue 10.11: a PermitCounter name that would reach turnstile's own keys is refused, and
// nothing is written: no counter can reset a lock's fencing counter.
TEST_F(RedisSafety, CounterNamesCannotReachTurnstilesKeys) {
  const auto name = unique_name("jobs");
  auto client = Client::connect(url_);
  auto mutex = client.mutex(name);
  mutex.lock();
  mutex.unlock();
  const auto before = redis_cli(url_, "HGETALL " + quoted(state_key(name)));
  for (const std::string& alias :
       {state_key(name), "turnstile:{" + name + "}:seq", "{" + name + "}:turnstile:c", name + "{x}:turnstile:t"}) {
    auto counter = client.permit_counter(alias);
    EXPECT_THROW(counter.drain_permits(), turnstile::InvalidArgument) << alias;
    EXPECT_THROW(counter.try_set_permits(1), turnstile::InvalidArgument) << alias;
    EXPECT_THROW(counter.add_permits(1), turnstile::InvalidArgument) << alias;
    EXPECT_THROW(counter.available_permits(), turnstile::InvalidArgument) << alias;
    EXPECT_THROW(counter.try_acquire(1), turnstile::InvalidArgument) << alias;
  }
  EXPECT_EQ(redis_cli(url_, "HGETALL " + quoted(state_key(name))), before);
  const auto token = [&] {
    mutex.lock();
    const auto t = mutex.fencing_token();
    mutex.unlock();
    return t;
  };
  const auto first = token();
  EXPECT_GT(token(), first);
}

// What a subscriber to `channel` hears while `act` runs: the first message's payload ("" when
// none within 10 s). Through python3-redis, as a Redisson client would listen.
std::string first_message_on(const std::string& url, const std::string& channel, const std::function<void()>& act) {
  const auto script =
      "import redis,sys,time\n"
      "r=redis.Redis.from_url(sys.argv[1]); p=r.pubsub(); p.subscribe(sys.argv[2]); p.get_message(timeout=5)\n"
      "print('subscribed', flush=True)\n"
      "end=time.time()+10\n"
      "while time.time()<end:\n"
      "  m=p.get_message(timeout=1)\n"
      "  if m and m['type']=='message': print(m['data'].decode(), flush=True); break\n";
  auto heard = std::async(std::launch::async, [&] {
    return shell("/usr/bin/python3 -c " + quoted(script) + " " + quoted(url) + " " + quoted(channel));
  });
  eventually([&] { return redis_cli(url, "PUBSUB NUMSUB " + quoted(channel)).find("\n1") != std::string::npos; }, 10s);
  act();
  const auto output = heard.get();
  const auto at = output.find("subscribed\n");
  return at == std::string::npos ? "" : output.substr(at + 11);
}

// Issue 10.10: Redisson's channel is redisson_sc:{NAME}, or redisson_sc:NAME when NAME already
// contains '{' (RedissonObject.prefixName). Releases are heard by Redisson's waiters on both.
TEST_F(RedisSafety, CounterReleasesUseRedissonsChannelForEveryName) {
  auto client = Client::connect(url_);
  for (const std::string name : {"plain", "with {tag}", "open { only"}) {
    const auto full = unique_name(name);
    const auto expected = full.find('{') == std::string::npos ? "redisson_sc:{" + full + "}" : "redisson_sc:" + full;
    auto counter = client.permit_counter(full);
    EXPECT_EQ(first_message_on(url_, expected, [&] { counter.release(3); }), "3") << expected;
    redis_cli(url_, "DEL " + quoted(full));
  }
}

// Issue 16.11: several PermitCounter waiters in one client. When the first in line is not the
// client's oldest waiter (that one lost its place), a release still wakes the first in line
// at once, not at its next periodic look (2 s).
TEST_F(RedisSafety, AReleaseWakesTheFirstInLineAmongOneClientsWaiters) {
  auto client = Client::connect(url_);
  const auto name = unique_name("counter-head");
  auto counter = client.permit_counter(name);
  ASSERT_TRUE(counter.try_set_permits(0));
  auto older = std::async(std::launch::async, [&] { return counter.try_acquire_for(20s, 1); });
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }));
  const auto older_place = client.inspect(name).waiters.front().fencing_token;
  std::atomic<std::chrono::steady_clock::time_point> got_at{};
  auto head = std::async(std::launch::async, [&] {
    const bool got = counter.try_acquire_for(20s, 1);
    got_at = std::chrono::steady_clock::now();
    return got;
  });
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 2; }));
  // The older waiter loses its place (as when paused past its lease): the younger is first.
  const std::string line = "{" + name + "}:turnstile:c";
  ASSERT_EQ(redis_cli(url_, "HDEL " + quoted(line) + " " + std::to_string(older_place)), "1");
  std::this_thread::sleep_for(300ms);
  auto other = Client::connect(url_);
  const auto released_at = std::chrono::steady_clock::now();
  other.permit_counter(name).release(1);
  ASSERT_EQ(head.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(head.get());
  EXPECT_LT(got_at.load() - released_at, 700ms) << "the first in line waited for its periodic look";
  other.permit_counter(name).release(1);
  EXPECT_TRUE(older.get());
  redis_cli(url_, "DEL " + quoted(name) + " " + quoted(line));
}

// Issue 16 (rt1 F2): a 'seq' no script wrote (a hand edit, a hostile writer) must not make two
// holders, hand out a token that is not exact, or drop a live entry: it is ignored in favour
// of the entries and the clock floor. Near 2^53 tokens stay exact and strictly increasing, and
// past it the acquire is refused with a clear error, nothing changed.
TEST_F(RedisSafety, AnUnreadableOrHugeSeqNeverMakesTwoHoldersOrEqualTokens) {
  auto client = Client::connect(url_);
  auto other_client = Client::connect(url_);
  for (const std::string bad : {"1e300", "99999999999999999999", "inf", "-5", "9007199254740993", "x"}) {
    const auto name = unique_name("bad-seq");
    redis_cli(url_, "HSET " + quoted(state_key(name)) + " seq " + bad);
    auto holder = client.mutex(name);
    holder.lock();
    const auto token = holder.fencing_token();
    EXPECT_GT(token, 0u) << bad;
    EXPECT_LT(token, std::uint64_t{1} << 53) << bad;
    auto contender = other_client.mutex(name);
    EXPECT_FALSE(contender.try_lock()) << "a second holder beside the first, seq " << bad;
    const auto seen = client.inspect(name);
    ASSERT_EQ(seen.holders.size(), 1u) << "the holder's entry was dropped, seq " << bad;
    EXPECT_EQ(seen.holders.front().fencing_token, token) << bad;
    EXPECT_NO_THROW(holder.release()) << bad;
    ASSERT_TRUE(contender.try_lock()) << bad;
    EXPECT_GT(contender.fencing_token(), token) << bad;
    contender.unlock();
    redis_cli(url_, "DEL " + quoted(state_key(name)));
  }
  const auto name = unique_name("top-seq");
  redis_cli(url_, "HSET " + quoted(state_key(name)) + " seq 9007199254740989");
  auto mutex = client.mutex(name);
  for (const std::uint64_t expected : {9007199254740990ull, 9007199254740991ull}) {
    mutex.lock();
    EXPECT_EQ(mutex.fencing_token(), expected);
    mutex.unlock();
  }
  // The queue as stored, but for the client's request records (what its requests did).
  const auto queue_state = [&] {
    std::string state;
    for (const auto& field : {"seq", "w"})
      state += redis_cli(url_, "HGET " + quoted(state_key(name)) + " " + field) + "\n";
    return state + redis_cli(url_, "HLEN " + quoted(state_key(name)));
  };
  const auto before = queue_state();
  try {
    mutex.lock();
    ADD_FAILURE() << "a token past 2^53-1 was handed out: " << mutex.fencing_token();
    mutex.unlock();
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("2^53"), std::string::npos) << error.what();
  }
  EXPECT_EQ(queue_state(), before) << "the refused acquire changed the state";
  EXPECT_EQ(redis_cli(url_, "HGET " + quoted(state_key(name)) + " seq"), "9007199254740991");
  redis_cli(url_, "DEL " + quoted(state_key(name)));
}

// Issue 16 (rt1 F4): a renewal whose snapshot still named a hold reaches the server after the
// release removed its entry. Its "gone" must not report the released hold lost. Writes are
// paused so that the release is queued first and a renewal behind it (renewals every 500 ms),
// then both run in that order.
TEST(RedisSafetyOwnServer, ARenewalThatCrossesTheReleaseIsNoLoss) {
  RedisServer server("--save '' --appendonly no");
  std::atomic<int> losses{0};
  auto options = with_ttl(1500ms);
  options.on_hold_lost = [&](const turnstile::Error&) { ++losses; };
  auto client = Client::connect(server.url(), options);
  auto semaphore = client.semaphore(unique_name("crossing"), 1);
  for (int round = 0; round < 2; ++round) {
    auto lease = semaphore.acquire();
    ASSERT_EQ(server.cli("CLIENT PAUSE 5000 WRITE"), "OK");
    auto released = std::async(std::launch::async, [&] { lease.release(); });
    ASSERT_TRUE(eventually([&] { return server.blocked_clients() >= 1; }, 2s)) << "the release never came";
    ASSERT_TRUE(eventually([&] { return server.blocked_clients() >= 2; }, 2s)) << "no renewal came";
    server.cli("CLIENT UNPAUSE");
    EXPECT_NO_THROW(released.get()) << "round " << round;
    EXPECT_EQ(losses.load(), 0) << "round " << round;
  }
}

// Issue 16 (rt1 F5): a restart without data. The holder's idle renewal connection gets an EOF
// at the shutdown, and the holder is told as soon as the server answers again, not at its
// next periodic renewal (TTL/3 = 10 s after the lock here).
TEST(RedisSafetyOwnServer, ARestartWithoutDataIsNoticedAtOnceNotAtTheNextRenewal) {
  RedisServer server("--save '' --appendonly no");
  auto client = Client::connect(server.url(), with_ttl(30s));
  const auto name = unique_name("restart-at-once");
  auto holder = client.mutex(name);
  holder.lock();
  const auto lost = holder.lost_token();
  server.shutdown("NOSAVE");
  server.start();
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 4s))
      << "the holder was not told before its next renewal";
  auto other_client = Client::connect(server.url());
  auto other = other_client.mutex(name);
  ASSERT_TRUE(other.try_lock_for(5s));
  EXPECT_GT(other.fencing_token(), holder.fencing_token());
  other.unlock();
  EXPECT_THROW(holder.release(), turnstile::HoldLost);
}

// Runs `acquire(stop)` twice while the server is frozen (SIGSTOP: connections stay open, nothing
// answers) and expects each to end with false soon after its stop (a bounded leave at most):
// first stopped while a look waits for the server (frozen once `in_line`), then while the
// acquire's first call does. Thaws the server at the end.
void expect_a_stop_to_end_acquires_on_a_frozen_server(const RedisServer& server,
                                                      const std::function<bool(std::stop_token)>& acquire,
                                                      const std::function<bool()>& in_line) {
  std::stop_source stop;
  auto waited = std::async(std::launch::async, [&] { return acquire(stop.get_token()); });
  const Thaw thaw_first{server};  // should the test fail: before the future's destructor waits
  ASSERT_TRUE(eventually(in_line)) << "the waiter is not waiting";
  server.signal(SIGSTOP);
  std::this_thread::sleep_for(1200ms);
  stop.request_stop();
  ASSERT_EQ(waited.wait_for(5s), std::future_status::ready) << "a look to the frozen server ignored the stop";
  EXPECT_FALSE(waited.get());
  std::stop_source stop2;
  auto first_call = std::async(std::launch::async, [&] { return acquire(stop2.get_token()); });
  const Thaw thaw_second{server};
  std::this_thread::sleep_for(500ms);
  stop2.request_stop();
  ASSERT_EQ(first_call.wait_for(5s), std::future_status::ready) << "the acquire's first call ignored the stop";
  EXPECT_FALSE(first_call.get());
  server.signal(SIGCONT);
}

// Issue 16 (rt1 F6): lock(stop_token) while the server is frozen. A stop ends the wait at once;
// once the server answers again the entries are removed (by request id where the acquire's
// outcome was unknown).
TEST(RedisSafetyOwnServer, AStopWhileTheServerIsFrozenEndsTheWaitAndLeavesTheQueue) {
  RedisServer server("--save '' --appendonly no");
  const auto name = unique_name("frozen-stop");
  auto holder_client = Client::connect(server.url());
  auto holder = holder_client.mutex(name);
  holder.lock();
  // TTL 1.5 s: the waiter looks every 500 ms, so a look is waiting for the frozen server.
  auto waiter_client = Client::connect(server.url(), with_ttl(1500ms));
  expect_a_stop_to_end_acquires_on_a_frozen_server(
      server, [&](std::stop_token stop) { return waiter_client.mutex(name).lock(std::move(stop)); },
      [&] { return holder_client.inspect(name).waiters.size() == 1; });
  EXPECT_TRUE(eventually([&] { return holder_client.inspect(name).waiters.empty(); }, 10s))
      << "a stopped waiter's entry stayed in the queue";
  ASSERT_EQ(holder_client.inspect(name).holders.size(), 1u);
  holder.unlock();
}

// Issue 16 (rt1 F8): a waiter whose entry vanished (paused past its TTL, or the server restarted
// without data) held nothing: it queues again at the back instead of failing with HoldLost,
// and is still not admitted while the holder holds.
TEST_F(RedisSafety, AWaiterWhoseEntryVanishedQueuesAgain) {
  const auto name = unique_name("rejoin");
  auto holder_client = Client::connect(url_);
  auto holder = holder_client.mutex(name);
  holder.lock();
  auto waiter = wait_for_lock(url_, name, 20s);
  ASSERT_TRUE(eventually([&] { return holder_client.inspect(name).waiters.size() == 1; }));
  const auto first = holder_client.inspect(name).waiters.front().fencing_token;
  ASSERT_EQ(redis_cli(url_, "HDEL " + quoted(state_key(name)) + " " + std::to_string(first)), "1");
  // Woken at once (a wake-up proves nothing: it looks, finds its entry gone, queues again).
  redis_cli(url_, "PUBLISH " + quoted("turnstile:{" + name + "}:w:0") + " " + std::to_string(first));
  ASSERT_TRUE(eventually([&] {
    const auto seen = holder_client.inspect(name);
    return seen.waiters.size() == 1 && seen.waiters.front().fencing_token > first;
  })) << "the waiter did not queue again";
  expect_admitted_only_once_released(holder_client, holder, waiter, name);
}

// Issue 16 (rt1): a release against a frozen server is bounded as docs/backends/redis.md says: at most a
// second, and no longer once its hold is reported lost (it is retried in the background); a
// hold already lost gets one short try.
TEST(RedisSafetyOwnServer, AReleaseAgainstAFrozenServerEndsWhenTheHoldIsLost) {
  RedisServer server("--save '' --appendonly no");
  auto options = with_ttl(1500ms);
  options.error_handler = [](const turnstile::Error&) {};  // background retries failing
  auto client = Client::connect(server.url(), options);
  auto semaphore = client.semaphore(unique_name("frozen-release"), 2);
  auto early = semaphore.acquire();
  auto late = semaphore.acquire();
  server.signal(SIGSTOP);
  // Suspended: a renewal went unanswered for 500 ms; the loss comes at most 350 ms later
  // (1.35 s after the last confirmed renewal was sent, 500 ms before that one).
  ASSERT_TRUE(eventually([&] { return early.hold_state() == turnstile::HoldState::suspended; }, 3s));
  const auto lost = early.lost_token();
  const turnstile_test::LossTime lost_at(lost);
  EXPECT_THROW(early.release(), turnstile::HoldLost);
  const auto returned = std::chrono::steady_clock::now();
  ASSERT_TRUE(lost.stop_requested());
  // The release may return before the reporting thread ran the stamping callback (CI, stop 33).
  ASSERT_TRUE(lost_at.stamped()) << "the loss was flagged but its callbacks never ran";
  EXPECT_LT(returned - lost_at.at(), 250ms) << "the release kept waiting after its hold was reported lost";
  const auto begun = std::chrono::steady_clock::now();
  EXPECT_THROW(late.release(), turnstile::HoldLost);
  EXPECT_LT(std::chrono::steady_clock::now() - begun, 1s) << "a lost hold's release took more than a second";
  server.signal(SIGCONT);
}

// Red team r11 F1: PermitCounter::acquire(n, stop_token) while the server is frozen ends as
// lock(stop_token) does; the count is untouched and the places in line go (with their leases).
TEST(RedisSafetyOwnServer, AStopWhileTheServerIsFrozenEndsACounterAcquire) {
  RedisServer server("--save '' --appendonly no");
  const auto name = unique_name("frozen-counter");
  auto setter = Client::connect(server.url());
  ASSERT_TRUE(setter.permit_counter(name).try_set_permits(0));
  // TTL 1.5 s: the waiter looks every 500 ms, so a look is waiting for the frozen server.
  auto waiter_client = Client::connect(server.url(), with_ttl(1500ms));
  auto counter = waiter_client.permit_counter(name);
  expect_a_stop_to_end_acquires_on_a_frozen_server(
      server, [&](std::stop_token stop) { return counter.acquire(1, std::move(stop)); },
      [&] { return setter.inspect(name).waiters.size() == 1; });
  EXPECT_TRUE(eventually([&] { return setter.inspect(name).waiters.empty(); }, 10s))
      << "a stopped waiter's place stayed in line";
  EXPECT_EQ(setter.permit_counter(name).available_permits(), 0);
}

// A PermitCounter waiter without a deadline waits through an outage longer than one call's
// patience (5 s), as a queue waiter does, and takes the permits once they come.
TEST(RedisSafetyOwnServer, ACounterWaiterWithoutADeadlineWaitsThroughAnOutage) {
  RedisServer server("--save '' --appendonly no");
  const auto name = unique_name("outage-counter");
  auto setter = Client::connect(server.url());
  ASSERT_TRUE(setter.permit_counter(name).try_set_permits(0));
  auto waiter_client = Client::connect(server.url(), with_ttl(30s));
  auto counter = waiter_client.permit_counter(name);
  auto waiting = std::async(std::launch::async, [&] {
    try {
      counter.acquire(1);
      return std::string("taken");
    } catch (const turnstile::Error& error) {
      return std::string(error.what());
    }
  });
  ASSERT_TRUE(eventually([&] { return setter.inspect(name).waiters.size() == 1; })) << "never in line";
  server.signal(SIGSTOP);
  // Longer than a re-check interval (2 s) plus one call's patience (5 s): a look times out.
  std::this_thread::sleep_for(8500ms);
  server.signal(SIGCONT);
  ASSERT_EQ(waiting.wait_for(0s), std::future_status::timeout) << "the waiter gave up: " << waiting.get();
  setter.permit_counter(name).release(1);
  ASSERT_EQ(waiting.wait_for(10s), std::future_status::ready) << "the waiter did not take the released permit";
  EXPECT_EQ(waiting.get(), "taken");
  EXPECT_EQ(setter.permit_counter(name).available_permits(), 0);
}

// Red team r11 F3: a short deadline on a healthy server is a timeout, never BackendUnavailable.
// The join must reach the server once: its reply, held back by the proxy past the deadline,
// still decides (admitted: held; waiting: false, and the entry leaves).
TEST_F(RedisSafety, AJoinAnsweredAfterAShortDeadlineDecides) {
  turnstile_test::TcpProxy proxy(url_);
  auto client = Client::connect(proxy.url_through(url_));
  auto direct = Client::connect(url_);
  const auto name = unique_name("late-join");
  auto mutex = client.mutex(name);
  const auto late_answer = [&](auto attempt) {
    proxy.hold_replies();
    auto got = std::async(std::launch::async, attempt);
    std::this_thread::sleep_for(300ms);
    proxy.forward();
    return got.get();  // BackendUnavailable when the join ended at the deadline
  };
  std::vector<std::uint64_t> holders;
  ASSERT_TRUE(late_answer([&] {
    if (!mutex.try_lock_for(50ms)) return false;
    for (const auto& entry : direct.inspect(name).holders) holders.push_back(entry.fencing_token);
    holders.push_back(mutex.fencing_token());
    mutex.unlock();  // on the thread that holds it
    return true;
  })) << "admitted, but not held";
  ASSERT_EQ(holders.size(), 2u);
  EXPECT_EQ(holders[0], holders[1]) << "the server's holder is not ours";

  auto holder = direct.mutex(name);
  holder.lock();
  auto waiter = client.mutex(name);
  EXPECT_FALSE(late_answer([&] { return waiter.try_lock_for(50ms); }));
  EXPECT_TRUE(eventually([&] { return direct.inspect(name).waiters.empty(); })) << "the timed-out entry stayed";
  // Deadlines shorter than a round trip, with no proxy in the way: each is a timeout.
  auto near_client = Client::connect(url_);
  auto near = near_client.mutex(name);
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(near.try_lock_for(std::chrono::microseconds(200 + 10 * i)));
  holder.unlock();
}

}  // namespace
