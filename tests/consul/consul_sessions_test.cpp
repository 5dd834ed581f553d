// SPDX-License-Identifier: Apache-2.0
// Consul sessions under a slow or stalled server (issue 22, item 13): renewals of many sessions
// run at once, and a client's shutdown is bounded. Each test has its own stand-in
// (tests/servers/consul_server.py; not Consul), slowed with its TEST-ONLY delay knob or paused.
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "consul/consul_test_support.hpp"

namespace {

using namespace std::chrono_literals;
using namespace consul_tests;

constexpr auto kTtl = 3s;  // renewed every 1.5 s, each renewal given up to 1.5 s
constexpr int kLeases = 16;

struct SlowServer {
  SlowServer() {
    setenv("CONSUL_TEST_SESSION_TTL_MIN", "1s", 1);
    server.emplace(TURNSTILE_CONSUL_SCRIPT);
  }
  std::string base() const {
    const auto rest = server->url().substr(std::string("consul://").size());
    return "http://" + rest.substr(0, rest.find('?'));
  }
  // TEST-ONLY knob of the stand-in: answers under `path` come `seconds` late.
  void delay(const std::string& path, double seconds) const {
    shell("curl -s -X PUT " +
          quoted(base() + "/v1/test-stand-in/delay?path=" + path + "&seconds=" + std::to_string(seconds)));
  }
  std::optional<server_tests::OwnServer> server;
};

std::vector<turnstile::Lease> take_leases(turnstile::Client& client, const std::string& name) {
  auto semaphore = client.semaphore(name, kLeases);
  std::vector<turnstile::Lease> leases;
  for (int i = 0; i < kLeases; ++i) {
    auto lease = semaphore.try_acquire();
    if (!lease) break;
    leases.push_back(std::move(*lease));
  }
  return leases;
}

std::size_t lost(const std::vector<turnstile::Lease>& leases) {
  std::size_t count = 0;
  for (const auto& lease : leases) count += lease.lost_token().stop_requested();
  return count;
}

// 16 leases, each on a session of its own (api.Semaphore counts one holder per session), plus
// the main one: 17 renewals a round. Answered 0.5 s late, one after another a round took 8.5 s,
// well past the 3 s TTL, and the leases were reported lost though the server kept every session.
TEST(ConsulSessions, SlowRenewalsOfManySessionsLoseNone) {
  SlowServer slow;
  auto client = turnstile::Client::connect(slow.server->url(), server_tests::with_ttl(kTtl));
  auto leases = take_leases(client, "slow-renewals");
  ASSERT_EQ(leases.size(), static_cast<std::size_t>(kLeases));
  slow.delay("/v1/session/renew/", 0.5);
  // Really slow: a renewal answers no sooner than the delay.
  const auto start = std::chrono::steady_clock::now();
  shell("curl -s -X PUT " + quoted(slow.base() + "/v1/session/renew/none"));
  ASSERT_GE(std::chrono::steady_clock::now() - start, 500ms);
  std::this_thread::sleep_for(2 * kTtl);  // two TTLs: three rounds or more
  EXPECT_EQ(lost(leases), 0u) << "leases reported lost while the server kept their sessions";
  slow.delay("/v1/session/renew/", 0);
}

// A renewal is confirmed by its send time, so an answer that comes late still counts as long as
// it comes before the loss deadline. Renewals used to be cut after min(2 s, TTL/4): a server
// answering every renewal in 2.5 s (TTL 20 s) lost every hold. Here TTL 6 s (loss deadline
// 5.4 s after a confirmed send, renewed every 3 s) and renewals answered 1.8 s late, past the
// old cut (1.5 s) and well before the loss deadline.
TEST(ConsulSessions, RenewalsSlowerThanAQuarterTtlStillCount) {
  constexpr auto ttl = 6s;
  SlowServer slow;
  auto client = turnstile::Client::connect(slow.server->url(), server_tests::with_ttl(ttl));
  auto mutex = client.mutex("slow-renewal");
  ASSERT_TRUE(mutex.try_lock());
  const auto lost = mutex.lost_token();
  slow.delay("/v1/session/renew/", 1.8);
  const auto start = std::chrono::steady_clock::now();
  shell("curl -s -X PUT " + quoted(slow.base() + "/v1/session/renew/none"));
  ASSERT_GE(std::chrono::steady_clock::now() - start, 1800ms) << "renewals are not answered late";
  std::this_thread::sleep_for(ttl);  // past the loss deadline (5.4 s) of renewals not counted
  EXPECT_FALSE(lost.stop_requested()) << "the hold was reported lost though every renewal was answered";
  slow.delay("/v1/session/renew/", 0);
  mutex.unlock();
}

// The server paused (SIGSTOP) with 8 leases held: releasing them and destroying the client
// ends within a bound (each release tries at most its own patience, 2 s, or 250 ms once the hold
// is known lost; the sessions' destruction and a renewal round under way are cut short).
TEST(ConsulSessions, ShutdownAgainstAStalledServerIsBounded) {
  SlowServer slow;
  std::optional<turnstile::Client> client;
  client.emplace(turnstile::Client::connect(slow.server->url(), server_tests::with_ttl(kTtl)));
  client->set_error_handler([](const turnstile::Error&) {});
  auto leases = take_leases(*client, "stalled-shutdown");
  leases.resize(8);
  ASSERT_EQ(slow.server->action("pause"), 0);
  std::this_thread::sleep_for(kTtl);  // the holds are lost by now: releases try only briefly
  const auto start = std::chrono::steady_clock::now();
  leases.clear();
  const auto released_in = std::chrono::steady_clock::now() - start;
  client.reset();
  const auto shut_in = std::chrono::steady_clock::now() - start;
  slow.server->action("resume");
  std::fprintf(stderr, "released in %lld ms, shut down in %lld ms\n",
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(released_in).count()),
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(shut_in).count()));
  EXPECT_LT(shut_in, 6s);
}

// Issue 24 item 4 (red team F7): a lock kept 2 s after its release (release_after) is kept by a
// session Consul raises to its minimum TTL (10 s by default, as this stand-in is started) and
// ends at least that late: the kept end inspect shows must not be earlier (it said 2 s).
TEST(ConsulSessions, AKeptLockShowsTheSessionMinimumAsItsEarliestEnd) {
  unsetenv("CONSUL_TEST_SESSION_TTL_MIN");  // Consul's default session_ttl_min, 10 s
  server_tests::OwnServer server(TURNSTILE_CONSUL_SCRIPT);
  auto client = turnstile::Client::connect(server.url());
  auto mutex = client.mutex("kept");
  mutex.lock();
  // The kept end is stored in whole milliseconds, rounded down (a promise of "at least until"):
  // so is the time it is compared with (a fresh clone once saw 9,999 ms from the unrounded one).
  const auto kept_at = std::chrono::floor<std::chrono::milliseconds>(std::chrono::system_clock::now());
  mutex.release_after(2s);
  const auto inspection = client.inspect("kept");
  ASSERT_EQ(inspection.holders.size(), 1u);
  ASSERT_TRUE(inspection.holders.front().kept_until.has_value());
  EXPECT_GE(*inspection.holders.front().kept_until, kept_at + 10s)
      << std::chrono::duration_cast<std::chrono::milliseconds>(*inspection.holders.front().kept_until - kept_at)
             .count();
}

}  // namespace
