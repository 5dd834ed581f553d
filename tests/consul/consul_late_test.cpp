// SPDX-License-Identifier: Apache-2.0
// Consul writes that arrive late, or after the client's session was destroyed (issue 22, items
// 8, 9, 10, 14), against the Consul test stand-in: a write its sender gave up on changes nothing,
// every counter change applies at most once, and a session gone on the server reads as the
// entry or hold gone, never as the server unreachable.
#include <gtest/gtest.h>

#include <cstdlib>
#include <future>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using server_tests::quoted;
using server_tests::shell;

std::string url() { return server_tests::read_first_line(TURNSTILE_CONSUL_URL_FILE); }
std::string base() {
  auto rest = url().substr(std::string("consul://").size());
  return "http://" + rest.substr(0, rest.find('?'));
}
std::string curl(const std::string& method, const std::string& path, const std::string& body = "") {
  return shell("curl -s -X " + method + " --data-binary " + quoted(body) + " " + quoted(base() + path));
}
std::string unique(const std::string& what) {
  return "consul-late/" + std::to_string(getpid()) + "-" + std::to_string(std::rand()) + "/" + what;
}
turnstile::ClientOptions labelled(const std::string& label) {
  turnstile::ClientOptions options;
  options.holder_label = label;
  return options;
}
// Destroys every session named `label` (the client's, as ClientOptions::holder_label names them),
// as an operator's `consul session destroy` would: how many.
int destroy_sessions(const std::string& label) {
  const auto sessions = nlohmann::json::parse(curl("GET", "/v1/session/list"), nullptr, false);
  int destroyed = 0;
  for (const auto& session : sessions) {
    if (session.value("Name", std::string()) != label) continue;
    curl("PUT", "/v1/session/destroy/" + session.value("ID", std::string()));
    ++destroyed;
  }
  return destroyed;
}

std::string session_of(const std::string& label) {
  const auto sessions = nlohmann::json::parse(curl("GET", "/v1/session/list"), nullptr, false);
  for (const auto& session : sessions) {
    if (session.value("Name", std::string()) == label) return session.value("ID", std::string());
  }
  return "";
}
// How many keys are under `prefix` now.
std::size_t keys_under(const std::string& prefix) {
  const auto keys = nlohmann::json::parse(curl("GET", "/v1/kv/" + prefix + "?keys"), nullptr, false);
  return keys.is_array() ? keys.size() : 0;
}
// The stand-in's count of answered KV and txn writes (GET /v1/test-stand-in/stats, not Consul's).
long writes_answered() {
  const auto stats = nlohmann::json::parse(curl("GET", "/v1/test-stand-in/stats"), nullptr, false);
  long total = 0;
  for (const auto* what : {"PUT /v1/kv", "PUT /v1/txn", "DELETE /v1/kv"}) {
    if (stats.is_object() && stats.contains(what)) total += stats[what].get<long>();
  }
  return total;
}
// Delivers a held request (or replays a copied one) and waits until the server has answered
// it (its write counted).
template <typename Late>
void deliver_and_wait(Late& late) {
  const auto before = writes_answered();
  if constexpr (std::is_same_v<Late, turnstile_test::HeldRequest>) {
    late.deliver();
  } else {
    late.replay();
  }
  EXPECT_TRUE(server_tests::eventually([&] { return writes_answered() > before; }, 5s))
      << "the late request never came";
}
std::string value_of(const std::string& key, const std::string& field) {
  const auto kv = nlohmann::json::parse(curl("GET", "/v1/kv/" + key), nullptr, false);
  return kv.is_array() && !kv.empty() && kv[0].contains(field) && kv[0][field].is_string()
             ? kv[0][field].get<std::string>()
             : "";
}

// A PermitCounter of a new name, on a client whose connections pass through a proxy; the
// line's prefix, and the pattern its join's transaction has.
struct LineCase {
  explicit LineCase(const std::string& what)
      : label(unique(what + "-label")), client(turnstile::Client::connect(proxy.url_through(url()), labelled(label))),
        name(unique(what)), counter(client.permit_counter(name)), line("turnstile/cq/" + name + "/"),
        join(line + session_of(label)) {
    EXPECT_NE(join, line) << "no session";
  }
  turnstile_test::TcpProxy proxy{url()};
  std::string label;
  turnstile::Client client;
  std::string name;
  turnstile::PermitCounter counter;
  std::string line;
  std::string join;
};

