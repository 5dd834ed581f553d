// What only the Consul backend promises, against the Consul test stand-in (tests/servers/
// consul_server.py, built from Consul's documentation and sources; not Consul): Consul's own
// clients' layouts (api.Lock, api.Semaphore), written by hand with curl as their code does.
#include <gtest/gtest.h>

#include <future>

#include <nlohmann/json.hpp>

#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using server_tests::quoted;
using server_tests::shell;

const std::string kLockFlags = "3304740253564472344";
const std::string kSemaphoreFlags = "16210313421097356768";

std::string url() { return server_tests::read_first_line(TURNSTILE_CONSUL_URL_FILE); }
// http://127.0.0.1:PORT of the consul:// URL.
std::string base() {
  auto rest = url().substr(std::string("consul://").size());
  return "http://" + rest.substr(0, rest.find('?'));
}
std::string unique(const std::string& what) {
  return "consul-test/" + std::to_string(getpid()) + "-" + std::to_string(std::rand()) + "/" + what;
}
std::string curl(const std::string& method, const std::string& path, const std::string& body = "") {
  return shell("curl -s -X " + method + " --data-binary " + quoted(body) + " " + quoted(base() + path));
}
// A session as api.Lock makes one (TTL 15s, lock-delay 0 so the test need not wait it out).
std::string peer_session() {
  const auto reply = curl("PUT", "/v1/session/create", R"({"Name":"Consul API Lock","TTL":"15s","LockDelay":"0s"})");
  const auto start = reply.find("\"ID\"");
  const auto quote = reply.find('"', reply.find(':', start) + 1);
  return reply.substr(quote + 1, 36);
}

TEST(Consul, ForeignApiLockHolderExcludesTurnstileAndTurnstileExcludesIt) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("lock");
  const auto session = peer_session();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + session + "&flags=" + kLockFlags), "true");
  auto mutex = client.mutex(name);
  EXPECT_FALSE(mutex.try_lock());
  EXPECT_FALSE(mutex.try_lock_for(300ms));  // waited, and was not admitted
  const auto inspection = client.inspect(name);
  ASSERT_EQ(inspection.holders.size(), 1u);
  EXPECT_NE(inspection.holders[0].host.find(session), std::string::npos);
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?release=" + session + "&flags=" + kLockFlags), "true");
  ASSERT_TRUE(mutex.try_lock_for(5s));
  // Now turnstile holds the key in Consul itself: api.Lock's acquire is refused.
  EXPECT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + session + "&flags=" + kLockFlags), "false");
  mutex.unlock();
  EXPECT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + session + "&flags=" + kLockFlags), "true");
  curl("PUT", "/v1/session/destroy/" + session);
}

TEST(Consul, AKeyWithOtherFlagsIsSomeoneElsesAndIsLeftAlone) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("plain");
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?flags=7", "config"), "true");
  const auto before = curl("GET", "/v1/kv/" + name);
  auto mutex = client.mutex(name);
  EXPECT_THROW(mutex.lock(), turnstile::KindMismatch);
  EXPECT_EQ(curl("GET", "/v1/kv/" + name), before);
  EXPECT_EQ(client.inspect(name).waiters.size(), 0u);
}

TEST(Consul, AForeignApiSemaphoreHolderCountsAgainstTheLimit) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("sem");
  const auto session = peer_session();
  // api/semaphore.go: the contender key, then .lock by CAS from index 0.
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/" + session + "?acquire=" + session + "&flags=" + kSemaphoreFlags), "true");
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/.lock?cas=0&flags=" + kSemaphoreFlags,
                 R"({"Limit":2,"Holders":{")" + session + R"(":true}})"),
            "true");
  auto semaphore = client.semaphore(name, 2);
  auto first = semaphore.try_acquire();
  ASSERT_TRUE(first.has_value());
  EXPECT_FALSE(semaphore.try_acquire_for(300ms).has_value());  // waited: the peer holds the other
  EXPECT_THROW(client.semaphore(name, 3).try_acquire(), turnstile::LimitMismatch);
  // The peer dies: its contender key goes with its session, and it is pruned from .lock.
  curl("PUT", "/v1/session/destroy/" + session);
  EXPECT_TRUE(semaphore.try_acquire_for(5s).has_value());
}

