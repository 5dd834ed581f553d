// SPDX-License-Identifier: Apache-2.0
// What only the Consul backend promises, against the Consul test stand-in (tests/servers/
// consul_server.py, built from Consul's documentation and sources; not Consul): Consul's own
// clients' layouts (api.Lock, api.Semaphore), written by hand with curl as their code does.
#include <gtest/gtest.h>

#include <filesystem>
#include <future>

#include <nlohmann/json.hpp>

#include "consul/consul_test_support.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using namespace consul_tests;

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
  EXPECT_NE(inspection.holders[0].foreign.find(session), std::string::npos);
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
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/" + session + "?acquire=" + session + "&flags=" + kSemaphoreFlags),
            "true");
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
  const auto value =
      nlohmann::json::parse(shell("echo " + quoted(lock[0]["Value"].get<std::string>()) + " | base64 -d"));
  ASSERT_EQ(value["Holders"].size(), 1u) << value.dump();
  EXPECT_EQ(value["Holders"].begin().value(), 2) << value.dump();
  // A peer joins as api.Semaphore would: its contender key, then itself in .lock by CAS.
  const auto session = peer_session();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "/" + session + "?acquire=" + session + "&flags=" + kSemaphoreFlags),
            "true");
  auto with_peer = value;
  with_peer["Holders"][session] = true;
  ASSERT_EQ(curl("PUT",
                 "/v1/kv/" + name + "/.lock?flags=" + kSemaphoreFlags +
                     "&cas=" + std::to_string(lock[0]["ModifyIndex"].get<std::uint64_t>()),
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

// Red team (issue 12): a Semaphore hold whose reply was lost after it applied was resent by
// libcurl; the resend's CAS on `.lock` failed, was read as a lost race, and the permit's session
// went back to the spares still counted in `.lock`: a permit leaked for as long as the client ran.
TEST(Consul, ASemaphoreHoldWhoseReplyWasLostHoldsOnePermitOnce) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("sem-lost-reply");
  auto semaphore = client.semaphore(name, 1);
  std::optional<turnstile::Lease> lease;
  // The acquire joins (one reply), makes the permit's session (one), then holds.
  EXPECT_TRUE(with_lost_reply<bool>(proxy, name + "/.lock", 2, [&] {
    lease = semaphore.try_acquire_for(5s);
    return lease.has_value();
  }));
  ASSERT_TRUE(lease.has_value());
  const auto lock = nlohmann::json::parse(curl("GET", "/v1/kv/" + name + "/.lock"), nullptr, false);
  ASSERT_TRUE(lock.is_array() && lock.size() == 1u) << lock.dump();
  const auto value =
      nlohmann::json::parse(shell("echo " + quoted(lock[0]["Value"].get<std::string>()) + " | base64 -d"));
  EXPECT_EQ(value["Holders"].size(), 1u) << value.dump();
  lease.reset();
  // Nothing of it is left: no holder in `.lock`, no contender key, the permit free for another.
  EXPECT_EQ(curl("GET", "/v1/kv/" + name + "/?recurse"), "");
  EXPECT_TRUE(turnstile::Client::connect(url()).semaphore(name, 1).try_acquire().has_value());
}

// A hold taken and given back on a thread of its own (a turnstile lock belongs to the thread
// that took it), while the test looks on from outside.
class HoldOnThread {
 public:
  HoldOnThread(std::function<bool()> take, std::function<void()> give_back)
      : thread_([this, take, give_back] {
          bool held = false;
          try {
            held = take();
            taken_.set_value(held);
          } catch (...) {
            taken_.set_exception(std::current_exception());
          }
          release_.get_future().wait();
          if (held) give_back();
          released_.set_value();
        }) {}
  ~HoldOnThread() {
    release();
    thread_.join();
  }
  std::future<bool> taken() { return taken_.get_future(); }
  void release() {
    if (std::exchange(release_asked_, true)) return;
    release_.set_value();
    released_.get_future().wait();
  }

 private:
  std::promise<bool> taken_;
  std::promise<void> release_;
  std::promise<void> released_;
  bool release_asked_ = false;
  std::thread thread_;
};

// An uncontended exclusive lock is one transaction (take_at_once); its reply lost after it
// applied, libcurl's resend finds our own entry and holds once, leaving nothing behind.
TEST(Consul, AnExclusiveTakeWhoseReplyWasLostHoldsOnce) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("lock-lost-reply");
  auto mutex = client.mutex(name);
  std::unique_ptr<HoldOnThread> hold;
  EXPECT_TRUE(with_lost_reply<bool>(proxy, name, 0, [&] {
    hold = std::make_unique<HoldOnThread>([&] { return mutex.try_lock_for(5s); }, [&] { mutex.unlock(); });
    return hold->taken().get();
  }));
  EXPECT_EQ(client.inspect(name).holders.size(), 1u);
  auto other = turnstile::Client::connect(url()).mutex(name);
  EXPECT_FALSE(other.try_lock());
  hold->release();
  EXPECT_EQ(curl("GET", "/v1/kv/turnstile/q/" + name + "/?recurse"), "");
  EXPECT_TRUE(other.try_lock());
  other.unlock();
}

