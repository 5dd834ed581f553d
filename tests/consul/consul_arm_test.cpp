// SPDX-License-Identifier: Apache-2.0
// Issue 26: Consul's waits without a thread per waiter (QueuePlace::arm, CounterLine::arm over
// blocking_queries.hpp). Driven here as the core's async driver drives them (join, look,
// next_queue_step, arm, wait for the wake, look again), on the backend's own classes, against
// the Consul test stand-in: a thousand armed waiters on one name add one I/O thread, each
// release wakes exactly the next waiter (client-side and in the stand-in's counts), and they are
// admitted one at a time in queue order.
#include <gtest/gtest.h>

#include <curl/curl.h>
#include <dirent.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "backends/consul/consul_backend.hpp"
#include "consul/consul_test_support.hpp"
#include "core/backend.hpp"
#include "core/url.hpp"

namespace {

using namespace std::chrono_literals;
using namespace turnstile::detail;
using consul::ConsulBackend;
using turnstile::SteadyClock;

std::size_t thread_count() {
  std::size_t threads = 0;
  DIR* dir = opendir("/proc/self/task");
  while (const dirent* entry = dir ? readdir(dir) : nullptr) threads += entry->d_name[0] != '.';
  if (dir) closedir(dir);
  return threads;
}

long rss_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

// The stand-in these tests use: the thousand waiters' own (they count its blocking queries),
// else the suite's.
std::string standin_url() {
  const char* own = std::getenv("TURNSTILE_ARM_URL_FILE");
  return server_tests::read_first_line(own ? own : TURNSTILE_CONSUL_URL_FILE);
}

// One of the stand-in's counts (GET /v1/test-stand-in/stats; -1 when it does not answer).
double standin_stat(const std::string& what) {
  auto rest = standin_url().substr(std::string("consul://").size());
  const auto base = "http://" + rest.substr(0, rest.find('?'));
  const auto stats = nlohmann::json::parse(
      server_tests::shell("curl -s " + server_tests::quoted(base + "/v1/test-stand-in/stats")), nullptr, false);
  return stats.is_object() ? stats.value(what, 0.0) : -1;
}

// Its blocking queries by how they ended.
double blocking_queries(const std::string& ended) { return standin_stat("blocking " + ended); }

std::unique_ptr<ConsulBackend> connect() {
  static std::once_flag curl_ready;
  std::call_once(curl_ready, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  return std::make_unique<ConsulBackend>(consul::parse_settings(parse_url(standin_url()), turnstile::ClientOptions{}));
}

// The wakes of many waiters, in the order they ran (on the backend's I/O thread).
class Wakes {
 public:
  Wake wake_for(std::size_t waiter) {
    return [this, waiter] {
      std::lock_guard lock(mutex_);
      ran_.push_back(waiter);
      ++count_;
      changed_.notify_all();
    };
  }
  // The next waiter woken, in order; nullopt when none within `timeout`.
  std::optional<std::size_t> next(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return !ran_.empty(); })) return std::nullopt;
    const auto waiter = ran_.front();
    ran_.pop_front();
    return waiter;
  }
  std::size_t count() {
    std::lock_guard lock(mutex_);
    return count_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::size_t> ran_;
  std::size_t count_ = 0;
};

struct Waiter {
  std::unique_ptr<QueuePlace> place;
  std::unique_ptr<WakeArm> armed;
  std::size_t position = 0;  // in the queue at its first look (the holder's entry is 0: 0 not known yet)
};

std::shared_ptr<LossSignal> loss(const std::string& name) { return std::make_shared<LossSignal>(name, nullptr); }

// Joins and takes the name (it must be free).
std::unique_ptr<BackendHold> take(ConsulBackend& backend, const QueueRequest& request) {
  Standing standing;
  auto place = backend.join(request, false, std::nullopt, standing);
  if (next_queue_step(request, standing, true).action != QueueStep::Action::hold) return nullptr;
  return place->hold(loss(request.name));
}

