// SPDX-License-Identifier: Apache-2.0
// Issue 22 (Redis): requests that reach the server after their sender gave up, left, released
// or went on, and entries rewritten under their owner. A request is held back by the test proxy
// (tests/support/tcp_proxy.hpp) or by a frozen server (SIGSTOP), then delivered; it must change
// nothing. Every counter change is applied at most once, however many calls came between.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <sstream>
#include <stop_token>

#include "conformance/support.hpp"
#include "redis/own_server.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using redis_tests::RedisServer;
using redis_tests::Thaw;

using redis_tests::state_key;

class RedisLateRequests : public redis_tests::FixtureServerTest {};

// The entry text with its request id (the 4th word: see queue_prelude.lua) replaced.
std::string with_request(const std::string& entry, const std::string& request) {
  std::istringstream words(entry);
  std::string word, out;
  for (int i = 0; words >> word; ++i) out += (i ? " " : "") + (i == 3 ? request : word);
  return out;
}

// Issue 22.3: PermitCounter::acquire(2) ended (by a stop at 300 ms, or by its deadline) while
// the server is frozen. Its look reaches the server once it resumes; it must not take the
// permits for good (5 left), nor leave a waiter nobody owns at the head of the line (1 left,
// too few: the look would wait there for its 10 s TTL).
TEST(RedisLateRequestsOwnServer, ACounterAcquireEndedDuringAStallTakesNothingWhenTheServerResumes) {
  RedisServer server("--save '' --appendonly no");
  struct Case {
    std::int64_t count;
    bool by_stop;
  };
  for (const auto& [count, by_stop] : {Case{5, true}, Case{1, true}, Case{5, false}}) {
    const auto name = unique_name("stalled-counter");
    auto setter = Client::connect(server.url());
    ASSERT_TRUE(setter.permit_counter(name).try_set_permits(count));
    auto client = Client::connect(server.url(), with_ttl(10s));
    auto counter = client.permit_counter(name);
    ASSERT_FALSE(client.permit_counter(name + "-warm").try_acquire(1));  // its scripts are loaded
    std::stop_source stop;
    server.signal(SIGSTOP);
    const Thaw thaw{server};
    auto taken = std::async(std::launch::async, [&] {
      try {
        return by_stop ? counter.acquire(2, stop.get_token()) : counter.try_acquire_for(300ms, 2);
      } catch (const turnstile::BackendUnavailable&) {
        return false;  // the deadline's way: the outcome was unknown, and the acquire is retired
      }
    });
    std::this_thread::sleep_for(300ms);
    stop.request_stop();
    ASSERT_EQ(taken.wait_for(5s), std::future_status::ready) << "the acquire did not end";
    EXPECT_FALSE(taken.get());
    server.signal(SIGCONT);
    const auto settled = [&] {
      return setter.permit_counter(name).available_permits() == count && setter.inspect(name).waiters.empty();
    };
    EXPECT_TRUE(eventually(settled, 4s)) << "count " << count << (by_stop ? ", stopped" : ", deadline")
                                         << ": the late look took "
                                         << count - setter.permit_counter(name).available_permits()
                                         << " permit(s) and left " << setter.inspect(name).waiters.size()
                                         << " waiter(s)";
    std::this_thread::sleep_for(300ms);
    EXPECT_TRUE(settled()) << "a late look changed the counter after it settled";
  }
}

// Red team, issue 22 round 3: a try-once ends within its one-shot floor (1 s) when the server
// does not answer, its clean-up left to the watchdog: Mutex::try_lock() returned after 6 s
// (the connection's 5 s reply cap, then a 1 s leave), try_lock_for(300ms) after 2 s.
TEST(RedisLateRequestsOwnServer, ATryOnceEndsWithinItsFloorWhenTheServerStalls) {
  RedisServer server("--save '' --appendonly no");
  auto client = Client::connect(server.url(), with_ttl(10s));
  const auto name = unique_name("stalled-try");
  {
    auto warm = client.mutex(name + "-warm");  // its scripts are loaded
    ASSERT_TRUE(warm.try_lock());
    warm.unlock();
  }
  server.signal(SIGSTOP);
  const Thaw thaw{server};
  for (const bool timed : {false, true}) {
    auto mutex = client.mutex(name);
    const auto start = std::chrono::steady_clock::now();
    bool got = true;
    try {
      got = timed ? mutex.try_lock_for(300ms) : mutex.try_lock();
    } catch (const turnstile::BackendUnavailable&) {
      got = false;
    }
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_FALSE(got);
    EXPECT_LT(took, 1500ms) << (timed ? "try_lock_for(300ms)" : "try_lock()") << " took "
                            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  }
  server.signal(SIGCONT);
  auto next = Client::connect(server.url()).mutex(name);
  EXPECT_TRUE(next.try_lock_for(5s)) << "the given-up tries left an entry behind";
}