// The occupancy key lets an exclusive lock take a free name in one step; it must stay while
// anyone is in the queue (a reader, a waiter) and go with the last one out.
TEST(Consul, TheOccupancyKeyStaysWhileAnyoneIsInTheQueueAndGoesWithTheLastOneOut) {
  auto reader_client = turnstile::Client::connect(url());
  auto writer_client = turnstile::Client::connect(url());
  const auto name = unique("occupancy");
  const auto occupancy = "/v1/kv/turnstile/o/" + name;
  auto reader = reader_client.shared_mutex(name);
  auto writer = writer_client.shared_mutex(name);
  ASSERT_TRUE(reader.try_lock_shared());
  EXPECT_NE(curl("GET", occupancy), "");
  EXPECT_FALSE(writer.try_lock());  // a reader holds: the one-step take must not pass it
  HoldOnThread written(
      [&] {
        writer.lock();
        return true;
      },
      [&] { writer.unlock(); });
  auto taken = written.taken();
  ASSERT_TRUE(server_tests::eventually([&] { return reader_client.inspect(name).waiters.size() == 1u; }, 5s));
  // A newcomer's one-step take must not jump the waiting writer either.
  auto newcomer = turnstile::Client::connect(url()).mutex(name);
  EXPECT_FALSE(newcomer.try_lock());
  reader.unlock_shared();
  ASSERT_EQ(taken.wait_for(5s), std::future_status::ready);
  EXPECT_NE(curl("GET", occupancy), "");
  written.release();
  EXPECT_EQ(curl("GET", occupancy), "");  // the last one out ended it
  ASSERT_TRUE(newcomer.try_lock());
  EXPECT_NE(curl("GET", occupancy), "");
  newcomer.unlock();
  EXPECT_EQ(curl("GET", occupancy), "");
  // One who tried while the name was held and gave up: the holder's release still ends the
  // occupancy (it finds the queue empty after its own compare-and-swap lost to that try; before
  // occupancy.cpp the key stayed until the next one alone in the queue).
  ASSERT_TRUE(newcomer.try_lock());
  EXPECT_FALSE(turnstile::Client::connect(url()).mutex(name).try_lock());
  newcomer.unlock();
  EXPECT_EQ(curl("GET", occupancy), "");
  ASSERT_TRUE(newcomer.try_lock());
  newcomer.unlock();
  EXPECT_EQ(curl("GET", occupancy), "");
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
  const auto value =
      nlohmann::json::parse(shell("echo " + quoted(lock[0]["Value"].get<std::string>()) + " | base64 -d"));
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
  const std::vector<std::string> refused = {"turnstile/c/" + name, "turnstile/q/" + name + "/zzz", "turnstile",
                                            "turnstile/"};
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

// Red team (issue 12): a timed waiter whose server went away threw BackendUnavailable at its
// deadline (its last look failed); it waits through the outage within the deadline and then
// ends not admitted, as a wait that ran out does, and its entry goes once the server is back.
TEST(ConsulOwnServer, ATimedWaiterThroughAnOutageEndsNotAdmittedAtItsDeadline) {
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  const auto name = unique("outage-deadline");
  auto holder_client = turnstile::Client::connect(server.url());
  auto waiter_client = turnstile::Client::connect(server.url());
  auto held = holder_client.mutex(name);
  ASSERT_TRUE(held.try_lock());
  auto waiter = waiter_client.mutex(name);
  HoldOnThread waiting([&] { return waiter.try_lock_for(3s); }, [&] { waiter.unlock(); });
  auto taken = waiting.taken();
  ASSERT_TRUE(server_tests::eventually([&] { return holder_client.inspect(name).waiters.size() == 1u; }, 5s));
  ASSERT_EQ(server.stop(), 0);
  ASSERT_EQ(taken.wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(taken.get());  // not thrown: the deadline ended it
  ASSERT_EQ(server.restart(), 0);
  EXPECT_TRUE(server_tests::eventually([&] { return holder_client.inspect(name).waiters.empty(); }, 10s));
  held.unlock();
}

// A server that comes back without its state (its indexes start again from 1): the holder is
// told its hold is lost (its session is gone), and a waiter, whose blocking query could now be
// ahead of every index the server has, waits with indexes read afresh and gets the name.
TEST(ConsulOwnServer, AServerBackWithoutItsStateEndsTheHoldAndAdmitsTheWaiter) {
  setenv("CONSUL_TEST_SESSION_TTL_MIN", "1s", 1);
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  const auto name = unique("state-lost");
  std::promise<void> lost;
  turnstile::ClientOptions options;
  options.ttl = 2s;
  options.on_hold_lost = [&, told = false](const turnstile::Error&) mutable {
    if (!std::exchange(told, true)) lost.set_value();
  };
  auto holder_client = turnstile::Client::connect(server.url(), options);
  auto waiter_client = turnstile::Client::connect(server.url(), options);
  auto held = holder_client.mutex(name);
  ASSERT_TRUE(held.try_lock());
  auto waiter = waiter_client.mutex(name);
  HoldOnThread waiting([&] { return waiter.try_lock_for(30s); }, [&] { waiter.unlock(); });
  auto taken = waiting.taken();
  ASSERT_TRUE(server_tests::eventually([&] { return holder_client.inspect(name).waiters.size() == 1u; }, 5s));
  ASSERT_EQ(server.action("restart-empty"), 0);
  EXPECT_EQ(lost.get_future().wait_for(10s), std::future_status::ready) << "the holder was not told";
  ASSERT_EQ(taken.wait_for(20s), std::future_status::ready);
  EXPECT_TRUE(taken.get());
  held.unlock();  // reports the loss again; changes nothing
  EXPECT_EQ(holder_client.inspect(name).holders.size(), 1u);
}

// A TTL below the server's session_ttl_min (10 s by default) is the caller's setting, refused
// with a typed error at connect, not reported as an outage.
TEST(ConsulOwnServer, ATtlBelowTheServersMinimumIsRefusedAsInvalid) {
  unsetenv("CONSUL_TEST_SESSION_TTL_MIN");
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  EXPECT_THROW(turnstile::Client::connect(server.url() + "?ttl=2"), turnstile::InvalidArgument);
  EXPECT_NO_THROW(turnstile::Client::connect(server.url() + "?ttl=10"));
}

// ACLs (the stand-in with a token required on every request): the token travels in
// X-Consul-Token, from the URL or Consul's own CONSUL_HTTP_TOKEN (with CONSUL_HTTP_ADDR when the
// URL names no host); a wrong or missing one is AccessDenied; no token is ever shown.
TEST(ConsulOwnServer, AnAclTokenIsSentInItsHeaderAndNeverShown) {
  const std::string token = "s3cret-acl-token-1234";
  setenv("CONSUL_TEST_ACL_TOKEN", token.c_str(), 1);
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  unsetenv("CONSUL_TEST_ACL_TOKEN");
  const auto address = server.url().substr(server.url().find('@') + 1);  // 127.0.0.1:PORT
  ASSERT_NE(server.url().find(token), std::string::npos);
  auto client = turnstile::Client::connect(server.url());
  EXPECT_EQ(client.url().find(token), std::string::npos) << client.url();
  const auto name = unique("acl");
  auto mutex = client.mutex(name);
  ASSERT_TRUE(mutex.try_lock());
  const auto inspection = client.inspect(name);
  ASSERT_EQ(inspection.holders.size(), 1u);
  EXPECT_EQ(inspection.holders[0].host.find(token), std::string::npos);
  mutex.unlock();

  const std::string wrong = "wrong-token-5678";
  for (const auto& refused : {"consul://" + wrong + "@" + address, "consul://" + address}) {
    try {
      turnstile::Client::connect(refused);
      ADD_FAILURE() << "connected without the right token";
    } catch (const turnstile::AccessDenied& denied) {
      EXPECT_EQ(std::string(denied.what()).find(wrong), std::string::npos) << denied.what();
    }
  }

  // Consul's own environment: CONSUL_HTTP_ADDR and CONSUL_HTTP_TOKEN for a URL without a host.
  setenv("CONSUL_HTTP_ADDR", ("http://" + address).c_str(), 1);
  setenv("CONSUL_HTTP_TOKEN", token.c_str(), 1);
  {
    auto from_env = turnstile::Client::connect("consul://");
    EXPECT_EQ(from_env.url().find(token), std::string::npos) << from_env.url();
    auto env_mutex = from_env.mutex(name);
    EXPECT_TRUE(env_mutex.try_lock());
    env_mutex.unlock();
  }
  setenv("CONSUL_HTTP_TOKEN", wrong.c_str(), 1);
  EXPECT_THROW(turnstile::Client::connect("consul://"), turnstile::AccessDenied);
  unsetenv("CONSUL_HTTP_TOKEN");
  unsetenv("CONSUL_HTTP_ADDR");

#ifdef TURNSTILE_CLI_PATH
  const std::string cli = TURNSTILE_CLI_PATH;
  const auto denied = shell(cli + " run --backend " + quoted("consul://" + wrong + "@" + address) + " --lock " +
                            quoted(name) + " -- true 2>&1; echo status=$?");
  EXPECT_EQ(denied.find(wrong), std::string::npos) << denied;
  EXPECT_EQ(denied.find("status=0"), std::string::npos) << denied;
  const auto shown = shell(cli + " inspect --backend " + quoted(server.url()) + " " + quoted(name) + " 2>&1");
  EXPECT_EQ(shown.find(token), std::string::npos) << shown;
#endif
}

// Lock-delay: when an api.Lock holder's session is invalidated (here destroyed), Consul refuses
// the key to every session for the session's LockDelay; turnstile waits it out, then takes it.
TEST(Consul, ALockDelayIsWaitedOutThenTheNameIsTaken) {
  const auto name = unique("lock-delay");
  const auto reply = curl("PUT", "/v1/session/create", R"({"Name":"Consul API Lock","TTL":"15s","LockDelay":"5s"})");
  const auto session = nlohmann::json::parse(reply)["ID"].get<std::string>();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + session + "&flags=" + kLockFlags), "true");
  auto mutex = turnstile::Client::connect(url()).mutex(name);
  ASSERT_FALSE(mutex.try_lock());  // held by the peer
  curl("PUT", "/v1/session/destroy/" + session);
  // The key is free now but under its lock-delay: Consul itself refuses an acquire.
  const auto other = peer_session();
  EXPECT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + other + "&flags=" + kLockFlags), "false");
  EXPECT_FALSE(mutex.try_lock());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(mutex.try_lock_for(15s));
  EXPECT_GT(std::chrono::steady_clock::now() - start, 2s);  // it did wait for the delay
  mutex.unlock();
}

