// The Consul keys of turnstile names (issue 22, item 15), against the Consul test stand-in
// (tests/servers/consul_server.py; not Consul): a name Consul takes as it is stays its own key
// (api.Lock peers share it), and only the dots Consul refuses are escaped.
#include <gtest/gtest.h>

#include "consul/consul_test_support.hpp"

namespace {

using namespace consul_tests;

// The one key under `prefix`: the api.Lock key of the Mutex held there.
std::string held_key(const std::string& prefix) {
  const auto keys = nlohmann::json::parse(curl("GET", "/v1/kv/" + prefix + "?keys"), nullptr, false);
  return keys.is_array() && keys.size() == 1u ? keys[0].get<std::string>() : keys.dump();
}

TEST(ConsulKeys, OnlyTheDotsConsulRefusesAreEscaped) {
  auto client = turnstile::Client::connect(url());
  const auto base = unique("keys");
  const std::pair<std::string, std::string> cases[] = {
      {"a..b", "a..b"},      // Consul takes it: the key it always was
      {".hidden", ".hidden"},
      {"x.", "x."},
      {"x..", "x.,2E"},      // would end in "..", and NAME/ would hold "../"
      {"x...", "x..,2E"},
      {"a..", "a.,2E"},
      {"a,b", "a,2Cb"},      // the escape character is escaped itself
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