// Red team, issue 22 round 3: a client destroyed while the retirement of a given-up
// PermitCounter acquire is still pending (its link cut) tries it once more before it ends (for
// a second): when the link heals within that second, the look delivered late takes nothing.
// The client dropped it at once, and the late look took 2 permits for good (3 left).
TEST_F(RedisLateRequests, AClientEndingRightAfterGivingUpRetiresItsRequestFirst) {
  const auto name = unique_name("exit-after-give-up");
  auto direct = Client::connect(url_);
  ASSERT_TRUE(direct.permit_counter(name).try_set_permits(5));
  turnstile_test::TcpProxy proxy(url_);
  auto client = std::make_unique<Client>(Client::connect(proxy.url_through(url_), with_ttl(10s)));
  ASSERT_FALSE(client->permit_counter(name + "-warm").try_acquire(1));  // its scripts are loaded
  // Every request naming the counter is held: the look, the leave, the watchdog's retirements.
  std::vector<std::shared_ptr<turnstile_test::HeldRequest>> holds;
  for (int i = 1; i <= 40; ++i) holds.push_back(proxy.hold_request(name, i));
  std::stop_source stop;
  auto taken =
      std::async(std::launch::async, [&] { return client->permit_counter(name).acquire(2, stop.get_token()); });
  ASSERT_TRUE(holds.front()->wait_held(2s)) << "the look was never held: nothing tested";
  stop.request_stop();
  ASSERT_EQ(taken.wait_for(5s), std::future_status::ready) << "the acquire did not end";
  ASSERT_FALSE(taken.get());
  ASSERT_TRUE(holds[1]->wait_held(2s)) << "the leave was never held: nothing pending";
  // The client ends; 300 ms in, the link heals: the look arrives late.
  auto ended = std::async(std::launch::async, [&] { client.reset(); });
  std::this_thread::sleep_for(300ms);
  holds.front()->deliver();
  // Connections held so far stay cut (their requests lost, as with a partition that outlives
  // them); new ones flow.
  for (std::size_t i = 1; i < holds.size(); ++i) {
    if (!holds[i]->held()) holds[i]->drop();
  }
  ASSERT_EQ(ended.wait_for(5s), std::future_status::ready) << "the client did not end";
  const auto settled = [&] {
    return direct.permit_counter(name).available_permits() == 5 && direct.inspect(name).waiters.empty();
  };
  EXPECT_TRUE(eventually(settled, 2s)) << "the late look took " << 5 - direct.permit_counter(name).available_permits()
                                       << " permit(s) after its client ended";
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(settled()) << "the late look changed the counter after it settled";
}