// Red team (issue 12): a turnstile holder's session ended (Behavior delete removes its key) puts
// the name under lock-delay with no key left to block on; its waiter tried again at once, some
// thousands of requests a second for the whole delay. It must look again about once a second,
// as api.Lock does (every 5 s), and still take the name once the delay is over.
TEST(ConsulOwnServer, AWaiterSitsOutALockDelayOnADeletedKeyWithoutSpinning) {
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);  // its own: nobody else's requests counted
  const auto own = "http://" + server.url().substr(std::string("consul://").size());
  const auto call = [&](const std::string& method, const std::string& path) {
    return shell("curl -s -X " + method + " " + quoted(own + path));
  };
  const auto name = unique("delay-deleted");
  auto holder = turnstile::Client::connect(server.url() + "?lock_delay=3").mutex(name);
  holder.lock();
  auto observer = turnstile::Client::connect(server.url());
  auto waiter = turnstile::Client::connect(server.url()).mutex(name);
  auto waited = std::async(std::launch::async, [&] { return waiter.try_lock_for(20s); });
  ASSERT_TRUE(server_tests::eventually([&] { return observer.inspect(name).waiters.size() == 1; }, 10s));
  const auto session = nlohmann::json::parse(call("GET", "/v1/kv/" + name))[0]["Session"].get<std::string>();
  const auto requests = [&] {
    const auto stats = nlohmann::json::parse(call("GET", "/v1/test-stand-in/stats"));
    return stats.value("PUT /v1/txn", 0) + stats.value("GET /v1/kv", 0);
  };
  const auto before = requests();
  const auto ended = std::chrono::steady_clock::now();
  call("PUT", "/v1/session/destroy/" + session);
  ASSERT_EQ(waited.wait_for(20s), std::future_status::ready);
  ASSERT_TRUE(waited.get());
  const auto waited_for = std::chrono::steady_clock::now() - ended;
  const auto made = requests() - before;
  EXPECT_GT(waited_for, 2s);  // the lock-delay was real: the waiter could not take the name at once
  // About one look a second for 3 s, a few requests each: far below the thousands of a retry
  // without a pause.
  EXPECT_LT(made, 200) << made << " requests while waiting out a 3 s lock-delay";
  waiter.unlock();
}

