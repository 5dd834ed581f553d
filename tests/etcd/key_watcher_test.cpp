// SPDX-License-Identifier: Apache-2.0
// The key watcher's waiter watches across the end of its stream (the renewal every 60 s; here a
// connection reset, which ends the stream the same way and starts the next one at once): each
// watch is made again once, from the first revision it has not brought yet, so that etcd sends
// each event once and the waiter counts it once. Driven on the backend's own classes (the
// etcd objects linked in), against a server of its own, whose metrics count the watchers and
// the events they were sent.
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "backends/etcd/key_watcher.hpp"
#include "core/url.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"
#include "wakeups/probes.hpp"

namespace {

using namespace std::chrono_literals;
using namespace server_tests;
using namespace turnstile::detail;
namespace pb = turnstile::detail::etcd::pb;

// One of the server's own metrics (/metrics on its client port).
double metric(const std::string& url, const std::string& name) {
  const auto metrics = wakeups::ask(wakeups::host_port(url), "GET /metrics HTTP/1.0\r\n\r\n");
  return wakeups::number_after(metrics, "\n" + name + " ");
}
double watchers(const std::string& url) { return metric(url, "etcd_debugging_mvcc_watcher_total"); }
double events_sent(const std::string& url) { return metric(url, "etcd_debugging_mvcc_events_total"); }

void put(etcd::Connection& connection, const std::string& key, const std::string& value) {
  pb::TxnRequest txn;
  auto* request = txn.add_success()->mutable_request_put();
  request->set_key(key);
  request->set_value(value);
  connection.txn(txn, CallBudget(turnstile::SteadyClock::now() + 10s), etcd::Resend::allowed);
}

// A waiter that waits for two puts of its key, watched from now (start revision 0): before,
// the stream's renewal gave it a second watch (a "catch-up" from revision 0, which is "now"
// again) beside its own, and etcd sent every later event on both: two events for one put.
TEST(EtcdKeyWatcher, AStreamRenewalWatchesAWaiterAgainOnceFromWhereItHadComeTo) {
  OwnServer server(TURNSTILE_ETCD_SCRIPT);
  const auto url = server.url();
  turnstile_test::TcpProxy proxy(url);
  etcd::Connection watching(etcd::parse_settings(parse_url(proxy.url_through(url)), {}));
  etcd::Connection writing(etcd::parse_settings(parse_url(url), {}));
  etcd::KeyWatcher watcher(watching, [] {});
  const std::string key = "key-watcher-renewal";
  pb::WatchCreateRequest watch;
  watch.set_key(key);
  std::atomic<int> wakes{0};
  const auto armed = watcher.arm(watch, 0, [&wakes] { ++wakes; }, {.events = 2, .own_key = {}});
  ASSERT_TRUE(eventually([&] { return watchers(url) == 1; })) << "the waiter's watch was not made";

  auto before = events_sent(url);
  put(writing, key, "1");
  ASSERT_TRUE(eventually([&] { return events_sent(url) - before >= 1; })) << "the first put was not sent";
  ASSERT_EQ(wakes.load(), 0) << "woken by one put of the two it waits for";

  // The stream ends; the next one watches the waiter again (wait for it, and for any second
  // watch the same stream would make right after the first).
  const auto connections = proxy.accepted();
  proxy.reset();
  ASSERT_TRUE(eventually([&] { return proxy.accepted() > connections && watchers(url) >= 1; }))
      << "the waiter was not watched again";
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(watchers(url), 1) << "one waiter, watched more than once";

  before = events_sent(url);
  put(writing, key, "2");
  ASSERT_TRUE(eventually([&] { return wakes.load() == 1; })) << "the second put woke nobody";
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(events_sent(url) - before, 1) << "one put, sent as more than one event";
  EXPECT_EQ(wakes.load(), 1);
  watcher.disarm(armed);
}

}  // namespace