// Issue 22.4: a try_lock_for whose acquire is held back by the proxy ends (the client retires
// the request on another connection); the acquire delivered after that must create no entry
// (it made a holder nobody owns, for the TTL). MultiLock's members are acquired the same way.
TEST_F(RedisLateRequests, AnAcquireDeliveredAfterItsSenderGaveUpCreatesNothing) {
  turnstile_test::TcpProxy proxy(url_);
  auto client = Client::connect(proxy.url_through(url_), with_ttl(20s));
  auto direct = Client::connect(url_);
  for (const bool multi : {false, true}) {
    const auto name = unique_name("late-acquire");
    {
      auto warm = client.mutex(name + "-warm");  // the scripts are loaded
      ASSERT_TRUE(warm.try_lock_for(1s));
      warm.unlock();
    }
    auto held = proxy.hold_request(state_key(name));
    bool got = true;
    try {
      if (multi) {
        auto first = client.mutex(name + "-first");
        auto second = client.mutex(name);
        turnstile::MultiLock both(first, second);
        got = both.try_lock_for(300ms);
        if (got) both.unlock();
      } else {
        auto mutex = client.mutex(name);
        got = mutex.try_lock_for(300ms);
        if (got) mutex.unlock();
      }
    } catch (const turnstile::BackendUnavailable&) {
      got = false;  // the outcome was unknown: the client retired the request
    }
    EXPECT_FALSE(got) << "held back, and still admitted";
    ASSERT_TRUE(held->held()) << "the acquire was never held back: nothing tested";
    // Delivered once the client's retirement (a release by request id, sent on another
    // connection or retried by the watchdog) shows in its request record ('x': retired), or
    // after 3 s (a client that records nothing).
    eventually([&] { return redis_cli(url_, "HGETALL " + quoted(state_key(name))).find("=x") != std::string::npos; },
               3s);
    held->deliver();
    EXPECT_FALSE(eventually(
        [&] {
          const auto seen = direct.inspect(name);
          return !seen.holders.empty() || !seen.waiters.empty();
        },
        1500ms))
        << (multi ? "MultiLock: " : "") << "the late acquire created an entry nobody owns";
    auto next = direct.mutex(name);
    EXPECT_TRUE(next.try_lock_for(0ms)) << "the name is held by a ghost";
    if (next.owns_lock()) next.unlock();
  }
}

// Issue 22.5 and 22.19: a counter change reaches the server at most once. A copy of add(1)
// replayed at once (a resend after a lost reply) finds it done; a copy of add(5) replayed after
// 17 more changes of the same client (more than any count window) changes nothing either.
TEST_F(RedisLateRequests, ACounterChangeIsAppliedOnceHoweverManyCallsCameBetween) {
  turnstile_test::TcpProxy proxy(url_);
  auto through = Client::connect(proxy.url_through(url_));
  auto direct = Client::connect(url_);
  const auto name = unique_name("once");
  ASSERT_TRUE(direct.permit_counter(name).try_set_permits(0));
  auto counter = through.permit_counter(name);
  auto add_five = proxy.duplicate_request(name, 1);
  auto add_one = proxy.duplicate_request(name, 2);
  EXPECT_EQ(counter.add_permits(5), 5);
  EXPECT_EQ(counter.add_permits(1), 6);
  ASSERT_TRUE(add_one->wait_seen(1s) && add_five->wait_seen(1s));
  add_one->replay();
  EXPECT_FALSE(eventually([&] { return direct.permit_counter(name).available_permits() != 6; }, 500ms))
      << "a resent add(1) was applied twice: " << direct.permit_counter(name).available_permits();
  for (int i = 0; i < 17; ++i) counter.add_permits(1);
  ASSERT_EQ(direct.permit_counter(name).available_permits(), 23);
  add_five->replay();
  EXPECT_FALSE(eventually([&] { return direct.permit_counter(name).available_permits() != 23; }, 500ms))
      << "a late add(5) was applied after 18 other changes: " << direct.permit_counter(name).available_permits();
}

// Issue 22.19: a release removes its own entry only. The holder's entry rewritten as another
// request's (what a lost state and a reused number would look like): the release must leave
// it and report the hold lost, not delete by number.
TEST_F(RedisLateRequests, AReleaseRemovesOnlyItsOwnEntry) {
  auto client = Client::connect(url_);
  const auto name = unique_name("owner");
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto field = std::to_string(mutex.fencing_token());
  const auto key = quoted(state_key(name));
  const auto others = with_request(redis_cli(url_, "HGET " + key + " " + field), "feedfacefeedfacefeedface:1");
  redis_cli(url_, "HSET " + key + " " + field + " " + quoted(others));
  EXPECT_THROW(mutex.release(), turnstile::HoldLost) << "the release took another's entry for its own";
  EXPECT_EQ(redis_cli(url_, "HGET " + key + " " + field), others) << "the release removed another's entry";
  redis_cli(url_, "DEL " + key);
}

