// SPDX-License-Identifier: Apache-2.0
// Helpers of the Consul backend's own tests (tests/consul): the suite's stand-in and requests
// to it by hand with curl, as Consul's own clients would make them.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace consul_tests {

using server_tests::eventually;
using server_tests::quoted;
using server_tests::shell;

inline const std::string kLockFlags = "3304740253564472344";
inline const std::string kSemaphoreFlags = "16210313421097356768";

inline std::string url() { return server_tests::read_first_line(TURNSTILE_CONSUL_URL_FILE); }
// http://127.0.0.1:PORT of the consul:// URL.
inline std::string base() {
  auto rest = url().substr(std::string("consul://").size());
  return "http://" + rest.substr(0, rest.find('?'));
}
inline std::string unique(const std::string& what) {
  return "consul-test/" + std::to_string(getpid()) + "-" + std::to_string(std::rand()) + "/" + what;
}
inline std::string curl(const std::string& method, const std::string& path, const std::string& body = "") {
  return shell("curl -s -X " + method + " --data-binary " + quoted(body) + " " + quoted(base() + path));
}
// A session as api.Lock makes one (TTL 15s, lock-delay 0 so the test need not wait it out).
inline std::string peer_session() {
  const auto reply = curl("PUT", "/v1/session/create", R"({"Name":"Consul API Lock","TTL":"15s","LockDelay":"0s"})");
  const auto start = reply.find("\"ID\"");
  const auto quote = reply.find('"', reply.find(':', start) + 1);
  return reply.substr(quote + 1, 36);
}
// How many keys are under `prefix` now (0 when none).
inline std::size_t keys_under(const std::string& prefix) {
  const auto keys = nlohmann::json::parse(curl("GET", "/v1/kv/" + prefix + "?keys"), nullptr, false);
  return keys.is_array() ? keys.size() : 0;
}

// The ModifyIndex of a key on the server itself (0: absent).
inline std::uint64_t modify_index(const std::string& key) {
  const auto kv = nlohmann::json::parse(curl("GET", "/v1/kv/" + key), nullptr, false);
  return kv.is_array() && !kv.empty() ? kv[0].value("ModifyIndex", std::uint64_t{0}) : 0;
}

// Runs `change` through a proxy whose replies are held: `replies_before` pass, then the next
// request is applied on the server (its key's ModifyIndex moves), `between` runs (other
// clients' changes, made directly), and the reply is lost with the connection (reset), so
// libcurl resends it on a fresh connection or the call sees the error.
template <typename Result>
Result with_lost_reply(turnstile_test::TcpProxy& proxy, const std::string& key, int replies_before,
                       std::function<Result()> change, const std::function<void()>& between = {}) {
  using namespace std::chrono_literals;
  const auto before = modify_index(key);
  proxy.hold_replies();
  auto result = std::async(std::launch::async, change);
  for (int i = 0; i < replies_before; ++i) EXPECT_TRUE(proxy.pass_one_reply(5s));
  EXPECT_TRUE(eventually([&] { return modify_index(key) != before; }, 5s));
  if (between) between();
  proxy.drop_replies();
  EXPECT_TRUE(eventually([&] { return proxy.dropped_bytes() > 0; }, 5s));
  proxy.forward();
  proxy.reset();
  return result.get();
}

}  // namespace consul_tests
