// SPDX-License-Identifier: Apache-2.0
// Issue 26: an async acquire waits on ZooKeeper without a thread of its own. These tests drive
// the backend's QueuePlace::arm and CounterLine::arm directly, as the core's async driver does
// (join, look, next_queue_step, arm, wait for the wake, look again): 1,000 waiters armed on one
// name add no more than a few threads to the process and a few KiB each; each release wakes the
// next waiter alone, in queue order; the wake comes from the backend's own threads; a disarmed
// wake never runs.
#include <gtest/gtest.h>

#include <dirent.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/backend_loader.hpp"
#include "core/queue_store.hpp"
#include "core/url.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using namespace server_tests;
using namespace turnstile::detail;
using turnstile::Deadline;
using turnstile::SteadyClock;
using turnstile_test::TcpProxy;

std::string server_url() { return read_first_line(TURNSTILE_ZOOKEEPER_URL_FILE); }

// The backend keeps the telemetry it reports to (OwnedBackend).
OwnedBackend connect(const std::string& url = server_url(), turnstile::ClientOptions options = {}) {
  return connect_backend(parse_url(url), options).backend;
}

std::size_t thread_count() {
  std::size_t count = 0;
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(tasks)) count += entry->d_name[0] != '.';
    closedir(tasks);
  }
  return count;
}

long rss_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(line.find(':') + 1));
  }
  return -1;
}

Deadline later() { return SteadyClock::now() + 120s; }

std::shared_ptr<LossSignal> loss(const std::string& name) {
  return std::make_shared<LossSignal>(name, std::make_shared<const LossSignal::Callbacks>());
}

// The wakes of many armed waiters, by index, in the order they ran, and the threads they ran on.
class Wakes {
 public:
  explicit Wakes(std::size_t waiters) : counts_(waiters, 0) {}
  Wake wake_for(std::size_t index) {
    return [this, index] {
      {
        std::lock_guard lock(mutex_);
        ++counts_[index];
        pending_.push_back(index);
        if (std::this_thread::get_id() == test_thread_) on_test_thread_ = true;
      }
      cv_.notify_all();
    };
  }
  // The next waiter woken, in order; none within `bound`.
  std::optional<std::size_t> next(std::chrono::milliseconds bound = 60s) {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, bound, [&] { return !pending_.empty(); })) return std::nullopt;
    const auto index = pending_.front();
    pending_.pop_front();
    return index;
  }
  void again(std::size_t index) {
    std::lock_guard lock(mutex_);
    pending_.push_front(index);
  }
  int count(std::size_t index) {
    std::lock_guard lock(mutex_);
    return counts_[index];
  }
  std::size_t total() {
    std::lock_guard lock(mutex_);
    std::size_t sum = 0;
    for (const int count : counts_) sum += static_cast<std::size_t>(count);
    return sum;
  }
  bool ran_on_test_thread() {
    std::lock_guard lock(mutex_);
    return on_test_thread_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int> counts_;
  std::deque<std::size_t> pending_;
  std::thread::id test_thread_ = std::this_thread::get_id();
  bool on_test_thread_ = false;
};

struct Contender {
  std::unique_ptr<QueuePlace> place;
  std::unique_ptr<WakeArm> arm;
};

QueueRequest lock_request(const std::string& name) { return {.name = name}; }

QueueRequest lease_request(const std::string& name, std::int64_t limit) {
  return {.name = name, .kind = EntryKind::lease, .permits = 1, .limit = limit, .primitive = Primitive::semaphore};
}

std::unique_ptr<BackendHold> hold_at_once(Backend& backend, const QueueRequest& request) {
  Standing standing;
  auto place = backend.join(request, false, later(), standing);
  for (;;) {
    EXPECT_EQ(next_queue_step(request, standing, true).action, QueueStep::Action::hold);
    try {
      return place->hold(loss(request.name));
    } catch (const QueueChanged&) {
      standing = place->look(later());  // as the core does (a semaphore's first hold makes its parent)
    }
  }
}

// Joins and arms `count` waiters behind what the name has now: each must wait.
std::vector<Contender> arm_waiters(Backend& backend, const QueueRequest& request, std::size_t count, Wakes& wakes) {
  std::vector<Contender> contenders(count);
  for (std::size_t i = 0; i < count; ++i) {
    Standing standing;
    contenders[i].place = backend.join(request, false, later(), standing);
    const auto step = next_queue_step(request, standing, true);
    EXPECT_EQ(step.action, QueueStep::Action::wait) << "waiter " << i;
    contenders[i].arm = contenders[i].place->arm(step.verdict, later(), wakes.wake_for(i));
  }
  return contenders;
}