// Joins and arms the wait the first look names (it must have to wait).
Waiter join_and_arm(ConsulBackend& backend, const QueueRequest& request, Wake wake) {
  Waiter waiter;
  Standing standing;
  waiter.place = backend.join(request, false, std::nullopt, standing);
  // One atomic read: exact while nobody leaves (none when the join read nothing: its first look).
  if (!standing.entries.empty()) waiter.position = standing.entries.size() - 1;
  const auto step = next_queue_step(request, standing, true);
  EXPECT_EQ(step.action, QueueStep::Action::wait);
  waiter.armed = waiter.place->arm(step.verdict, std::nullopt, std::move(wake));
  return waiter;
}

// What the core does with a wake: disarm, look again; the hold when admitted, else armed again.
std::unique_ptr<BackendHold> look_again(Waiter& waiter, const QueueRequest& request, Wake wake) {
  waiter.armed.reset();
  const auto standing = waiter.place->look(std::nullopt);
  if (waiter.position == 0) waiter.position = standing.entries.size() - 1;
  const auto step = next_queue_step(request, standing, true);
  if (step.action == QueueStep::Action::hold) return waiter.place->hold(loss(request.name));
  waiter.armed = waiter.place->arm(step.verdict, std::nullopt, std::move(wake));
  return nullptr;
}

// A wake may come early (a join's read has no X-Consul-Index to block from, so its first wait
// looks again at once; Consul's wait time ends): each that comes within `during` is looked at,
// as the core does. Returns their number but for first looks (a join that read nothing is woken
// by the client's shared query's answer that includes it); none of them may admit (held name).
std::size_t settle(std::vector<Waiter>& waiters, const QueueRequest& request, Wakes& wakes,
                   std::chrono::milliseconds during) {
  std::size_t woken = 0;
  for (const auto until = SteadyClock::now() + during; SteadyClock::now() < until;) {
    const auto waiter = wakes.next(std::chrono::ceil<std::chrono::milliseconds>(until - SteadyClock::now()));
    if (!waiter) break;
    if (waiters[*waiter].position != 0) ++woken;
    EXPECT_FALSE(look_again(waiters[*waiter], request, wakes.wake_for(*waiter))) << "admitted while the name is held";
  }
  return woken;
}

// Joins `count` waiters from a few threads (the stand-in answers joins one at a time, each
// reading the queue; a few in flight hide the round trips) and arms each.
std::vector<Waiter> join_and_arm_each(ConsulBackend& backend, const QueueRequest& request, Wakes& wakes,
                                      std::size_t count) {
  constexpr std::size_t kJoiners = 8;
  std::vector<Waiter> waiters(count);
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> joiners;
  for (std::size_t j = 0; j < kJoiners; ++j) {
    joiners.emplace_back([&] {
      for (std::size_t i; (i = next++) < count;) waiters[i] = join_and_arm(backend, request, wakes.wake_for(i));
    });
  }
  for (auto& joiner : joiners) joiner.join();
  return waiters;
}

// A client's backend, and a name it holds (the waiters queue behind that hold).
class ConsulArm : public ::testing::Test {
 protected:
  void hold_name(const std::string& leaf, EntryKind kind = EntryKind::exclusive) {
    request.name = consul_tests::unique(leaf);
    request.kind = kind;
    if (kind == EntryKind::lease) {
      request.primitive = Primitive::semaphore;
      request.limit = 1;
    }
    held = take(*backend, request);
    ASSERT_TRUE(held);
  }

  std::unique_ptr<ConsulBackend> backend = connect();
  QueueRequest request;
  std::unique_ptr<BackendHold> held;
};