// Another client adds `permits` to NAME's PermitCounter and takes one at once: no waiter is ahead.
bool another_adds_and_takes(const std::string& name, std::int64_t permits) {
  auto other = turnstile::Client::connect(url());
  auto counter = other.permit_counter(name);
  counter.add_permits(permits);
  return counter.try_acquire(1);
}

// Item 10: the line's join, held by the proxy until after the acquire gave up and left, then
// delivered: it must create no waiter (one nobody owns would stand ahead of every taker).
TEST(ConsulLate, ACounterJoinDeliveredAfterItsLeaveCreatesNoWaiter) {
  LineCase late("line");
  auto join = late.proxy.hold_request(late.join);
  try {
    EXPECT_FALSE(late.counter.try_acquire_for(400ms, 1));
  } catch (const turnstile::BackendUnavailable&) {
  }
  ASSERT_TRUE(join->held());
  std::this_thread::sleep_for(300ms);  // the leave's background work, if any, is done
  deliver_and_wait(*join);
  EXPECT_EQ(keys_under(late.line), 0u) << "a waiter nobody owns";
  EXPECT_TRUE(another_adds_and_takes(late.name, 5));
}

// Item 9: a reader's hold transaction, held until after the acquire gave up and its unknown
// hold was released (the entry deleted), then delivered: it must not bring the entry back held.
TEST(ConsulLate, AReaderHoldDeliveredAfterItsReleaseHoldsNothing) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("reader");
  const auto queue = "turnstile/q/" + name + "/";
  auto mutex = client.shared_mutex(name);
  auto hold = proxy.hold_request(queue, 2);  // the join's transaction, then the hold's
  try {
    EXPECT_FALSE(mutex.try_lock_shared_for(600ms));
  } catch (const turnstile::BackendUnavailable&) {
  }
  ASSERT_TRUE(hold->held());
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(queue) == 0; }, 5s)) << "the unknown hold stays";
  deliver_and_wait(*hold);
  EXPECT_EQ(keys_under(queue), 0u) << "a reader held by nobody";
  auto writer_client = turnstile::Client::connect(url());
  auto writer = writer_client.shared_mutex(name);
  EXPECT_TRUE(writer.try_lock_for(1s));
}

// Item 9 / item 19: an exclusive hold transaction delivered after its release must not take the
// api.Lock key. Catches the hold losing its `check-session` of the entry: the late copy would
// then take the key for the client's session with no entry, blocking the name while it lives.
TEST(ConsulLate, AnExclusiveHoldDeliveredAfterItsReleaseTakesNoKey) {
  auto holder_client = turnstile::Client::connect(url());
  const auto name = unique("writer");
  const auto queue = "turnstile/q/" + name + "/";
  auto holder = holder_client.mutex(name);
  ASSERT_TRUE(holder.try_lock());
  turnstile_test::TcpProxy proxy(url());
  const auto label = unique("writer-label");
  auto client = turnstile::Client::connect(proxy.url_through(url()), labelled(label));
  // The one-step take's transaction, then the hold's: both lock the key for our session.
  auto hold = proxy.hold_request("\"Key\":\"" + name + "\",\"Session\":\"" + session_of(label), 2);
  auto mutex = client.mutex(name);
  auto waiter = std::async(std::launch::async, [&] {
    try {
      return mutex.try_lock_for(1500ms);
    } catch (const turnstile::BackendUnavailable&) {
      return false;
    }
  });
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(queue) == 2; }, 5s)) << "the waiter never joined";
  holder.unlock();
  EXPECT_TRUE(hold->wait_held(5s));
  EXPECT_FALSE(waiter.get());
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(queue) == 0; }, 5s)) << "the unknown hold stays";
  deliver_and_wait(*hold);
  EXPECT_EQ(value_of(name, "Session"), "") << "the api.Lock key was taken by a hold given up";
  EXPECT_TRUE(holder.try_lock_for(1s));
  holder.unlock();
}

