// SPDX-License-Identifier: Apache-2.0
// The core's one queue algorithm (queue_loop.cpp) over an in-memory storage: the rules every
// backend now shares (try-once, deadline and stop leave the queue, errors leave, a vanished
// entry joins again at the back, mode checks after the join, the counter's line) and, with
// threads, that the loop never admits two exclusive holders. The storage is a plain queue in
// this process, not a model of any server: what is tested is the loop's part.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "core/race_pacer.hpp"
#include "turnstile/error.hpp"
#include "unit/memory_queue.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::SteadyClock;
using namespace turnstile::detail;
using turnstile::testing::MemoryQueue;

QueueRequest lock_request(EntryKind kind = EntryKind::exclusive) { return {.name = "n", .kind = kind}; }

std::shared_ptr<LossSignal> no_signal() { return nullptr; }

TEST(QueueLoop, AFreeQueueAdmitsAtTheJoinWithoutWaiting) {
  MemoryQueue queue;
  auto hold = acquire_in_queue(queue, lock_request(), std::nullopt, no_signal());
  ASSERT_NE(hold, nullptr);
  EXPECT_EQ(queue.joins, 1);
  EXPECT_EQ(queue.waits, 0);
  EXPECT_EQ(queue.leaves, 0);
  EXPECT_EQ(queue.size(), 1u);
  hold->release();
  EXPECT_EQ(queue.size(), 0u);
}

TEST(QueueLoop, AHoldThatFindsTheQueueChangedLooksAgainKeepingItsEntry) {
  MemoryQueue queue;
  queue.hold_finds_change = 2;
  auto hold = acquire_in_queue(queue, lock_request(), SteadyClock::now(), no_signal());
  ASSERT_NE(hold, nullptr) << "a try-once gave up on a changed queue although it was still admitted";
  EXPECT_EQ(queue.joins, 1) << "it joined again instead of looking again";
  EXPECT_EQ(queue.holds, 3);
  EXPECT_EQ(queue.looks, 2);
  EXPECT_EQ(queue.leaves, 0);
  EXPECT_EQ(queue.size(), 1u);
}

// A race lost again and again (a busy or flapping server) is retried with pauses, never in a hot
// loop, and not past the caller's deadline; a try-once gets a few quick retries. The old loop
// retried at once without end: 1,000 races meant 1,001 holds, then an admission past the deadline.
TEST(QueueLoop, ATryOnceThatKeepsLosingItsRaceEndsNotAdmittedAndLeaves) {
  MemoryQueue queue;
  queue.hold_finds_change = 1000;
  EXPECT_EQ(acquire_in_queue(queue, lock_request(), SteadyClock::now(), no_signal()), nullptr);
  EXPECT_LE(queue.holds, RacePacer::kTryOnceRetries + 1);
  EXPECT_EQ(queue.leaves, 1);
  EXPECT_EQ(queue.size(), 0u);
}

TEST(QueueLoop, ATimedAcquireThatKeepsLosingItsRacePausesAndEndsByItsDeadline) {
  MemoryQueue queue;
  queue.hold_finds_change = 1'000'000;
  const auto started = SteadyClock::now();
  EXPECT_EQ(acquire_in_queue(queue, lock_request(), started + 400ms, no_signal()), nullptr);
  EXPECT_LT(SteadyClock::now() - started, 3s);
  // Pauses 0, 10, 20, 40, 80, 160 ms... fill 400 ms in about 7 retries (+ the quick ones at the end).
  EXPECT_LE(queue.holds, 7 + RacePacer::kTryOnceRetries + 1) << "retried without pausing";
  EXPECT_EQ(queue.size(), 0u);
}

TEST(QueueLoop, ATryOnceThatIsNotAdmittedLeavesWithoutWaiting) {
  MemoryQueue queue;
  queue.add(EntryKind::exclusive);
  EXPECT_EQ(acquire_in_queue(queue, lock_request(), SteadyClock::now(), no_signal()), nullptr);
  EXPECT_EQ(queue.waits, 0);
  EXPECT_EQ(queue.leaves, 1);
  EXPECT_EQ(queue.size(), 1u) << "the try-once entry stayed in the queue";
}

TEST(QueueLoop, ADeadlineWhileWaitingLeavesTheQueue) {
  MemoryQueue queue;
  queue.add(EntryKind::exclusive);
  EXPECT_EQ(acquire_in_queue(queue, lock_request(), SteadyClock::now() + 200ms, no_signal()), nullptr);
  EXPECT_GE(queue.waits, 1) << "it never waited";
  EXPECT_EQ(queue.leaves, 1);
  EXPECT_EQ(queue.size(), 1u);
}