// Issue 22.19: a renewal (the quick one, which reads only the entries it names) extends its
// own entry only. The holder's entry rewritten as another request's: the next renewal must
// report the hold lost and leave that entry's lease end alone.
TEST_F(RedisLateRequests, ARenewalExtendsOnlyItsOwnEntry) {
  auto client = Client::connect(url_, with_ttl(1500ms));  // renewals every 500 ms
  const auto name = unique_name("renew-owner");
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto lost = mutex.lost_token();
  const auto field = std::to_string(mutex.fencing_token());
  const auto key = quoted(state_key(name));
  const auto others = with_request(redis_cli(url_, "HGET " + key + " " + field), "feedfacefeedfacefeedface:1");
  redis_cli(url_, "HSET " + key + " " + field + " " + quoted(others));
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 1200ms))
      << "renewals went on confirming an entry that is not the holder's";
  EXPECT_EQ(redis_cli(url_, "HGET " + key + " " + field), others) << "a renewal extended another's entry";
  redis_cli(url_, "DEL " + key);
  try {
    mutex.release();
  } catch (const turnstile::Error&) {
  }
}

// The server's clock in ms (request records' ends are in it).
std::int64_t server_ms(const std::string& url) {
  std::istringstream words(redis_cli(url, "TIME"));
  std::int64_t seconds = 0, micros = 0;
  words >> seconds >> micros;
  return seconds * 1000 + micros / 1000;
}

// The request record fields ("r:<client>") of a hash: field -> the record's end (ms).
std::map<std::string, std::int64_t> record_ends(const std::string& url, const std::string& key) {
  std::istringstream lines(redis_cli(url, "HGETALL " + quoted(key)));
  std::map<std::string, std::int64_t> ends;
  for (std::string field, value; std::getline(lines, field) && std::getline(lines, value);) {
    if (field.rfind("r:", 0) == 0) ends[field] = std::stoll(value.substr(0, value.find(' ')));
  }
  return ends;
}

// Red team, issue 22 round 3: a client's request records are kept 2 TTLs (at least 2 minutes)
// whichever script wrote them last, and a rewrite never brings their end nearer. They ended
// 2 minutes on unless a release wrote them last, so with a 10-minute TTL a copy delivered
// 130 s late (a counter change, an acquire given up) was applied.
TEST_F(RedisLateRequests, RequestRecordsAreKeptTwoTtlsWhicheverScriptWroteThemLast) {
  constexpr std::int64_t kTwoTtlsMs = 1'200'000, kSlackMs = 20'000;
  auto client = Client::connect(url_, with_ttl(600s));
  auto other = Client::connect(url_);
  const auto name = unique_name("record-life");
  auto mutex = client.mutex(name);
  mutex.lock();
  mutex.unlock();
  const auto after_release = record_ends(url_, state_key(name));
  ASSERT_EQ(after_release.size(), 1u) << "one record: the client's";
  const auto [field, release_end] = *after_release.begin();
  EXPECT_GE(release_end - server_ms(url_), kTwoTtlsMs - kSlackMs) << "after a release";
  auto holder = other.mutex(name);
  holder.lock();
  ASSERT_FALSE(mutex.try_lock()) << "the name is held: a try-once decides without an entry";
  const auto try_end = record_ends(url_, state_key(name))[field];
  EXPECT_GE(try_end - server_ms(url_), kTwoTtlsMs - kSlackMs) << "after a try-once rewrote the record";
  EXPECT_GE(try_end, release_end) << "a rewrite brought the record's end nearer";
  holder.unlock();

  const auto counter_name = unique_name("record-life-counter");
  auto counter = client.permit_counter(counter_name);
  const auto line = "{" + counter_name + "}:turnstile:c";
  counter.add_permits(1);
  ASSERT_EQ(record_ends(url_, line).size(), 1u) << "the add recorded nothing";
  EXPECT_GE(record_ends(url_, line).begin()->second - server_ms(url_), kTwoTtlsMs - kSlackMs) << "after an add";
  ASSERT_TRUE(counter.try_acquire(1));
  EXPECT_GE(record_ends(url_, line).begin()->second - server_ms(url_), kTwoTtlsMs - kSlackMs) << "after a take";
  redis_cli(url_, "DEL " + quoted(state_key(name)) + " " + quoted(counter_name) + " " + quoted(line));
}