// A stand-in of the test's own (nobody else's requests counted), and requests to it by hand.
struct OwnStandIn {
  server_tests::OwnServer server{TURNSTILE_CONSUL_SCRIPT};
  std::string base = "http://" + server.url().substr(std::string("consul://").size());
  std::string call(const std::string& method, const std::string& path) const {
    return shell("curl -s -X " + method + " " + quoted(base + path));
  }
  bool exists(const std::string& key) const {
    return call("GET", "/v1/kv/" + key).find("\"Key\"") != std::string::npos;
  }
  // From now on (until `false`) a peer changes `key` between every read of it and the next write.
  bool race(const std::string& key, bool on) const {
    return call("PUT", "/v1/test-stand-in/race?" + std::string(on ? "" : "off&") + "key=" + key) == "true";
  }
  long transactions() const {
    return nlohmann::json::parse(call("GET", "/v1/test-stand-in/stats")).value("PUT /v1/txn", 0L);
  }
};

// Issue 23: a release whose `.lock` CAS loses to a peer's change reads it again and retries;
// it did so at once, 32 times in a row, and the background's next try did the same: over a
// hundred transactions a second while a busy api.Semaphore peer kept winning. Every retry of a
// refused release must come after a pause, and the release still ends once the peer lets it.
TEST(ConsulOwnServer, AReleaseRefusedByACasRacePausesBeforeEachRetry) {
  OwnStandIn own;
  const auto name = unique("race-release");
  auto client = turnstile::Client::connect(own.server.url());
  auto semaphore = client.semaphore(name, 2);
  auto lease = semaphore.try_acquire();
  ASSERT_TRUE(lease.has_value());
  const auto holders_key = name + "/.lock";
  ASSERT_TRUE(own.exists(holders_key));
  ASSERT_TRUE(own.race(holders_key, true));
  const auto before = own.transactions();
  auto released = std::async(std::launch::async, [&] {
    try {
      lease->release();
    } catch (const turnstile::BackendUnavailable&) {
      // retried in the background
    }
  });
  std::this_thread::sleep_for(1s);
  const auto in_a_second = own.transactions() - before;
  EXPECT_TRUE(own.exists(holders_key)) << "the release was not refused: the test proves nothing";
  EXPECT_GE(in_a_second, 2) << "the release did not try (and lose) a CAS at all";
  // A pause doubling from 50 ms: some six tries in the first second; without, over a hundred.
  EXPECT_LE(in_a_second, 20) << in_a_second << " release transactions in one second of lost CAS races";
  ASSERT_TRUE(own.race(holders_key, false));
  ASSERT_EQ(released.wait_for(20s), std::future_status::ready);
  EXPECT_TRUE(server_tests::eventually([&] { return !own.exists(holders_key); }, 15s)) << "never released";
}