// Issue 26: a copy of a queued join (libcurl resends a request on a reused connection that
// died; here the proxy's copy) replayed after its acquire ended must add no entry: a waiter
// nobody owns, held by the client's live session, would keep the name from everyone until the
// client ends. The join checks its marker is absent; every ending writes that marker.
struct CopiedJoin {
  explicit CopiedJoin(const std::string& what)
      : holder(turnstile::Client::connect(url())), name(unique(what)), queue("turnstile/q/" + name + "/"),
        held(holder.mutex(name)), proxy(url()), client(turnstile::Client::connect(proxy.url_through(url()))) {
    EXPECT_TRUE(held.try_lock());
    // The first request naming the occupancy key is the one-step take (refused: the name is
    // held), the second the queued join.
    copy = proxy.duplicate_request("turnstile/o/" + name, 2);
  }
  // Replays the copy once the server has answered it; then no entry may show within 1.5 s.
  void replay_and_expect_no_entry(std::size_t expected) {
    deliver_and_wait(*copy);
    EXPECT_FALSE(server_tests::eventually([&] { return keys_under(queue) != expected; }, 1500ms))
        << "the late copy added an entry nobody owns";
  }
  // A new client locks the name within 1 s (and unlocks).
  bool lockable_by_another() const {
    auto other = turnstile::Client::connect(url());
    auto fresh = other.mutex(name);
    if (!fresh.try_lock_for(1s)) return false;
    fresh.unlock();
    return true;
  }
  turnstile::Client holder;
  std::string name;
  std::string queue;
  turnstile::Mutex held;
  turnstile_test::TcpProxy proxy;
  turnstile::Client client;
  std::shared_ptr<turnstile_test::DuplicatedRequest> copy;
};

TEST(ConsulLate, AJoinCopyReplayedAfterItsHoldWasReleasedAddsNoEntry) {
  CopiedJoin late("copied-released");
  auto waiter = late.client.mutex(late.name).lock_async();
  ASSERT_TRUE(late.copy->wait_seen(5s)) << "the join never came";
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(late.queue) == 2; }, 5s)) << "it never waited";
  late.held.unlock();
  ASSERT_TRUE(waiter.wait_for(10s));
  auto lease = waiter.get();
  ASSERT_TRUE(lease.has_value());
  lease->release();
  ASSERT_EQ(keys_under(late.queue), 0u);
  late.replay_and_expect_no_entry(0);
  EXPECT_TRUE(late.lockable_by_another()) << "a waiter nobody owns keeps the name";
}

TEST(ConsulLate, AJoinCopyReplayedAfterItsWaiterLeftAddsNoEntry) {
  CopiedJoin late("copied-left");
  auto mutex = late.client.mutex(late.name);
  EXPECT_FALSE(mutex.try_lock_for(600ms));
  ASSERT_TRUE(late.copy->wait_seen(1s)) << "the join never came";
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(late.queue) == 1; }, 5s)) << "it never left";
  late.replay_and_expect_no_entry(1);
  late.held.unlock();
  EXPECT_TRUE(late.lockable_by_another()) << "a waiter nobody owns keeps the name";
}

// Issue 26: the same for a PermitCounter line's join, replayed after its acquire took its
// permits: a waiter nobody owns would stand ahead of every taker.
TEST(ConsulLate, ACounterJoinCopyReplayedAfterItsTakeAddsNoWaiter) {
  LineCase late("copied-line");
  auto copy = late.proxy.duplicate_request(late.join);
  auto taker = std::async(std::launch::async, [&] { return late.counter.try_acquire_for(10s, 1); });
  ASSERT_TRUE(copy->wait_seen(5s)) << "the join never came";
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(late.line) == 1; }, 5s)) << "it never waited";
  turnstile::Client::connect(url()).permit_counter(late.name).add_permits(1);
  ASSERT_TRUE(taker.get());
  ASSERT_EQ(keys_under(late.line), 0u);
  deliver_and_wait(*copy);
  EXPECT_FALSE(server_tests::eventually([&] { return keys_under(late.line) != 0; }, 1500ms)) << "a waiter nobody owns";
  EXPECT_TRUE(another_adds_and_takes(late.name, 1));
}

