// SPDX-License-Identifier: Apache-2.0
// Issue 26: the Redis backend waits without a thread per waiter. QueuePlace::arm and
// CounterLine::arm are driven here by hand, as the core's async driver does (join, look,
// next_queue_step, arm, wait for the wake, look again): 1,000 armed waiters on one name add no
// thread to the process (the default arm() adds one each), and releases admit them one at a
// time in queue order, each release waking exactly the waiter it admits.
#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <vector>

#include "core/backend.hpp"
#include "core/backend_loader.hpp"
#include "core/queue_store.hpp"
#include "core/url.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using namespace server_tests;
using namespace turnstile::detail;

// The same test runs against a single server (1,000 waiters), and with fewer against Sentinel
// and Cluster (the suite named after each: test names must differ).
#ifndef TURNSTILE_ARM_SUITE
#define TURNSTILE_ARM_SUITE RedisArm
#define TURNSTILE_ARM_WAITERS 1000
#endif
constexpr std::size_t kWaiters = TURNSTILE_ARM_WAITERS;

std::size_t thread_count() {
  std::size_t threads = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task")) ++threads;
  return threads;
}

// Which waiters' wakes ran, in the order they ran.
class WakeLog {
 public:
  Wake wake(std::size_t waiter) {
    return [this, waiter] {
      std::lock_guard lock(mutex_);
      order_.push_back(waiter);
      changed_.notify_all();
    };
  }
  // The waiter whose wake ran `nth` (from 0), waiting for it up to `timeout`.
  std::optional<std::size_t> nth(std::size_t nth, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return order_.size() > nth; })) return std::nullopt;
    return order_[nth];
  }
  std::size_t count() {
    std::lock_guard lock(mutex_);
    return order_.size();
  }
  // The waiters woken, in order (for a failure's message).
  std::string woken() {
    std::lock_guard lock(mutex_);
    std::string text;
    for (const auto waiter : order_) text += " " + std::to_string(waiter);
    return text;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::size_t> order_;
};

class TURNSTILE_ARM_SUITE : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto url = read_first_line(TURNSTILE_REDIS_URL_FILE);
    ASSERT_FALSE(url.empty()) << "no URL in " << TURNSTILE_REDIS_URL_FILE;
    backend_ = connect_backend(parse_url(url), turnstile::ClientOptions{}).backend;
    threads_at_start_ = thread_count();  // the client's own: its watchdog and its subscriber
  }
  std::shared_ptr<LossSignal> loss(const std::string& name) {
    return std::make_shared<LossSignal>(name, std::make_shared<const LossSignal::Callbacks>());
  }
  // Joins `request`'s queue (places_.back()), which must not admit it: the wait it calls for.
  Verdict join_waiting(const QueueRequest& request, std::size_t waiter) {
    Standing standing;
    places_.push_back(backend_->join(request, false, deadline_, standing));
    EXPECT_TRUE(places_.back());
    if (!places_.back()) return {};
    const auto step = next_queue_step(request, standing, true);
    EXPECT_EQ(step.action, QueueStep::Action::wait) << "waiter " << waiter << " admitted past the holder";
    return step.verdict;
  }
  // Joins and arms the wait its first look calls for.
  void join_and_arm(const QueueRequest& request, std::size_t waiter) {
    const auto verdict = join_waiting(request, waiter);
    ASSERT_FALSE(HasFailure());
    arms_.push_back(places_.back()->arm(verdict, deadline_, wakes_.wake(waiter)));
  }
  void report_threads(std::size_t waiters) {
    const auto threads = thread_count();
    std::cout << waiters << " armed waiters: " << threads << " threads in the process, " << threads_at_start_
              << " before the first\n";
    EXPECT_LE(threads, threads_at_start_ + 2) << "armed waiters cost threads";
  }

  OwnedBackend backend_;  // with the telemetry it reports to
  std::size_t threads_at_start_ = 0;
  turnstile::Deadline deadline_ = deadline_after(120s);
  WakeLog wakes_;
  std::vector<std::unique_ptr<QueuePlace>> places_;
  std::vector<std::unique_ptr<WakeArm>> arms_;
};