// A lease of several permits is one holder in `.lock` with its count (api.Semaphore writes
// `true`, one permit per session); a peer's `true` still counts one against the limit.
TEST(Consul, ALeaseOfSeveralPermitsIsOneHolderWithItsCount) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("counted");
  auto semaphore = client.semaphore(name, 3);
  auto two = semaphore.try_acquire(2);
  ASSERT_TRUE(two.has_value());
  const auto lock = nlohmann::json::parse(curl("GET", "/v1/kv/" + name + "/.lock"), nullptr, false);
  ASSERT_TRUE(lock.is_array() && lock.size() == 1u) << lock.dump();
  const auto value = nlohmann::json::parse(shell("echo " + quoted(lock[0]["Value"].get<std::string>()) + " | base64 -d"));
  ASSERT_EQ(value["Holders"].size(), 1u) << value.dump();
  EXPECT_EQ(value["Holders"].begin().value(), 2) << value.dump();
  // A peer joins as api.Semaphore would: its contender key, then itself in .lock by CAS.
  const auto session = peer_session();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/" + session + "?acquire=" + session + "&flags=" + kSemaphoreFlags), "true");
  auto with_peer = value;
  with_peer["Holders"][session] = true;
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/.lock?flags=" + kSemaphoreFlags + "&cas=" +
                            std::to_string(lock[0]["ModifyIndex"].get<std::uint64_t>()),
                 with_peer.dump()),
            "true");
  auto other = turnstile::Client::connect(url()).semaphore(name, 3);
  EXPECT_FALSE(other.try_acquire_for(300ms).has_value());  // 2 + the peer's 1: full
  curl("PUT", "/v1/session/destroy/" + session);
  EXPECT_TRUE(other.try_acquire_for(5s).has_value());
}

// kill -9 of a holder: Consul invalidates its session after TTL x 2 (Behavior delete removes its
// keys), then the key's lock-delay (1 s in the suite's URL) runs out; the stand-in accepts a
// 1 s TTL (session_ttl_min lowered). Allowed on top: 1.5 s for the invalidation timer and the
// waiter's retry after the lock-delay.
TEST(Consul, AKilledHolderFreesTheNameWithinTtlTimesTwoPlusLockDelay) {
  server_tests::expect_killed_holder_freed_within(url(), 1s, 2 * 1s + 1s + 1500ms);
}

// The stand-in restarted with its Raft state (consul.sh restart): sessions, keys and indexes
// survive, so holds are suspended while it is down and held again after, never lost. Its own
// stand-in, with session_ttl_min lowered so a 10 s TTL is allowed.
TEST(ConsulOwnServer, ARestartWithItsStateSuspendsThenResumesTheHolds) {
  setenv("CONSUL_TEST_SESSION_TTL_MIN", "1s", 1);
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  server_tests::expect_outage_suspends_then_resumes(
      server.url(), 10s, [&] { ASSERT_EQ(server.stop(), 0); }, [&] { ASSERT_EQ(server.restart(), 0); });
}

// The ModifyIndex of a key on the server itself (0: absent).
std::uint64_t modify_index(const std::string& key) {
  const auto kv = nlohmann::json::parse(curl("GET", "/v1/kv/" + key), nullptr, false);
  return kv.is_array() && !kv.empty() ? kv[0].value("ModifyIndex", std::uint64_t{0}) : 0;
}

// Runs `change` through a proxy whose replies are held: `replies_before` pass, then the next
// request is applied on the server (its key's ModifyIndex moves) and its reply is lost with the
// connection (reset), so libcurl resends it on a fresh connection or the call sees the error.
template <typename Result>
Result with_lost_reply(turnstile_test::TcpProxy& proxy, const std::string& key, int replies_before,
                       std::function<Result()> change) {
  const auto before = modify_index(key);
  proxy.hold_replies();
  auto result = std::async(std::launch::async, change);
  for (int i = 0; i < replies_before; ++i) EXPECT_TRUE(proxy.pass_one_reply(5s));
  EXPECT_TRUE(server_tests::eventually([&] { return modify_index(key) != before; }, 5s));
  proxy.drop_replies();
  EXPECT_TRUE(server_tests::eventually([&] { return proxy.dropped_bytes() > 0; }, 5s));
  proxy.forward();
  proxy.reset();
  return result.get();
}

// Red team (issue 12): the reply of a counter change was lost after it applied; the resend's (or
// the retry's) CAS failed and was read as someone else's change, so the permits went twice.
TEST(Consul, ACounterChangeWhoseReplyWasLostIsAppliedOnce) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("counter-add");
  auto counter = client.permit_counter(name);
  ASSERT_EQ(counter.add_permits(1), 1);
  const auto key = "turnstile/c/" + name;
  EXPECT_EQ(with_lost_reply<std::int64_t>(proxy, key, 1, [&] { return counter.add_permits(5); }), 6);
  EXPECT_EQ(counter.available_permits(), 6);
}