// Every release changes exactly the one entry its successor waits for: the client's one query on
// the queue wakes once per release (the stand-in counts it) and wakes that successor only, and
// each wake admits the next in line (one woken for nothing would be a query whose wait time ran
// out, counted by the stand-in as such).
TEST_F(ConsulArm, AThousandArmedWaitersOnOneIoThreadAreAdmittedOneReleaseEach) {
  // 300 unless told (TURNSTILE_ARM_WAITERS=1000 for the full count: the stand-in reads the whole
  // queue for every look, ~3 min for 1,000 on a loaded 2-core machine). Set here, not through the
  // test's ENVIRONMENT: a discovered test keeps only the first of several variables given there.
  const char* count = std::getenv("TURNSTILE_ARM_WAITERS");
  const std::size_t kWaiters = count ? std::strtoul(count, nullptr, 10) : 300;
  hold_name("armed");

  Wakes wakes;
  const auto threads_before = thread_count();
  const long rss_before = rss_kib();
  const auto queue_start = SteadyClock::now();
  const double timed_out_before = blocking_queries("timed out");
  auto waiters = join_and_arm_each(*backend, request, wakes, kWaiters);
  const auto threads_armed = thread_count();  // the joiners are gone
  const long rss_armed = rss_kib();
  // One blocking query for all of them (one queue), not one connection each: Consul allows 200
  // connections per client address (limits.http_max_conns_per_client, the stand-in as well). The
  // rest are the joiners' kept-alive calls (8 spare handles) and a curl in between.
  const double connections = standin_stat("http connections open");
  EXPECT_LE(connections, 12.0) << "HTTP connections open at the stand-in with " << kWaiters << " armed waiters";
  EXPECT_EQ(standin_stat("http connections over the limit"), 0.0) << "refused 429 for too many connections";
  const auto queue_time = std::chrono::duration<double>(SteadyClock::now() - queue_start).count();
  for (std::size_t i = 0; i < kWaiters; ++i) ASSERT_TRUE(waiters[i].armed) << "waiter " << i;
  // Every waiter really waits: woken early, each looks and is not admitted, and is armed again.
  const auto early = settle(waiters, request, wakes, 1s);
  EXPECT_EQ(backend->blocking_queries().io_threads(), 1u);
  // The I/O thread; a default arm() would have added a thread per waiter.
  EXPECT_LE(threads_armed, threads_before + 2) << "threads: " << threads_before << " -> " << threads_armed;
  std::printf(
      "[ armed    ] %zu waiters queued in %.1f s: threads %zu -> %zu; client RSS %.1f KiB per armed waiter; "
      "%g HTTP connections open; %zu woken early (looked again, not admitted)\n",
      kWaiters, queue_time, threads_before, threads_armed, static_cast<double>(rss_armed - rss_before) / kWaiters,
      connections, early);

  for (std::size_t i = 0; i < kWaiters; ++i) ASSERT_NE(waiters[i].position, 0u) << "waiter " << i << " never looked";
  const double woken_before = blocking_queries("woken");
  const double listed_before = standin_stat("kv entries listed");
  const auto wakes_before = wakes.count();
  const auto drain_start = SteadyClock::now();
  std::size_t woken_for_nothing = early;
  for (std::size_t next = 0; next < kWaiters; ++next) {
    held->release();
    held.reset();
    while (!held) {
      const auto woken = wakes.next(20s);
      ASSERT_TRUE(woken) << "nobody woke after the release that should admit waiter " << next;
      auto hold = look_again(waiters[*woken], request, wakes.wake_for(*woken));
      if (!hold) {
        ++woken_for_nothing;
        continue;
      }
      ASSERT_EQ(waiters[*woken].position, next + 1) << "admitted out of queue order";
      held = std::move(hold);
      waiters[*woken].place.reset();  // the hold owns the entry now
    }
  }
  held->release();
  // The queue read per hand-off: the shared query's answer (about kWaiters / 2 entries on
  // average), not again by the look, the hold and the release (four such reads before: 752 per
  // hand-off with 300 waiters). A slow run (ASan) adds an answer now and then: 301 was seen.
  const double listed_per_release = (standin_stat("kv entries listed") - listed_before) / kWaiters;
  EXPECT_LE(listed_per_release, 1.5 * kWaiters) << "queue entries read per hand-off";
  std::printf("[ armed    ] %.0f queue entries read per hand-off\n", listed_per_release);
  const auto timed_out = blocking_queries("timed out") - timed_out_before;
  const auto woken = blocking_queries("woken") - woken_before;
  std::printf(
      "[ armed    ] %zu releases in %.1f s: %zu wakes, %g queries woken by a change; %zu woken for nothing "
      "since the first join, %g queries' wait time ended\n",
      kWaiters, std::chrono::duration<double>(SteadyClock::now() - drain_start).count(), wakes.count() - wakes_before,
      woken, woken_for_nothing, timed_out);
  // A release wakes at most the one query watching its entry (none when its successor happened
  // to be looking already, its wait having ended): a herd would show here as hundreds.
  EXPECT_LE(woken, static_cast<double>(kWaiters)) << "blocking queries woken by the releases";
  // Every other wake is a query whose wait time ended (Consul answers it unchanged).
  EXPECT_LE(static_cast<double>(woken_for_nothing), timed_out) << "woken for nothing, not by a wait's end";
}