TEST_F(TURNSTILE_ARM_SUITE, ArmedQueueWaitersCostNoThreadAndAreWokenOneByOne) {
  // A Mutex's 1,000 waiters, and a Semaphore's fewer (each script walks the queue: the joins
  // and releases of 1,000 take seconds on a loaded machine).
  for (const auto& [kind, waiters] :
       {std::pair{EntryKind::exclusive, kWaiters}, std::pair{EntryKind::lease, kWaiters / 5}}) {
    SCOPED_TRACE(to_string(kind));
    const bool lease = kind == EntryKind::lease;  // a Semaphore of one permit
    const QueueRequest request{.name = unique_name("arm"),
                               .kind = kind,
                               .permits = 1,
                               .limit = lease ? 1 : 0,
                               .primitive = lease ? Primitive::semaphore : Primitive::mutex};
    Standing standing;
    auto first = backend_->join(request, false, deadline_, standing);
    ASSERT_TRUE(first);
    ASSERT_EQ(next_queue_step(request, standing, true).action, QueueStep::Action::hold);
    auto holder = first->hold(loss(request.name));
    first.reset();
    // The first waiter subscribes, blocking (wait() returns once the server confirmed the
    // subscription: a message before it may have been missed, so it looks), then arms. The
    // subscriber's own events (connecting, confirming) are behind it: from now on only a release
    // (or a real reconnect) wakes anyone. Every later waiter joins a channel listened to already.
    places_.clear();
    arms_.clear();
    const auto verdict = join_waiting(request, 0);
    ASSERT_FALSE(HasFailure());
    places_[0]->wait(verdict, deadline_after(5s), {});
    ASSERT_EQ(next_queue_step(request, places_[0]->look(deadline_), true).action, QueueStep::Action::wait);
    const auto woken_before = wakes_.count();
    arms_.push_back(places_[0]->arm(verdict, deadline_, wakes_.wake(0)));
    for (std::size_t waiter = 1; waiter < waiters; ++waiter) {
      join_and_arm(request, waiter);
      ASSERT_FALSE(HasFatalFailure());
    }
    report_threads(waiters);
    // Each release admits the next waiter, and wakes it alone.
    for (std::size_t next = 0; next < waiters; ++next) {
      ASSERT_EQ(wakes_.count(), woken_before + next) << "a waiter was woken before its turn:" << wakes_.woken();
      holder->release();
      ASSERT_EQ(wakes_.nth(woken_before + next, 10s), next) << "the release woke another waiter first";
      arms_[next].reset();
      const auto step = next_queue_step(request, places_[next]->look(deadline_), true);
      ASSERT_EQ(step.action, QueueStep::Action::hold) << "waiter " << next << " woken but not admitted";
      holder = places_[next]->hold(loss(request.name));
      places_[next].reset();
    }
    holder->release();
    EXPECT_EQ(wakes_.count(), woken_before + waiters) << "a release woke more than one waiter";
  }
}

// A PermitCounter's line: each permit added wakes the first in line, whose look takes it. The
// watchdog's rounds also wake every waiter now and then (their places live by their looks):
// those look, find themselves still waiting, and arm again.
TEST_F(TURNSTILE_ARM_SUITE, ArmedCounterLineTakesPermitsInLineOrder) {
  constexpr std::size_t kLine = kWaiters * 3 / 10;
  const auto name = unique_name("arm-counter");
  ASSERT_TRUE(backend_->counter_try_set(name, 0));
  std::vector<std::unique_ptr<CounterLine>> lines;
  std::vector<std::unique_ptr<WakeArm>> arms;
  for (std::size_t waiter = 0; waiter < kLine; ++waiter) {
    lines.push_back(backend_->counter_line(name, 1, {}));
    const auto standing = lines.back()->look(false, deadline_);
    ASSERT_FALSE(standing.taken);
    ASSERT_TRUE(standing.in_line);
    const auto wait = evaluate_counter_line(standing.ahead, standing.value, 1);
    ASSERT_NE(wait, CounterWait::nothing);
    arms.push_back(lines.back()->arm(wait, deadline_, wakes_.wake(waiter)));
  }
  report_threads(kLine);
  std::size_t seen = 0;  // wakes handled
  for (std::size_t next = 0; next < kLine; ++next) {
    ASSERT_EQ(backend_->counter_add(name, 1), 1);
    for (bool taken = false; !taken;) {
      const auto woken = wakes_.nth(seen++, 10s);
      ASSERT_TRUE(woken) << "a permit added woke nobody";
      auto& line = *lines[*woken];
      arms[*woken].reset();
      const auto standing = line.look(false, deadline_);
      if (standing.taken) {
        ASSERT_EQ(*woken, next) << "a permit was taken out of line order";
        lines[*woken].reset();  // the acquire is over (as the core's ends)
        taken = true;
        continue;
      }
      arms[*woken] = line.arm(evaluate_counter_line(standing.ahead, standing.value, 1), deadline_, wakes_.wake(*woken));
    }
  }
  std::cout << kLine << " permits added: " << seen << " wakes\n";
  EXPECT_EQ(backend_->counter_get(name), 0);
}

}  // namespace
