// SPDX-License-Identifier: Apache-2.0
// The Consul keys of turnstile names (issue 22, item 15), against the Consul test stand-in
// (tests/servers/consul_server.py; not Consul): a name Consul takes as it is stays its own key
// (api.Lock peers share it); no key holds ".." (Consul 1.21.5 refuses it anywhere); and no name
// reaches api.Semaphore's keys under another name's prefix (PREFIX/.lock, PREFIX/<session>).
#include <gtest/gtest.h>

#include "consul/consul_test_support.hpp"

namespace {

using namespace consul_tests;

// The one key under `prefix`: the api.Lock key of the Mutex held there.
std::string held_key(const std::string& prefix) {
  const auto keys = nlohmann::json::parse(curl("GET", "/v1/kv/" + prefix + "?keys"), nullptr, false);
  return keys.is_array() && keys.size() == 1u ? keys[0].get<std::string>() : keys.dump();
}

TEST(ConsulKeys, NoKeyHoldsTwoDotsAndNoNameReachesASemaphoresKeys) {
  auto client = turnstile::Client::connect(url());
  const auto base = unique("keys");
  const std::pair<std::string, std::string> cases[] = {
      {".hidden", ".hidden"},  // Consul takes these: the keys they always were
      {"x.", "x."},
      {"a.b.c", "a.b.c"},
      {"lock", "lock"},
      {".locked", ".locked"},
      {"a..b", "a.,2Eb"},  // Consul 1.21.5 refuses any ".."
      {"x..", "x.,2E"},    // would end in "..", and NAME/ would hold "../"
      {"x...", "x.,2E."},
      {"..x", ".,2Ex"},
      {"a,b", "a,2Cb"},              // the escape character is escaped itself
      {"col/.lock", "col/,2Elock"},  // else Semaphore "col"'s .lock
      {".lock/x", ",2Elock/x"},
      {"col/0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b", "col/,30a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b"},  // a contender
      {"0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b/x", "0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b/x"},        // not last
  };
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const auto& [leaf, key] = cases[i];
    SCOPED_TRACE(leaf);
    const auto prefix = base + "/" + std::to_string(i) + "/";
    auto mutex = client.mutex(prefix + leaf);
    ASSERT_TRUE(mutex.try_lock());
    EXPECT_EQ(held_key(prefix), prefix + key);
    mutex.unlock();
  }
}

}  // namespace

namespace {

bool occupied(const std::string& name) { return keys_under("turnstile/o/" + name) != 0u; }

// Whoever is the last one out of a name's queue ends its occupancy (turnstile/o/NAME), which used
// to stay on the server for good: a holder that releases after its waiter gave up (its
// release's CAS on the occupancy lost to the waiter's join), or a waiter that gives up behind an
// api.Lock peer's hold (nobody in the queue releases after it).
void wait_in_vain(turnstile::Client& client, const std::string& name) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(client.mutex(name).try_lock_for(std::chrono::milliseconds(800)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(800));  // it waited
}

TEST(ConsulOccupancy, AHolderReleasingAfterItsWaiterGaveUpEndsIt) {
  auto holder_client = turnstile::Client::connect(url());
  auto waiter_client = turnstile::Client::connect(url());
  const auto name = unique("occupancy-holder-last");
  auto held = holder_client.mutex(name);
  ASSERT_TRUE(held.try_lock());
  ASSERT_TRUE(occupied(name));
  wait_in_vain(waiter_client, name);
  EXPECT_EQ(keys_under("turnstile/q/" + name + "/"), 1u);
  held.unlock();
  EXPECT_EQ(keys_under("turnstile/q/" + name + "/"), 0u);
  EXPECT_FALSE(occupied(name)) << "turnstile/o/" << name << " outlived its queue";
}

TEST(ConsulOccupancy, AWaiterGivingUpBehindAPeerEndsIt) {
  auto client = turnstile::Client::connect(url());
  const auto name = unique("occupancy-waiter-last");
  const auto peer = peer_session();
  ASSERT_EQ(curl("PUT", "/v1/kv/" + name + "?acquire=" + peer + "&flags=" + kLockFlags), "true");
  wait_in_vain(client, name);
  EXPECT_EQ(keys_under("turnstile/q/" + name + "/"), 0u);
  EXPECT_FALSE(occupied(name)) << "turnstile/o/" << name << " outlived its queue";
  curl("PUT", "/v1/session/destroy/" + peer);
}

}  // namespace