// On each wake, as the core's driver does: look again, then hold (released at once, which lets
// the next one in) or arm again. The waiters in the order they were admitted.
std::vector<std::size_t> admit_in_turn(const QueueRequest& request, std::vector<Contender>& contenders, Wakes& wakes) {
  std::vector<std::size_t> admitted;
  while (admitted.size() < contenders.size()) {
    const auto woken = wakes.next();
    if (!woken) {
      ADD_FAILURE() << "no wake within a minute; admitted " << admitted.size();
      break;
    }
    auto& contender = contenders[*woken];
    contender.arm.reset();
    const auto step = next_queue_step(request, contender.place->look(later()), true);
    if (step.action == QueueStep::Action::wait) {
      contender.arm = contender.place->arm(step.verdict, later(), wakes.wake_for(*woken));
      continue;
    }
    std::unique_ptr<BackendHold> hold;
    try {
      hold = contender.place->hold(loss(request.name));
    } catch (const QueueChanged&) {
      wakes.again(*woken);  // look again
      continue;
    }
    admitted.push_back(*woken);
    hold->release();
  }
  return admitted;
}

std::vector<std::size_t> in_order(std::size_t count) {
  std::vector<std::size_t> order(count);
  for (std::size_t i = 0; i < count; ++i) order[i] = i;
  return order;
}

TEST(ZookeeperArm, AThousandArmedWaitersAddFewThreadsAndEachReleaseWakesOnlyTheNext) {
  constexpr std::size_t kWaiters = 1000;
  auto backend = connect();
  const auto request = lock_request(unique_name("arm"));
  auto held = hold_at_once(*backend, request);
  const auto threads_before = thread_count();
  const long rss_before = rss_kib();
  Wakes wakes(kWaiters);
  auto contenders = arm_waiters(*backend, request, kWaiters, wakes);
  const auto threads_added = thread_count() - threads_before;
  const double kib_per_waiter = static_cast<double>(rss_kib() - rss_before) / kWaiters;
  std::printf("%zu armed waiters: %zu threads added, %.2f KiB per waiter\n", kWaiters, threads_added, kib_per_waiter);
  // The default arm() (a thread per waiter) adds a thousand.
  EXPECT_LE(threads_added, 2u);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  EXPECT_LE(kib_per_waiter, 4.0);  // the sanitizers' shadow memory and redzones count in RSS
#endif

  // Really waiting: the first of them still waits behind the holder.
  EXPECT_EQ(next_queue_step(request, contenders[0].place->look(later()), true).action, QueueStep::Action::wait);
  EXPECT_EQ(wakes.total(), 0u);

  held->release();
  EXPECT_EQ(admit_in_turn(request, contenders, wakes), in_order(kWaiters));
  // One release, one wake: each waiter was woken once (by its predecessor's release) and never
  // on the thread that armed it.
  EXPECT_EQ(wakes.total(), kWaiters);
  EXPECT_FALSE(wakes.ran_on_test_thread());
}

TEST(ZookeeperArm, ASemaphoresArmedWaitersAreAdmittedInTurn) {
  constexpr std::size_t kWaiters = 40;
  auto backend = connect();
  const auto request = lease_request(unique_name("arm-sem"), 2);
  auto first = hold_at_once(*backend, request);
  auto second = hold_at_once(*backend, request);
  const auto threads_before = thread_count();
  Wakes wakes(kWaiters);
  auto contenders = arm_waiters(*backend, request, kWaiters, wakes);
  EXPECT_LE(thread_count() - threads_before, 2u);
  EXPECT_EQ(wakes.total(), 0u);

  first->release();  // the head of the line (watching the leases) is let in
  EXPECT_EQ(admit_in_turn(request, contenders, wakes), in_order(kWaiters));
  second->release();
  EXPECT_FALSE(wakes.ran_on_test_thread());
}

TEST(ZookeeperArm, ADisarmedWakeNeverRunsAndAWakeDueAtOnceComesFromAnotherThread) {
  auto backend = connect();
  const auto request = lock_request(unique_name("arm-disarm"));
  auto held = hold_at_once(*backend, request);
  Wakes wakes(2);
  auto contenders = arm_waiters(*backend, request, 2, wakes);
  // The holder's release would wake the first: disarmed before it, it never runs.
  contenders[0].arm.reset();
  held->release();
  // Still armed until it has looked: the first waiter is admitted by its look alone.
  const auto step = next_queue_step(request, contenders[0].place->look(later()), true);
  ASSERT_EQ(step.action, QueueStep::Action::hold);
  // Armed for a holder that is gone already (the verdict of a look before its release): the
  // wake runs at once, not inside arm() and not on this thread.
  auto gone = contenders[0].place->hold(loss(request.name));
  contenders[1].arm.reset();
  const auto behind = next_queue_step(request, contenders[1].place->look(later()), true);
  ASSERT_EQ(behind.action, QueueStep::Action::wait);
  gone->release();
  contenders[1].arm = contenders[1].place->arm(behind.verdict, later(), wakes.wake_for(1));
  ASSERT_EQ(wakes.next(), std::optional<std::size_t>(1));
  EXPECT_EQ(wakes.count(0), 0);
  EXPECT_FALSE(wakes.ran_on_test_thread());
  contenders[1].place->leave();
}