// Issue 23: a PermitCounter change whose CAS loses to someone else's change reads the counter
// again and retries; it did so at once and without end while a peer kept winning.
TEST(ConsulOwnServer, ACounterChangeThatLosesEveryCasRacePausesBeforeEachRetry) {
  OwnStandIn own;
  const auto name = unique("race-counter");
  auto client = turnstile::Client::connect(own.server.url());
  auto counter = client.permit_counter(name);
  ASSERT_EQ(counter.add_permits(1), 1);
  const auto counter_key = "turnstile/c/" + name;
  ASSERT_TRUE(own.exists(counter_key));
  ASSERT_TRUE(own.race(counter_key, true));
  const auto before = own.transactions();
  auto added = std::async(std::launch::async, [&] { return counter.add_permits(2); });
  std::this_thread::sleep_for(1s);
  const auto in_a_second = own.transactions() - before;
  EXPECT_NE(added.wait_for(0s), std::future_status::ready) << "the change was not refused: the test proves nothing";
  EXPECT_GE(in_a_second, 2) << "the change did not try (and lose) a CAS at all";
  EXPECT_LE(in_a_second, 20) << in_a_second << " counter transactions in one second of lost CAS races";
  ASSERT_TRUE(own.race(counter_key, false));
  ASSERT_EQ(added.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(added.get(), 3);
  EXPECT_EQ(counter.available_permits(), 3);
}

// Issue 23: a lease's hold whose `.lock` CAS lost to a peer's change looked and tried again at
// once, without end and past its deadline (a try-once too): a hot loop for as long as the peer
// kept winning. Each lost race must be followed by a pause, and a try-once ends not admitted.
TEST(ConsulOwnServer, AHoldThatLosesEveryCasRacePausesAndATryOnceEnds) {
  OwnStandIn own;
  const auto name = unique("race-hold");
  auto holder = turnstile::Client::connect(own.server.url());
  auto held = holder.semaphore(name, 3).try_acquire();
  ASSERT_TRUE(held.has_value());  // `.lock` exists, with room left
  auto client = turnstile::Client::connect(own.server.url());
  auto semaphore = client.semaphore(name, 3);
  const auto holders_key = name + "/.lock";
  ASSERT_TRUE(own.race(holders_key, true));
  const auto before = own.transactions();
  auto timed = std::async(std::launch::async, [&] { return semaphore.try_acquire_for(1500ms).has_value(); });
  std::this_thread::sleep_for(1s);
  const auto in_a_second = own.transactions() - before;
  const bool still_trying = timed.wait_for(0s) != std::future_status::ready;
  ASSERT_TRUE(own.race(holders_key, false));
  ASSERT_EQ(timed.wait_for(20s), std::future_status::ready);
  timed.get();
  EXPECT_TRUE(still_trying) << "the hold was not refused: the test proves nothing";
  EXPECT_GE(in_a_second, 2) << "the hold did not try (and lose) a CAS at all";
  EXPECT_LE(in_a_second, 20) << in_a_second << " hold transactions in one second of lost CAS races";
  ASSERT_TRUE(own.race(holders_key, true));
  auto once = std::async(std::launch::async, [&] { return semaphore.try_acquire().has_value(); });
  const bool ended = once.wait_for(5s) == std::future_status::ready;
  ASSERT_TRUE(own.race(holders_key, false));  // lets a looping try end, so the test can report
  EXPECT_TRUE(ended) << "a try-once kept retrying a lost race";
  EXPECT_FALSE(once.get()) << "a try-once that lost its race to a peer is not admitted";
}

#ifdef TURNSTILE_CLI_PATH
// Issue 13: `--timeout` bounds the whole wait, connecting included (the default connect timeout
// is 10 s): against a server that answers nothing, `--timeout 1` gives up as unavailable (69)
// well before that. A label given with --holder-label names the holder in the busy message.
TEST(ConsulOwnServer, TheCliTimeoutBoundsConnectingAndTheBusyMessageNamesTheLabel) {
  const std::string cli = TURNSTILE_CLI_PATH;
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  const auto name = unique("cli-connect");
  ASSERT_EQ(server.action("pause"), 0);
  const auto start = std::chrono::steady_clock::now();
  const auto paused = shell(cli + " run --backend " + quoted(server.url()) + " --lock " + quoted(name) +
                            " --timeout 1 -- true 2>&1; echo status=$?");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 6s) << paused;
  EXPECT_NE(paused.find("status=69"), std::string::npos) << paused;
  ASSERT_EQ(server.action("resume"), 0);

  turnstile::ClientOptions options;
  options.holder_label = "deploy by ops";
  auto holder = turnstile::Client::connect(server.url(), options);
  auto mutex = holder.mutex(name);
  ASSERT_TRUE(mutex.try_lock());
  const auto busy = shell(cli + " run --backend " + quoted(server.url()) + " --lock " + quoted(name) +
                          " --timeout 0 -- true 2>&1; echo status=$?");
  EXPECT_NE(busy.find("held by \"deploy by ops\" pid "), std::string::npos) << busy;
  EXPECT_NE(busy.find("status=75"), std::string::npos) << busy;
  mutex.unlock();
}
#endif