TEST(QueueLoop, AStopWhileWaitingLeavesTheQueue) {
  MemoryQueue queue;
  queue.add(EntryKind::exclusive);
  std::stop_source stop;
  auto request = lock_request();
  request.stop = stop.get_token();
  auto waiter =
      std::async(std::launch::async, [&] { return acquire_in_queue(queue, request, std::nullopt, no_signal()); });
  while (queue.sleeping() == 0) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(queue.size(), 2u);
  stop.request_stop();
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready) << "the stop did not end the wait";
  EXPECT_EQ(waiter.get(), nullptr);
  EXPECT_EQ(queue.size(), 1u) << "the stopped waiter stayed in the queue";
}

TEST(QueueLoop, AWaiterIsAdmittedWhenTheEntryAheadLeaves) {
  MemoryQueue queue;
  const auto holder = queue.add(EntryKind::exclusive);
  auto waiter = std::async(std::launch::async,
                           [&] { return acquire_in_queue(queue, lock_request(), std::nullopt, no_signal()); });
  while (queue.sleeping() == 0) std::this_thread::sleep_for(1ms);
  EXPECT_NE(waiter.wait_for(50ms), std::future_status::ready) << "admitted while the holder held";
  queue.remove(holder);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_NE(waiter.get(), nullptr);
}

// A waiter behind `holder` whose entry vanishes once (as `queue` is set up to make it): it joins
// again, waits again (never admitted meanwhile), and is admitted when the holder leaves.
void expect_rejoin_then_admission(MemoryQueue& queue, std::uint64_t holder) {
  auto waiter = std::async(std::launch::async,
                           [&] { return acquire_in_queue(queue, lock_request(), std::nullopt, no_signal()); });
  while (queue.joins < 2 || queue.sleeping() == 0) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(queue.size(), 2u);
  queue.remove(holder);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_NE(waiter.get(), nullptr);
}

TEST(QueueLoop, AnEntryThatVanishedWhileWaitingJoinsAgainAtTheBack) {
  MemoryQueue queue;
  const auto holder = queue.add(EntryKind::exclusive);
  queue.vanish_on_look = 1;  // it waits, looks, finds its entry gone
  expect_rejoin_then_admission(queue, holder);
}

// A backend's wait may find our entry gone (a session that ended while we slept): nothing was
// held, so the loop joins again, as after a look that found it gone.
TEST(QueueLoop, AnEntryThatVanishedDuringTheWaitJoinsAgainAtTheBack) {
  MemoryQueue queue;
  const auto holder = queue.add(EntryKind::exclusive);
  queue.vanish_on_wait = 1;
  expect_rejoin_then_admission(queue, holder);
}

TEST(QueueLoop, AnAdmissionThatExcludedNobodyJoinsAgain) {
  MemoryQueue queue;
  queue.hold_excludes_nobody = 1;
  auto hold = acquire_in_queue(queue, lock_request(), std::nullopt, no_signal());
  ASSERT_NE(hold, nullptr);
  EXPECT_EQ(queue.joins, 2);
  EXPECT_EQ(queue.size(), 1u);
}

TEST(QueueLoop, AnErrorWhileWaitingLeavesTheQueueAndIsReported) {
  MemoryQueue queue;
  queue.add(EntryKind::exclusive);
  queue.fail_on_look = 1;
  EXPECT_THROW(acquire_in_queue(queue, lock_request(), SteadyClock::now() + 5s, no_signal()),
               turnstile::BackendUnavailable);
  EXPECT_GE(queue.waits, 1);
  EXPECT_EQ(queue.leaves, 1);
  EXPECT_EQ(queue.size(), 1u) << "the failed waiter stayed in the queue";
}

TEST(QueueLoop, AKindOrLimitMismatchFoundAfterTheJoinLeavesTheQueue) {
  MemoryQueue queue;
  queue.foreign_mode = QueueMode::semaphore;
  queue.foreign_limit = 3;
  EXPECT_THROW(acquire_in_queue(queue, lock_request(), std::nullopt, no_signal()), turnstile::KindMismatch);
  auto lease = lock_request(EntryKind::lease);
  lease.limit = 4;
  EXPECT_THROW(acquire_in_queue(queue, lease, std::nullopt, no_signal()), turnstile::LimitMismatch);
  EXPECT_EQ(queue.size(), 0u);
  EXPECT_EQ(queue.leaves, 2);
}