// Issue 26: a join whose reply was lost (applied: the one-step take wrote the occupancy key,
// NAME and the entry), then cancelled, leaves nothing: its undo ends the occupancy too.
TEST(ConsulLate, AJoinWhoseReplyWasLostThenCancelledLeavesNoOccupancy) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("lost-reply");
  const auto occupancy = "turnstile/o/" + name;
  auto warm = client.mutex(unique("warm"));  // the client's session made before replies are lost
  ASSERT_TRUE(warm.try_lock());
  warm.unlock();
  proxy.drop_replies();
  std::stop_source stop;
  auto acquire = client.mutex(name).lock_async(turnstile::AsyncOptions{{}, stop.get_token()});
  ASSERT_TRUE(server_tests::eventually([&] { return !value_of(occupancy, "Key").empty(); }, 5s))
      << "the join never applied";
  stop.request_stop();
  ASSERT_TRUE(acquire.wait_for(10s)) << "the cancel never ended it";
  try {
    EXPECT_FALSE(acquire.get().has_value());
  } catch (const turnstile::BackendUnavailable&) {
  }
  proxy.forward();
  EXPECT_TRUE(server_tests::eventually([&] { return value_of(occupancy, "Key").empty(); }, 5s))
      << "the occupancy key outlives its queue";
  EXPECT_EQ(keys_under("turnstile/q/" + name + "/"), 0u);
}

// Item 8: a take's CAS held until the acquire gave up on it (its call timed out, the counter
// read unchanged), delivered while the acquire's next take is on its way: the first must not
// apply, or one acquire of 1 takes 2. (Consul skips a rewrite that changes nothing, kvsSetTxn
// keeps the ModifyIndex: the settling writes the take's marker "void" instead.)
TEST(ConsulLate, ACounterTakeDeliveredAfterItWasGivenUpTakesNothing) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  const auto name = unique("take");
  auto counter = client.permit_counter(name);
  ASSERT_TRUE(counter.try_set_permits(5));
  auto first = proxy.hold_request("PUT /v1/txn", 1);
  auto second = proxy.hold_request("PUT /v1/txn", 2);
  auto acquire = std::async(std::launch::async, [&] {
    try {
      return counter.try_acquire_for(600ms, 1);
    } catch (const turnstile::BackendUnavailable&) {
      return false;
    }
  });
  ASSERT_TRUE(second->wait_held(5s)) << "the acquire never tried its take again";
  deliver_and_wait(*first);
  second->deliver();
  const bool taken = acquire.get();
  auto direct = turnstile::Client::connect(url());
  EXPECT_EQ(direct.permit_counter(name).available_permits(), taken ? 4 : 5) << (taken ? "taken" : "not taken");
}

// Issue 23 (the write rule): a downgrade held back until its hold was released whole (the
// downgrade failed), then delivered: it must not bring the entry back, held by a session that
// lives on (a reader nobody owns, ahead of every writer until the client ends).
TEST(ConsulLate, ADowngradeDeliveredAfterItsReleaseHoldsNothing) {
  turnstile_test::TcpProxy proxy(url());
  auto client = turnstile::Client::connect(proxy.url_through(url()));
  client.set_error_handler([](const turnstile::Error&) {});
  const auto name = unique("late-downgrade");
  const auto queue = "turnstile/q/" + name + "/";
  auto rw = client.shared_mutex(name);
  rw.lock();
  rw.lock_shared();
  auto downgrade = proxy.hold_request(queue);  // the next request naming the entry: the downgrade
  rw.unlock();                                 // fails after its patience: the hold is released whole
  ASSERT_TRUE(downgrade->held());
  ASSERT_EQ(rw.hold_state(), turnstile::HoldState::lost);
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under(queue) == 0; }, 10s)) << "the release never came";
  deliver_and_wait(*downgrade);
  EXPECT_EQ(keys_under(queue), 0u) << "the late downgrade brought the entry back";
  auto other = turnstile::Client::connect(url());
  auto writer = other.shared_mutex(name);
  EXPECT_TRUE(writer.try_lock_for(1s)) << "a reader nobody owns keeps writers out";
  if (writer.owns_lock()) writer.unlock();
  rw.unlock_shared();
}