// Red team, issue 22 round 3: one long PermitCounter waiter does not pin its client's
// watermark. The client's other changes of that counter were kept one by one in its record
// (r:<client>) for as long as the waiter waited: 117 KB after 8,000 pairs, parsed by every
// script on the name.
TEST_F(RedisLateRequests, ALongWaiterDoesNotMakeItsClientsRecordGrow) {
  auto client = Client::connect(url_);
  const auto name = unique_name("pinned");
  auto counter = client.permit_counter(name);
  ASSERT_TRUE(counter.try_set_permits(0));
  std::stop_source stop;
  auto waiter =
      std::async(std::launch::async, [&] { return client.permit_counter(name).acquire(1000, stop.get_token()); });
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 3s)) << "the waiter never queued";
  for (int i = 0; i < 200; ++i) counter.add_permits(1);
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "the waiter was not waiting";
  const auto line = "{" + name + "}:turnstile:c";
  std::istringstream lines(redis_cli(url_, "HGETALL " + quoted(line)));
  std::string record;
  for (std::string field, value; std::getline(lines, field) && std::getline(lines, value);) {
    if (field.rfind("r:", 0) == 0) record = value;
  }
  const auto items = std::count(record.begin(), record.end(), '=');
  EXPECT_LE(items, 4) << "the record keeps " << items << " requests (" << record.size() << " bytes) behind one waiter";
  stop.request_stop();
  EXPECT_FALSE(waiter.get());
  EXPECT_EQ(counter.available_permits(), 200);
  redis_cli(url_, "DEL " + quoted(name) + " " + quoted(line));
}

// INFO commandstats: the HGETs the server has run (a script's count too; the tests here read
// entries with HGETALL).
long long hget_calls(const RedisServer& server) {
  const auto stats = server.cli("INFO commandstats");
  const std::string counter = "cmdstat_hget:calls=";
  const auto at = stats.find(counter);
  return at == std::string::npos ? 0 : std::atoll(stats.c_str() + at + counter.size());
}