TEST(QueueLoop, AStorageVerdictIsTakenAsIs) {
  // A storage that decides atomically (the embedded backend, Redis) reports its verdict.
  struct Decided : MemoryQueue {
    std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, turnstile::Deadline deadline,
                                     Standing& first) override {
      auto place = MemoryQueue::join(request, try_once, deadline, first);
      first.decided = Verdict{WaitFor::leave, 0};  // "wait", whatever the entries say
      return place;
    }
  } queue;
  EXPECT_EQ(acquire_in_queue(queue, lock_request(), SteadyClock::now(), no_signal()), nullptr);
}

TEST(QueueLoop, ManyThreadsOnOneMutexNeverHoldTogether) {
  MemoryQueue queue;
  std::atomic<int> inside{0}, most{0}, done{0};
  std::vector<std::jthread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto hold = acquire_in_queue(queue, lock_request(), std::nullopt, no_signal());
        const int now = ++inside;
        most = std::max(most.load(), now);
        --inside;
        hold->release();
        // Wakes the waiter behind (the memory storage's leave notifies, release does via remove).
      }
      ++done;
    });
  }
  threads.clear();
  EXPECT_EQ(done, 8);
  EXPECT_EQ(most, 1) << "two holders at once";
  EXPECT_EQ(queue.size(), 0u);
}

TEST(CounterLoop, TheFirstInLineTakesOnceTheValueHasThePermits) {
  MemoryQueue queue;
  queue.value = 1;
  auto waiter = std::async(std::launch::async, [&] { return acquire_from_counter(queue, "n", 3, std::nullopt, {}); });
  while (queue.sleeping() == 0) std::this_thread::sleep_for(1ms);
  EXPECT_NE(waiter.wait_for(50ms), std::future_status::ready) << "took 3 of 1";
  queue.set_value(3);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
  EXPECT_EQ(queue.value, 0);
}

TEST(CounterLoop, ATryOnceDoesNotJoinTheLine) {
  MemoryQueue queue;
  queue.value = 1;
  EXPECT_FALSE(acquire_from_counter(queue, "n", 2, SteadyClock::now(), {}));
  EXPECT_EQ(queue.waits, 0);
  EXPECT_TRUE(acquire_from_counter(queue, "n", 1, SteadyClock::now(), {}));
  EXPECT_EQ(queue.value, 0);
}

TEST(CounterLoop, ATakeThatKeepsLosingItsRacePausesAndEndsByItsDeadline) {
  MemoryQueue queue;
  queue.value = 1;
  queue.take_finds_change = 1'000'000;
  EXPECT_FALSE(acquire_from_counter(queue, "n", 1, SteadyClock::now() + 400ms, {}));
  EXPECT_LE(queue.takes, 7 + RacePacer::kTryOnceRetries + 1) << "retried without pausing";
  EXPECT_EQ(queue.value, 1);
  queue.take_finds_change = 1'000'000;
  EXPECT_FALSE(acquire_from_counter(queue, "n", 1, SteadyClock::now(), {}));
  EXPECT_EQ(queue.value, 1);
}

TEST(CounterLoop, AStopWhileWaitingLeavesTheLine) {
  MemoryQueue queue;
  std::stop_source stop;
  auto waiter = std::async(std::launch::async,
                           [&] { return acquire_from_counter(queue, "n", 1, std::nullopt, stop.get_token()); });
  while (queue.sleeping() == 0) std::this_thread::sleep_for(1ms);
  stop.request_stop();
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_FALSE(waiter.get());
  EXPECT_GE(queue.leaves, 1);
  // Nobody is left in line: a try-once finds the permits once they are there.
  queue.value = 1;
  EXPECT_TRUE(acquire_from_counter(queue, "n", 1, SteadyClock::now(), {}));
}

TEST(CounterLoop, ATakeWhoseReplyWasLostCountsAsTaken) {
  MemoryQueue queue;
  queue.value = 2;
  queue.lose_take_reply = 1;
  EXPECT_TRUE(acquire_from_counter(queue, "n", 2, std::nullopt, {}));
  EXPECT_EQ(queue.value, 0);
}

TEST(CounterLine, FirstInLineWaitsForTheValueOthersForTheOneAhead) {
  EXPECT_EQ(evaluate_counter_line(0, 5, 5), CounterWait::nothing);
  EXPECT_EQ(evaluate_counter_line(0, 4, 5), CounterWait::value);
  EXPECT_EQ(evaluate_counter_line(0, std::nullopt, 1), CounterWait::value);
  EXPECT_EQ(evaluate_counter_line(1, 100, 1), CounterWait::predecessor) << "a waiter ahead is served first";
  EXPECT_EQ(evaluate_counter_line(3, std::nullopt, 1), CounterWait::predecessor);
}

}  // namespace