// Issue 26 (rt26d): the markers of ended joins are deleted once kept, on a client connected
// with the keep shortened by the test hook (kRetiredKeep, two minutes, otherwise).
struct ShortKeep {
  explicit ShortKeep(const std::string& what, const std::string& through, const char* keep_ms)
      : label(unique(what + "-label")), client(connect(through, label, keep_ms)), session(session_of(label)) {
    EXPECT_FALSE(session.empty()) << "no session";
  }
  static turnstile::Client connect(const std::string& through, const std::string& label, const char* keep_ms) {
    ::setenv("TURNSTILE_TEST_CONSUL_MARKER_KEEP_MS", keep_ms, 1);
    auto client = turnstile::Client::connect(through, labelled(label));
    ::unsetenv("TURNSTILE_TEST_CONSUL_MARKER_KEEP_MS");
    return client;
  }
  // The markers of this client's joins (turnstile/x/<session>-<n>) on the server now.
  std::size_t markers() const { return keys_under("turnstile/x/" + session + "-"); }
  std::string label;
  turnstile::Client client;
  std::string session;
};

// Finding A: a burst of endings, then an idle client. Its markers are all deleted soon after
// their keep, without a further acquire (the sweep went on past one batch and ran on its own).
TEST(ConsulLate, AnIdleClientsMarkersAreSweptAfterTheirKeep) {
  ShortKeep keep("sweep", url(), "1500");
  auto mutex = keep.client.mutex(unique("sweep"));
  for (int i = 0; i < 200; ++i) {
    mutex.lock();
    mutex.unlock();
  }
  ASSERT_GT(keep.markers(), 0u) << "the endings wrote no markers";
  EXPECT_TRUE(server_tests::eventually([&] { return keep.markers() == 0; }, 8s))
      << keep.markers() << " markers left on an idle client";
}

// Finding B: a release whose reply was lost (applied): its marker is deleted too.
TEST(ConsulLate, TheMarkerOfAReleaseWhoseReplyWasLostIsSwept) {
  turnstile_test::TcpProxy proxy(url());
  ShortKeep keep("lost-release", proxy.url_through(url()), "2000");
  const auto name = unique("lost-release");
  auto mutex = keep.client.mutex(name);
  mutex.lock();
  proxy.drop_next_reply();
  try {
    mutex.unlock();  // the background takes the release over
  } catch (const turnstile::BackendUnavailable&) {
  }
  ASSERT_TRUE(server_tests::eventually([&] { return keys_under("turnstile/q/" + name + "/") == 0; }, 5s));
  ASSERT_GT(proxy.dropped_bytes(), 0u) << "no reply was lost";
  ASSERT_GT(keep.markers(), 0u) << "the release wrote no marker";
  EXPECT_TRUE(server_tests::eventually([&] { return keep.markers() == 0; }, 8s))
      << "the marker of the release whose reply was lost is still there";
}

// Item 14: `PUT ?acquire` with a session the server no longer has answers HTTP 500 'invalid
// session "ID"' (kvsLockTxn). A downgrade then is a hold lost, not a server unreachable. Without
// a lock-delay: with one, the acquire is refused before the session is looked at (kvsPreApply).
TEST(ConsulLate, ADowngradeAfterTheSessionWasDestroyedIsHoldLost) {
  const auto label = unique("downgrade-label");
  const auto without_delay = url().substr(0, url().find('?')) + "?lock_delay=0";
  auto client = turnstile::Client::connect(without_delay, labelled(label));
  auto mutex = client.shared_mutex(unique("downgrade"));
  mutex.lock();
  mutex.lock_shared();
  ASSERT_GE(destroy_sessions(label), 1);
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  mutex.unlock_shared();
}

// Item 14: a PermitCounter waiter whose session was destroyed joins the line again (a new
// session) rather than fail with BackendUnavailable.
TEST(ConsulLate, ACounterWaiterWhoseSessionWasDestroyedWaitsOnNotUnavailable) {
  const auto label = unique("counter-label");
  auto client = turnstile::Client::connect(url(), labelled(label));
  auto counter = client.permit_counter(unique("counter"));
  ASSERT_FALSE(counter.try_acquire(1));  // made the session, took nothing
  ASSERT_GE(destroy_sessions(label), 1);
  EXPECT_FALSE(counter.try_acquire_for(500ms, 1));
  EXPECT_EQ(counter.add_permits(1), 1);
  EXPECT_TRUE(counter.try_acquire_for(2s, 1));
}

}  // namespace