// A holder label is kept in the entry (inspect shows it) and names the Consul session, as
// `consul lock -name` does.
TEST(Consul, AHolderLabelIsShownByInspectAndNamesTheSession) {
  turnstile::ClientOptions options;
  options.holder_label = "nightly backup";
  auto client = turnstile::Client::connect(url(), options);
  const auto name = unique("label");
  auto mutex = client.mutex(name);
  ASSERT_TRUE(mutex.try_lock());
  const auto inspection = turnstile::Client::connect(url()).inspect(name);
  ASSERT_EQ(inspection.holders.size(), 1u);
  EXPECT_EQ(inspection.holders[0].label, "nightly backup");
  const auto entries = nlohmann::json::parse(curl("GET", "/v1/kv/" + name));
  const auto session = entries[0]["Session"].get<std::string>();
  const auto info = nlohmann::json::parse(curl("GET", "/v1/session/info/" + session));
  EXPECT_EQ(info[0]["Name"], "nightly backup") << info.dump();
  mutex.unlock();
}

// Red team: a turnstile session carries no node health check (Consul adds serfHealth unless the
// request names its checks), so nothing but its TTL, which the holder's own clock tracks, ends
// it unasked: readers and leases have no lock-delay to cover an early end.
TEST(Consul, SessionsCarryNoNodeHealthCheck) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("checks");
  auto mutex = client.mutex(name);
  ASSERT_TRUE(mutex.try_lock());
  const auto entries = nlohmann::json::parse(curl("GET", "/v1/kv/" + name));
  const auto session = entries[0]["Session"].get<std::string>();
  const auto info = nlohmann::json::parse(curl("GET", "/v1/session/info/" + session));
  ASSERT_EQ(info.size(), 1u) << info.dump();
  EXPECT_TRUE(info[0]["NodeChecks"].empty()) << info.dump();
  mutex.unlock();
}