// The lease end (server ms) of the name's one entry, -1 when it has none. An entry's field is
// its seq; its text "<kind><admitted> <permits> <limit> <request> <until ms> ..." (see
// queue_prelude.lua).
std::int64_t lone_entry_end(const std::string& url, const std::string& name) {
  std::istringstream lines(redis_cli(url, "HGETALL " + quoted(state_key(name))));
  for (std::string field, value; std::getline(lines, field) && std::getline(lines, value);) {
    if (field.empty() || !std::all_of(field.begin(), field.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    std::istringstream words(value);
    std::string word;
    for (int i = 0; i < 5; ++i) words >> word;
    return std::stoll(word);
  }
  return -1;
}

// A lock() of the name on a thread of its own that records when it returned and when the hold
// was reported lost, and keeps the hold until finish() (or until it is destroyed).
class RecordedWaiter {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::time_point kNever{};

  RecordedWaiter(Client& client, const std::string& name) {
    run_ = std::async(std::launch::async, [this, &client, name, done = finished_.get_future()] {
      auto mutex = client.mutex(name);
      if (!mutex.try_lock_for(30s, stop_.get_token())) return;
      admitted_at_ = Clock::now();
      const std::stop_callback on_loss(mutex.lost_token(), [this] { lost_at_ = Clock::now(); });
      done.wait_for(30s);
      try {
        mutex.unlock();
      } catch (const turnstile::Error&) {
        // Lost: nothing left to release.
      }
    });
  }
  ~RecordedWaiter() { finish(); }
  RecordedWaiter(const RecordedWaiter&) = delete;
  RecordedWaiter& operator=(const RecordedWaiter&) = delete;

  Clock::time_point admitted_at() const { return admitted_at_; }
  Clock::time_point lost_at() const { return lost_at_; }
  // Releases the hold, or gives the wait up.
  void finish() {
    if (std::exchange(finishing_, true)) return;
    stop_.request_stop();
    finished_.set_value();
    run_.wait();
  }

 private:
  std::atomic<Clock::time_point> admitted_at_{kNever};
  std::atomic<Clock::time_point> lost_at_{kNever};
  std::stop_source stop_;
  std::promise<void> finished_;
  bool finishing_ = false;
  std::future<void> run_;
};

// Waits until the name's one entry has run out by the server's clock (false by `timeout`).
bool entry_expires(const std::string& url, const std::string& name, std::chrono::milliseconds timeout) {
  return eventually(
      [&] {
        const auto end = lone_entry_end(url, name);
        return end > 0 && server_ms(url) > end + 50;
      },
      timeout);
}

// Red team, issue 25 (rt25b): a waiter a message names checks its admission with one plain
// HGET (no script). That HGET held back until the entry's lease had run out (its renewals held
// too), the server read the expired entry as admitted: the waiter was admitted on it and told
// lost as another client got the name, not TTL/10 before (the loss rule). An answer that comes
// TTL/2 or more after the last renewal's send counts for nothing now: the script looks.
TEST(RedisLateRequestsOwnServer, ANamedWaitersLateHgetDoesNotAdmitItOnItsExpiredEntry) {
  using Clock = RecordedWaiter::Clock;
  constexpr auto kTtl = 2000ms;
  RedisServer server("--save '' --appendonly no");
  turnstile_test::TcpProxy proxy(server.url());
  auto direct = Client::connect(server.url(), with_ttl(kTtl));
  auto other = Client::connect(server.url(), with_ttl(kTtl));
  auto through = Client::connect(proxy.url_through(server.url()), with_ttl(kTtl));
  const auto name = unique_name("late-hget");
  auto holder = direct.mutex(name);
  holder.lock();
  RecordedWaiter waiter(through, name);
  ASSERT_TRUE(eventually([&] { return direct.inspect(name).waiters.size() == 1; }, 3s)) << "the waiter never queued";
  ASSERT_EQ(waiter.admitted_at(), RecordedWaiter::kNever) << "admitted while the name was held";
  // Released just after a renewal of the waiter's entry: its client checks with an HGET only
  // within TTL/2 of one (its first comes up to TTL/3 after it queued).
  const auto queued_end = lone_entry_end(server.url(), name);
  ASSERT_TRUE(eventually([&] { return lone_entry_end(server.url(), name) > queued_end; }, kTtl))
      << "the waiter's entry was never renewed";
  std::this_thread::sleep_for(50ms);  // its client has read the renewal's answer
  auto hget = proxy.hold_request("$4\r\nHGET\r\n");
  holder.unlock();
  ASSERT_TRUE(hget->wait_held(2s)) << "the message's waiter never sent its HGET: nothing tested";
  // Every later call naming the entry is held too (the watchdog's renewals, the waiter's
  // look): nothing renews it, and no script drops it once expired.
  std::vector<std::shared_ptr<turnstile_test::HeldRequest>> renewals;
  for (int i = 1; i <= 40; ++i) renewals.push_back(proxy.hold_request(state_key(name), i));
  ASSERT_TRUE(entry_expires(server.url(), name, kTtl + 2s)) << "the waiter's entry did not run out";
  const auto hgets = hget_calls(server);
  hget->deliver();
  ASSERT_TRUE(eventually([&] { return hget_calls(server) > hgets; }, 2s)) << "the late HGET never ran";
  // At once another client tries: its script drops the expired entry and admits it.
  auto next = other.mutex(name);
  const auto next_at = Clock::now();
  ASSERT_TRUE(next.try_lock()) << "the expired entry still held the name";
  std::this_thread::sleep_for(300ms);  // the waiter acts on the late answer
  const auto next_released_at = Clock::now();
  next.unlock();
  for (auto& held : renewals) held->drop();
  EXPECT_TRUE(eventually([&] { return waiter.admitted_at() != RecordedWaiter::kNever; }, 5s))
      << "the waiter never got the free name";
  const auto admitted = waiter.admitted_at(), lost = waiter.lost_at();
  const auto at = [&](Clock::time_point t) {
    if (t == RecordedWaiter::kNever) return std::string("never");
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(t - next_at).count()) + " ms";
  };
  if (admitted != RecordedWaiter::kNever && admitted < next_released_at) {
    EXPECT_TRUE(lost != RecordedWaiter::kNever && lost <= next_at - kTtl / 10)
        << "admitted on its expired entry (at " << at(admitted) << ") and told lost at " << at(lost)
        << ", counted from when another client asked for the name; the loss rule needs -" << (kTtl / 10).count()
        << " ms or earlier";
  }
  waiter.finish();
}

}  // namespace
