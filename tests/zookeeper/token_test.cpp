// SPDX-License-Identifier: Apache-2.0
// Fencing tokens for the life of the ensemble (issue 22, item 16). A name's nodes live under
// container parents, which the server deletes once they are empty (every minute by default;
// here every 200 ms, TURNSTILE_ZK_CONTAINER_CHECK_MS), and a new parent's sequence numbers
// start again at 0. Tokens were the sequence number + 1: 1, 2, 3, then 1 again after an idle
// minute, and a store fenced as docs/choosing-a-backend.md shows then refused every new holder. They are the
// nodes' czxid now: strictly growing across the reaping.
#include <cstdlib>
#include <cstring>

#include "conformance/support.hpp"
#include "raw_zk.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using zookeeper_tests::RawZk;

// A server of the test's own that reaps empty containers every 200 ms.
struct ServerReapingContainers {
  ServerReapingContainers() {
    setenv("TURNSTILE_ZK_CONTAINER_CHECK_MS", "200", 1);
    server = std::make_unique<OwnServer>(TURNSTILE_ZOOKEEPER_SCRIPT);
    unsetenv("TURNSTILE_ZK_CONTAINER_CHECK_MS");
  }
  std::string host_port() const { return server->url().substr(std::strlen("zk://")); }
  std::unique_ptr<OwnServer> server;
};

// Three holds one after another, then an idle gap until the server has deleted the name's
// node (its container parent), then one more: every token greater than the one before. The
// sequence number of the entry after the gap is 0 again (that is what made tokens restart).
template <class HoldOnce>
void tokens_grow_across_a_reaped_container(const std::string& name, RawZk& raw, HoldOnce hold_once) {
  std::uint64_t last = 0;
  for (int i = 0; i < 3; ++i) {
    const auto token = hold_once([](const std::string&) {});
    EXPECT_GT(token, last) << "hold " << i;
    last = token;
  }
  Stat stat{};
  ASSERT_TRUE(eventually([&] { return raw.stat("/" + name, &stat) == ZNONODE; }, 10s))
      << "the server never deleted the empty container /" << name;
  const auto token = hold_once([&](const std::string& sequence_of_ours) {
    EXPECT_EQ(sequence_of_ours, "0000000000") << "the sequence restarted: the case this test is about";
  });
  EXPECT_GT(token, last) << "the fencing token restarted with the container's sequence numbers";
}

// The 10-digit suffix of the only child of `parent`, "" when there is not exactly one.
std::string only_sequence(RawZk& raw, const std::string& parent) {
  const auto children = raw.children(parent);
  if (children.size() != 1 || children[0].size() < 10) return "";
  return children[0].substr(children[0].size() - 10);
}

TEST(ZookeeperTokens, KeepGrowingWhenTheServerReapsTheNamesEmptyContainer) {
  ServerReapingContainers reaping;
  auto client = Client::connect(reaping.server->url());
  RawZk raw(reaping.host_port());

  const auto lock_name = unique_name("tokens-lock");
  auto mutex = client.mutex(lock_name);
  tokens_grow_across_a_reaped_container(lock_name, raw, [&](auto check_sequence) {
    mutex.lock();
    check_sequence(only_sequence(raw, "/" + lock_name));
    const auto token = mutex.fencing_token();
    mutex.unlock();
    return token;
  });

  const auto semaphore_name = unique_name("tokens-semaphore");
  auto semaphore = client.semaphore(semaphore_name, 2);
  tokens_grow_across_a_reaped_container(semaphore_name, raw, [&](auto check_sequence) {
    auto lease = semaphore.acquire();
    check_sequence(only_sequence(raw, "/" + semaphore_name + "/leases"));
    const auto token = lease.fencing_token();
    lease.release();
    return token;
  });
}

}  // namespace