// Disarming takes the query back: a change afterwards wakes nobody, and what the arm's wake
// captured is gone when the arm's destructor returns.
TEST_F(ConsulArm, ADisarmedWaiterIsNotWoken) {
  hold_name("disarmed");
  Wakes wakes;
  auto captured = std::make_shared<int>(0);
  auto waiter = join_and_arm(*backend, request, [&wakes, captured, wake = wakes.wake_for(0)] { wake(); });
  EXPECT_FALSE(wakes.next(300ms)) << "woken while the name is held";
  waiter.armed.reset();
  EXPECT_EQ(captured.use_count(), 1) << "the wake's captures outlived its arm";
  held->release();
  EXPECT_FALSE(wakes.next(1s)) << "a disarmed waiter was woken";
  // Still in line, and first: a look admits it.
  EXPECT_EQ(next_queue_step(request, waiter.place->look(std::nullopt), true).action, QueueStep::Action::hold);
}

// A Semaphore waiter waits for any holder's leave: two queries (NAME/ and the queue), one wake.
TEST_F(ConsulArm, ASemaphoreWaiterIsWokenByAHoldersLeave) {
  hold_name("leases", EntryKind::lease);
  Wakes wakes;
  std::vector<Waiter> waiters;
  waiters.push_back(join_and_arm(*backend, request, wakes.wake_for(0)));
  auto& waiter = waiters.front();
  settle(waiters, request, wakes, 300ms);  // its first wait had no index to block from
  held->release();
  ASSERT_TRUE(wakes.next(10s)) << "not woken by the holder's release";
  held = look_again(waiter, request, wakes.wake_for(0));
  ASSERT_TRUE(held);
  held->release();
}

// A PermitCounter waiter waits for the value: adding permits wakes it, and it takes them.
TEST_F(ConsulArm, ACounterWaiterIsWokenByTheValue) {
  const auto name = consul_tests::unique("counter");
  auto line = backend->counter_line(name, 2, {});
  auto standing = line->look(false, std::nullopt);
  ASSERT_EQ(evaluate_counter_line(standing.ahead, standing.value, 2), CounterWait::value);
  line->join(std::nullopt);
  standing = line->look(false, std::nullopt);
  const auto what = evaluate_counter_line(standing.ahead, standing.value, 2);
  ASSERT_EQ(what, CounterWait::value);
  Wakes wakes;
  auto armed = line->arm(what, std::nullopt, wakes.wake_for(0));
  // A wake may come early (a query without an index to block from returns at once; the stand-in,
  // as Consul, may return a query for a write beside its key): each looks again, finds no
  // permits and arms again, until the line is quiet. (Under a loaded run the test once failed
  // here asserting no wake at all within 300 ms.)
  for (int early = 0; wakes.next(300ms); ++early) {
    ASSERT_LT(early, 10) << "woken again and again while the counter has no permits";
    armed.reset();
    standing = line->look(false, std::nullopt);
    ASSERT_EQ(evaluate_counter_line(standing.ahead, standing.value, 2), CounterWait::value);
    armed = line->arm(CounterWait::value, std::nullopt, wakes.wake_for(0));
  }
  backend->counter_add(name, 2);
  ASSERT_TRUE(wakes.next(10s)) << "not woken by the permits added";
  armed.reset();
  standing = line->look(false, std::nullopt);
  ASSERT_EQ(evaluate_counter_line(standing.ahead, standing.value, 2), CounterWait::nothing);
  EXPECT_TRUE(line->take(standing, std::nullopt));
  EXPECT_EQ(backend->counter_get(name), 0);
}

}  // namespace
