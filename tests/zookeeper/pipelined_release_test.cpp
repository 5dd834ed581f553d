// SPDX-License-Identifier: Apache-2.0
// unlock() pipelines its release on ZooKeeper (issue 25): the deletion is sent on the session
// and unlock() returns without its reply, which settles the release when it comes. ZooKeeper
// applies one session's requests in order, so this client's next call comes after it.
#include <zookeeper/zookeeper.h>

#include <atomic>
#include <cstring>

#include "conformance/support.hpp"
#include "raw_zk.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using zookeeper_tests::RawZk;

std::string server_url() { return read_first_line(TURNSTILE_ZOOKEEPER_URL_FILE); }

// The old unlock() waited for the reply (held here by the proxy) for its short wait, then
// reported BackendUnavailable and left the node to a background retry. Now it returns at once,
// the server applies the deletion while the reply is still held, and the reply, once it passes,
// settles the release with nothing reported.
TEST(ZookeeperPipelinedRelease, UnlockReturnsBeforeItsReplyWhichThenSettlesIt) {
  const auto url = server_url();
  turnstile_test::TcpProxy proxy(url);
  std::atomic<int> errors{0};
  auto options = with_ttl(20s);  // its short wait is 2 s: longer than the reply is held
  options.error_handler = [&errors](const turnstile::Error&) { ++errors; };
  options.unlock_without_waiting = true;
  auto client = Client::connect(proxy.url_through(url), options);
  RawZk raw(url.substr(std::strlen("zk://")));
  const auto name = unique_name("pipelined");
  auto mutex = client.mutex(name);
  mutex.lock();
  ASSERT_EQ(raw.children("/" + name).size(), 1u);

  proxy.hold_replies();
  conformance::OnExit heal([&] { proxy.forward(); });
  mutex.unlock();
  EXPECT_EQ(errors.load(), 0) << "unlock() waited for the held reply and reported its absence";
  EXPECT_TRUE(conformance::Conformance::eventually([&] { return raw.children("/" + name).empty(); }, 5s))
      << "the deletion never reached the server";
  EXPECT_EQ(errors.load(), 0);
  proxy.forward();
  // The next request of the session is answered after the held reply: by then it has come.
  ASSERT_TRUE(mutex.try_lock_for(5s));
  mutex.unlock();
  ASSERT_TRUE(conformance::Conformance::eventually([&] { return raw.children("/" + name).empty(); }, 5s));
  std::this_thread::sleep_for(300ms);  // the keeper's round that settles the answers
  EXPECT_EQ(errors.load(), 0) << "a release whose reply came late was reported";
}

}  // namespace
