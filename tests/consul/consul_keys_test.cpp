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
      {"a..b", "a.,2Eb"},      // Consul 1.21.5 refuses any ".."
      {"x..", "x.,2E"},        // would end in "..", and NAME/ would hold "../"
      {"x...", "x.,2E."},
      {"..x", ".,2Ex"},
      {"a,b", "a,2Cb"},        // the escape character is escaped itself
      {"col/.lock", "col/,2Elock"},  // else Semaphore "col"'s .lock
      {".lock/x", ",2Elock/x"},
      {"col/0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b", "col/,30a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b"},  // a contender
      {"0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b/x", "0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b/x"},  // not last
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