TEST(Consul, ACounterTakeWhoseReplyWasLostTakesOnce) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("counter-take");
  auto counter = client.permit_counter(name);
  ASSERT_EQ(counter.add_permits(10), 10);
  const auto key = "turnstile/c/" + name;
  // The acquire reads the counter and its line, then takes.
  EXPECT_TRUE(with_lost_reply<bool>(proxy, key, 2, [&] { return counter.try_acquire(3); }));
  EXPECT_EQ(counter.available_permits(), 7);
}

// Red team (issue 12): a `.lock` left by api.Semaphore holders that are gone kept its Limit,
// and turnstile wrote it back with that Limit: its peers then admitted past the limit in force.
TEST(Consul, AStaleSemaphoreLockIsRewrittenWithTheLimitInForce) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("stale-sem");
  const auto gone = peer_session();
  curl("PUT", "/v1/session/destroy/" + gone);
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/.lock?cas=0&flags=" + kSemaphoreFlags,
                 R"({"Limit":5,"Holders":{")" + gone + R"(":true}})"),
            "true");
  auto lease = client.semaphore(name, 1).try_acquire();
  ASSERT_TRUE(lease.has_value());
  const auto lock = nlohmann::json::parse(curl("GET", "/v1/kv/" + name + "/.lock"), nullptr, false);
  ASSERT_TRUE(lock.is_array() && lock.size() == 1u) << lock.dump();
  const auto value = nlohmann::json::parse(shell("echo " + quoted(lock[0]["Value"].get<std::string>()) + " | base64 -d"));
  EXPECT_EQ(value["Limit"], 1) << value.dump();
  EXPECT_EQ(client.inspect(name).limit, 1);
  EXPECT_THROW(turnstile::Client::connect(url()).semaphore(name, 5).try_acquire(), turnstile::LimitMismatch);
}

// Red team (issue 12): a Mutex named turnstile/q/X/zzz sat in X's queue for good, one named
// turnstile/c/foo wiped PermitCounter foo on release. Names under turnstile's own keys are refused.
TEST(Consul, NamesUnderTurnstilesOwnKeysAreRefusedAndChangeNothing) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("victim");
  auto counter = client.permit_counter(name);
  ASSERT_EQ(counter.add_permits(5), 5);
  const std::vector<std::string> refused = {"turnstile/c/" + name, "turnstile/q/" + name + "/zzz", "turnstile", "turnstile/"};
  for (const auto& bad : refused) {
    EXPECT_THROW(client.mutex(bad).try_lock(), turnstile::InvalidArgument) << bad;
    EXPECT_THROW(client.semaphore(bad, 2).try_acquire(), turnstile::InvalidArgument) << bad;
    EXPECT_THROW(client.shared_mutex(bad).try_lock_shared(), turnstile::InvalidArgument) << bad;
    EXPECT_THROW(client.permit_counter(bad).add_permits(1), turnstile::InvalidArgument) << bad;
    EXPECT_THROW(client.inspect(bad), turnstile::InvalidArgument) << bad;
  }
  EXPECT_EQ(counter.available_permits(), 5);
  auto mutex = client.mutex(name);
  EXPECT_TRUE(mutex.try_lock());  // no entry was left in its queue
  mutex.unlock();
  EXPECT_EQ(curl("GET", "/v1/kv/turnstile/q/turnstile?recurse"), "");  // nothing written there
}

// Red team (issue 12): a waiter without a deadline gave up (BackendUnavailable) when its
// blocking query was dropped by a restart of the server; it waits through the outage instead.
TEST(ConsulOwnServer, AWaiterWithoutADeadlineWaitsThroughARestart) {
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  const auto name = unique("outage");
  auto holder_client = turnstile::Client::connect(server.url());
  auto waiter_client = turnstile::Client::connect(server.url());
  auto held = holder_client.mutex(name);
  ASSERT_TRUE(held.try_lock());
  auto waiter = waiter_client.mutex(name);
  auto locked = std::async(std::launch::async, [&] {
    waiter.lock();
    return true;
  });
  ASSERT_TRUE(server_tests::eventually([&] { return holder_client.inspect(name).waiters.size() == 1u; }, 5s));
  ASSERT_EQ(server.stop(), 0);
  std::this_thread::sleep_for(300ms);  // the waiter's blocking query is gone, its looks fail
  ASSERT_EQ(server.restart(), 0);
  EXPECT_EQ(locked.wait_for(500ms), std::future_status::timeout);  // still waiting, not failed
  held.unlock();
  ASSERT_EQ(locked.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(locked.get());
  waiter.unlock();
}

}  // namespace