// connect_timeout bounds Client::connect against a server that answers nothing (paused): it
// gives up with BackendUnavailable instead of waiting the 10 s default.
TEST(ConsulOwnServer, ConnectGivesUpAtItsConnectTimeout) {
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  ASSERT_EQ(server.action("pause"), 0);
  turnstile::ClientOptions options;
  options.connect_timeout = 1s;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(turnstile::Client::connect(server.url(), options), turnstile::BackendUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // the default would be 10 s
  ASSERT_EQ(server.action("resume"), 0);
  EXPECT_NO_THROW(turnstile::Client::connect(server.url(), options));
}

#ifdef TURNSTILE_CLI_PATH
// `turnstile run` waits behind an api.Lock holder and a full api.Semaphore, and `inspect` shows
// those holders by their Consul session (id, node, name) beside turnstile's own waiters.
TEST(Consul, TheCliWaitsBehindConsulsOwnHoldersAndInspectShowsThem) {
  const std::string cli = TURNSTILE_CLI_PATH;
  const auto name = unique("cli");
  const auto session = peer_session();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + session + "&flags=" + kLockFlags), "true");
  const auto ran = "/tmp/turnstile-consul-cli-" + std::to_string(getpid());
  std::remove(ran.c_str());
  auto run = std::async(std::launch::async, [&] {
    return shell(cli + " run --backend " + quoted(url()) + " --lock " + quoted(name) + " --timeout 20 -- touch " + ran +
                 "; echo status=$?");
  });
  std::string table;
  ASSERT_TRUE(server_tests::eventually(
      [&] {
        table = shell(cli + " inspect --backend " + quoted(url()) + " " + quoted(name));
        return table.find("waiter") != std::string::npos;
      },
      5s))
      << table;
  EXPECT_NE(table.find("consul session " + session), std::string::npos) << table;
  EXPECT_NE(table.find("node "), std::string::npos) << table;
  EXPECT_NE(table.find("\"Consul API Lock\""), std::string::npos) << table;
  const auto json =
      nlohmann::json::parse(shell(cli + " inspect --json --backend " + quoted(url()) + " " + quoted(name)));
  ASSERT_EQ(json["holders"].size(), 1u) << json.dump();
  EXPECT_NE(json["holders"][0]["foreign"].get<std::string>().find(session), std::string::npos) << json.dump();
  ASSERT_EQ(json["waiters"].size(), 1u) << json.dump();
  EXPECT_FALSE(std::filesystem::exists(ran));  // proven waiting, not run
  curl("PUT", "/v1/kv/" + name + "?release=" + session + "&flags=" + kLockFlags);
  EXPECT_NE(run.get().find("status=0"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(ran));
  std::remove(ran.c_str());

  // A Semaphore of 1 held by an api.Semaphore peer: `run --semaphore` waits, then runs.
  const auto semaphore = unique("cli-sem");
  ASSERT_EQ(curl("PUT", "/v1/kv/" + semaphore + "/" + session + "?acquire=" + session + "&flags=" + kSemaphoreFlags),
            "true");
  ASSERT_EQ(curl("PUT", "/v1/kv/" + semaphore + "/.lock?cas=0&flags=" + kSemaphoreFlags,
                 R"({"Limit":1,"Holders":{")" + session + R"(":true}})"),
            "true");
  auto run_sem = std::async(std::launch::async, [&] {
    return shell(cli + " run --backend " + quoted(url()) + " --semaphore " + quoted(semaphore) +
                 " --limit 1 --timeout 20 -- touch " + ran + "; echo status=$?");
  });
  ASSERT_TRUE(server_tests::eventually(
      [&] {
        table = shell(cli + " inspect --backend " + quoted(url()) + " " + quoted(semaphore));
        return table.find("waiter") != std::string::npos;
      },
      5s))
      << table;
  EXPECT_NE(table.find("consul session " + session), std::string::npos) << table;
  EXPECT_FALSE(std::filesystem::exists(ran));
  curl("PUT", "/v1/session/destroy/" + session);
  EXPECT_NE(run_sem.get().find("status=0"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(ran));
  std::remove(ran.c_str());
}
#endif

}  // namespace