TEST(ZookeeperArm, APermitCountersArmedWaitersTakeInTurn) {
  constexpr std::size_t kWaiters = 30;
  auto backend = connect();
  const auto name = unique_name("arm-counter");
  ASSERT_TRUE(backend->counter_try_set(name, 0));
  Wakes wakes(kWaiters);
  std::vector<std::unique_ptr<CounterLine>> lines(kWaiters);
  std::vector<std::unique_ptr<WakeArm>> arms(kWaiters);
  // Each joins the line, looks from its place and arms (the value for the first, its
  // predecessor for the others).
  const auto look_and_arm = [&](std::size_t i) {
    const auto standing = lines[i]->look(false, later());
    const auto wait = evaluate_counter_line(standing.ahead, standing.value, 1);
    if (wait == CounterWait::nothing) return lines[i]->take(standing, later());
    arms[i] = lines[i]->arm(wait, later(), wakes.wake_for(i));
    return false;
  };
  const auto threads_before = thread_count();
  for (std::size_t i = 0; i < kWaiters; ++i) {
    lines[i] = backend->counter_line(name, 1, {});
    lines[i]->join(later());
    ASSERT_FALSE(look_and_arm(i));
  }
  EXPECT_LE(thread_count() - threads_before, 2u);
  EXPECT_EQ(wakes.total(), 0u);

  std::vector<std::size_t> taken;
  for (std::size_t added = 0; added < kWaiters; ++added) {
    backend->counter_add(name, 1);
    for (;;) {  // woken until one takes the permit
      const auto woken = wakes.next();
      ASSERT_TRUE(woken) << "no wake within a minute; taken " << taken.size();
      arms[*woken].reset();
      if (!look_and_arm(*woken)) continue;
      taken.push_back(*woken);
      break;
    }
  }
  EXPECT_EQ(taken, in_order(kWaiters));
  EXPECT_EQ(backend->counter_get(name), std::optional<std::int64_t>(0));
  EXPECT_FALSE(wakes.ran_on_test_thread());
}

// One waiter armed through a test proxy behind a holder connected directly.
struct ProxiedWaiter {
  ProxiedWaiter(const std::string& leaf, std::chrono::milliseconds session_timeout)
      : backend(connect(proxy.url_through(url), with_ttl(session_timeout))), request(lock_request(unique_name(leaf))),
        held(hold_at_once(*holders, request)), contenders(arm_waiters(*backend, request, 1, wakes)) {
    // The server answers a session's calls in order: once this look is answered, so is the call
    // that set the watch (a call lost with the connection would run the wake).
    EXPECT_EQ(step(), QueueStep::Action::wait);
  }
  QueueStep::Action step() { return next_queue_step(request, contenders[0].place->look(later()), true).action; }

  std::string url = server_url();
  TcpProxy proxy{url};
  OwnedBackend backend;
  OwnedBackend holders = connect();
  QueueRequest request;
  std::unique_ptr<BackendHold> held;
  Wakes wakes{1};
  std::vector<Contender> contenders;
};

// A lost connection wakes no armed waiter, and loses none: the C client sets the confirmed
// watch again on the next connection, and the server fires it for a deletion it missed.
TEST(ZookeeperArm, AnArmedWaiterIsWokenByAReleaseMadeWhileItsConnectionWasDown) {
  ProxiedWaiter waiter("arm-reconnect", 20s);
  waiter.proxy.blackhole();  // no reconnect gets through until forward()
  waiter.proxy.reset();      // the connection (and the server's watches on it) is gone; the session lives
  waiter.held->release();    // unseen by the waiter's connection
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(waiter.wakes.total(), 0u);  // the lost connection woke nobody
  waiter.proxy.forward();
  ASSERT_EQ(waiter.wakes.next(), std::optional<std::size_t>(0));
  EXPECT_EQ(waiter.step(), QueueStep::Action::hold);
  waiter.contenders[0].arm.reset();
  waiter.contenders[0].place->leave();
}

// The session's expiry (its entry gone with it) runs every armed wake: the next look joins again.
TEST(ZookeeperArm, AnArmedWaiterIsWokenWhenItsSessionExpires) {
  ProxiedWaiter waiter("arm-expiry", 1s);
  waiter.proxy.blackhole();
  std::this_thread::sleep_for(2500ms);  // the server expires the 1 s session meanwhile
  waiter.proxy.forward();
  ASSERT_EQ(waiter.wakes.next(), std::optional<std::size_t>(0));
  waiter.contenders[0].arm.reset();
  EXPECT_THROW(waiter.contenders[0].place->look(later()), QueueEntryGone);
  waiter.held->release();
}

}  // namespace
