// SPDX-License-Identifier: Apache-2.0
// Mutex and RecursiveMutex: exclusion across threads, clients and processes, FIFO order,
// reentrancy rules, standard guards, timeouts, misuse, and holders killed with SIGKILL.
#include <signal.h>

#include <atomic>
#include <future>
#include <mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Client;

// A holder's loop body: lock, record [start, end] inside the hold, unlock.
template <class M>
void hold_once(M& mutex, th::HoldRecorder& recorder, std::atomic<int>& unprotected) {
  Stopwatch watch;
  std::lock_guard guard(mutex);
  watch.held();
  const auto token = mutex.fencing_token();
  // A read-modify-write that only exclusion keeps whole. Relaxed atomics, so ThreadSanitizer
  // (which cannot see the cross-process locks turnstile synchronises with) does not object.
  const int seen = unprotected.load(std::memory_order_relaxed);
  std::this_thread::yield();
  unprotected.store(seen + 1, std::memory_order_relaxed);
  recorder.record(watch.finish(mutex.name(), "exclusive", 1, token));
}

}  // namespace

TEST_P(Conformance, MutexExcludesThreadsSharingOneHandle) {
  auto mutex = client().mutex(name("m"));
  th::HoldRecorder recorder;
  std::atomic<int> unprotected{0};
  run_threads(6, [&](int) {
    for (int i = 0; i < 15; ++i) hold_once(mutex, recorder, unprotected);
  });
  EXPECT_EQ(unprotected, 90);
  expect_sound(recorder.records());
  EXPECT_EQ(th::max_concurrency(recorder.records()), 1);
}

TEST_P(Conformance, MutexExcludesThreadsWithTheirOwnClients) {
  th::HoldRecorder recorder;
  std::atomic<int> unprotected{0};
  run_threads(6, [&](int) {
    auto own = connect();
    auto mutex = own.mutex(name("m"));
    for (int i = 0; i < 15; ++i) hold_once(mutex, recorder, unprotected);
  });
  EXPECT_EQ(unprotected, 90);
  expect_sound(recorder.records());
}

TEST_P(Conformance, MutexExcludesProcesses) {
  const auto history = scratch_path("history");
  const auto lock_name = name("m");
  std::vector<Child> children;
  for (int c = 0; c < 4; ++c) {
    children.push_back(Child::spawn([&] {
      auto own = Client::connect(url());
      auto mutex = own.mutex(lock_name);
      th::FileHoldRecorder recorder(history);
      for (int i = 0; i < 15; ++i) {
        Stopwatch watch;
        std::lock_guard guard(mutex);
        watch.held();
        const auto token = mutex.fencing_token();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        recorder.record(watch.finish(lock_name, "exclusive", 1, token));
      }
      return 0;
    }));
  }
  {
    // The parent contends too, from two threads of its own client.
    auto mutex = client().mutex(lock_name);
    th::FileHoldRecorder recorder(history);
    run_threads(2, [&](int) {
      for (int i = 0; i < 10; ++i) {
        Stopwatch watch;
        std::lock_guard guard(mutex);
        watch.held();
        const auto token = mutex.fencing_token();
        recorder.record(watch.finish(lock_name, "exclusive", 1, token));
      }
    });
  }
  for (auto& child : children) EXPECT_EQ(child.wait(20s), 0);
  const auto records = th::load_history(history);
  EXPECT_EQ(records.size(), 4u * 15 + 2 * 10);
  expect_sound(records);
}

TEST_P(Conformance, MutexServesWaitersInArrivalOrder) {
  const auto lock_name = name("fifo");
  std::mutex order_mutex;
  std::vector<int> order;
  std::vector<std::thread> threads;
  OnExit join([&] {
    for (auto& t : threads) t.join();
  });
  auto holder_client = connect();
  auto holder = holder_client.mutex(lock_name);
  holder.lock();
  OnExit release_holder([&] { holder.unlock(); });  // runs before the join on early exit
  for (int i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      auto own = connect();
      auto mutex = own.mutex(lock_name);
      if (!mutex.try_lock_for(15s)) return;
      {
        std::lock_guard lock(order_mutex);
        order.push_back(i);
      }
      mutex.unlock();
    });
    ASSERT_TRUE(wait_for_waiters(lock_name, static_cast<std::size_t>(i) + 1))
        << "contender " << i << " never showed up as a waiter";
  }
  const auto inspection = client().inspect(lock_name);
  ASSERT_EQ(inspection.holders.size(), 1u);
  for (std::size_t i = 1; i < inspection.waiters.size(); ++i) {
    EXPECT_LT(inspection.waiters[i - 1].fencing_token, inspection.waiters[i].fencing_token);
  }
  release_holder.dismiss();
  holder.unlock();
  for (auto& t : threads) t.join();
  threads.clear();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST_P(Conformance, MutexServesProcessesInArrivalOrder) {
  const auto lock_name = name("fifo");
  const auto history = scratch_path("history");
  std::vector<Child> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(Child::spawn_gated([&, i] {
      auto own = Client::connect(url());
      auto mutex = own.mutex(lock_name);
      if (!mutex.try_lock_for(15s)) return 1;
      th::FileHoldRecorder recorder(history);
      // The arrival index rides in the record's length: start order must match it.
      const auto now = th::monotonic_ns();
      recorder.record(th::HoldRecord{lock_name, "exclusive", 1, mutex.fencing_token(), now, now + i});
      mutex.unlock();
      return 0;
    }));
  }
  auto holder = client().mutex(lock_name);
  holder.lock();
  for (int i = 0; i < 4; ++i) {
    children[static_cast<std::size_t>(i)].start();
    if (!wait_for_waiters(lock_name, static_cast<std::size_t>(i) + 1)) {
      holder.unlock();
      FAIL() << "child " << i << " never showed up as a waiter";
    }
  }
  holder.unlock();
  for (auto& child : children) EXPECT_EQ(child.wait(), 0);
  auto records = th::load_history(history);
  ASSERT_EQ(records.size(), 4u);
  std::sort(records.begin(), records.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
  for (std::size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i].end_ns - records[i].start_ns, static_cast<std::int64_t>(i)) << "holder #" << i;
    if (i > 0) {
      EXPECT_GT(records[i].token, records[i - 1].token);
    }
  }
}

TEST_P(Conformance, MutexIsNotReentrant) {
  auto mutex = client().mutex(name("m"));
  mutex.lock();
  EXPECT_TRUE(mutex.owns_lock());
  const auto token = mutex.fencing_token();
  EXPECT_THROW(mutex.lock(), turnstile::WouldDeadlock);
  // Issue 24: a try cannot deadlock; the name is busy (held by this thread), as std::mutex users
  // expect of `if (m.try_lock())`. Waiting for it (lock, the timed tries) would deadlock.
  EXPECT_FALSE(mutex.try_lock());
  EXPECT_FALSE(mutex.try_lock_for(0ms));
  EXPECT_THROW(mutex.try_lock_for(50ms), turnstile::WouldDeadlock);
  EXPECT_THROW(mutex.try_lock_until(Clock::now() + 50ms), turnstile::WouldDeadlock);
  // Another handle of the same name in the same client is the same lock.
  auto again = client().mutex(name("m"));
  EXPECT_THROW(again.lock(), turnstile::WouldDeadlock);
  EXPECT_FALSE(again.try_lock());
  // Still held, once, with the same token.
  EXPECT_TRUE(mutex.owns_lock());
  EXPECT_EQ(mutex.fencing_token(), token);
  auto other = connect();
  auto contender = other.mutex(name("m"));
  EXPECT_FALSE(contender.try_lock());
  mutex.unlock();
  EXPECT_FALSE(mutex.owns_lock());
  EXPECT_TRUE(contender.try_lock());
  contender.unlock();
}

TEST_P(Conformance, MutexHeldByOneThreadIsNotHeldByAnother) {
  auto mutex = client().mutex(name("m"));
  mutex.lock();
  std::async(std::launch::async, [&] {
    EXPECT_FALSE(mutex.owns_lock());
    EXPECT_FALSE(mutex.try_lock());  // another thread of the same client is another contender
    EXPECT_THROW(mutex.fencing_token(), turnstile::NotHeld);
  }).get();
  mutex.unlock();
}

TEST_P(Conformance, RecursiveMutexCountsItsHolds) {
  auto mutex = client().recursive_mutex(name("r"));
  auto other = connect();
  auto contender = other.recursive_mutex(name("r"));
  mutex.lock();
  const auto token = mutex.fencing_token();
  EXPECT_TRUE(mutex.try_lock());
  EXPECT_TRUE(mutex.try_lock_for(10ms));
  EXPECT_EQ(mutex.fencing_token(), token);
  EXPECT_EQ(holder_count(name("r")), 1u);
  mutex.unlock();
  mutex.unlock();
  EXPECT_TRUE(mutex.owns_lock());
  EXPECT_FALSE(contender.try_lock());
  mutex.unlock();
  EXPECT_FALSE(mutex.owns_lock());
  EXPECT_TRUE(contender.try_lock());
  EXPECT_GT(contender.fencing_token(), token);
  contender.unlock();
}

TEST_P(Conformance, RecursiveMutexExcludesOtherThreads) {
  auto mutex = client().recursive_mutex(name("r"));
  th::HoldRecorder recorder;
  std::atomic<int> unprotected{0};
  run_threads(4, [&](int) {
    for (int i = 0; i < 10; ++i) {
      std::lock_guard outer(mutex);
      Stopwatch watch;
      std::lock_guard inner(mutex);
      watch.held();
      const auto token = mutex.fencing_token();
      const int seen = unprotected.load(std::memory_order_relaxed);
      std::this_thread::yield();
      unprotected.store(seen + 1, std::memory_order_relaxed);
      recorder.record(watch.finish(mutex.name(), "exclusive", 1, token));
    }
  });
  EXPECT_EQ(unprotected, 40);
  expect_sound(recorder.records());
}

TEST_P(Conformance, MutexAndRecursiveMutexOfOneNameExcludeEachOther) {
  auto plain = client().mutex(name("x"));
  auto other = connect();
  auto recursive = other.recursive_mutex(name("x"));
  plain.lock();
  EXPECT_FALSE(recursive.try_lock());
  plain.unlock();
  recursive.lock();
  EXPECT_FALSE(plain.try_lock());
  recursive.unlock();
}

TEST_P(Conformance, StandardGuardsWork) {
  auto mutex = client().mutex(name("a"));
  auto second = client().mutex(name("b"));
  {
    std::lock_guard guard(mutex);
    EXPECT_TRUE(mutex.owns_lock());
  }
  EXPECT_FALSE(mutex.owns_lock());
  {
    std::unique_lock lock(mutex, std::try_to_lock);
    EXPECT_TRUE(lock.owns_lock());
    lock.unlock();
    EXPECT_FALSE(mutex.owns_lock());
    lock.lock();
    EXPECT_TRUE(mutex.owns_lock());
  }
  EXPECT_FALSE(mutex.owns_lock());
  {
    std::unique_lock lock(mutex, std::defer_lock);
    EXPECT_FALSE(lock.owns_lock());
    EXPECT_TRUE(lock.try_lock_for(1s));
  }
  {
    std::unique_lock lock(mutex, 1s);
    EXPECT_TRUE(lock.owns_lock());
  }
  {
    std::unique_lock lock(mutex, Clock::now() + 1s);
    EXPECT_TRUE(lock.owns_lock());
  }
  {
    std::unique_lock lock(mutex, std::chrono::system_clock::now() + 1s);
    EXPECT_TRUE(lock.owns_lock());
  }
  {
    std::scoped_lock both(mutex, second);
    EXPECT_TRUE(mutex.owns_lock());
    EXPECT_TRUE(second.owns_lock());
  }
  EXPECT_FALSE(mutex.owns_lock());
  EXPECT_FALSE(second.owns_lock());
  {
    std::lock(mutex, second);
    std::lock_guard a(mutex, std::adopt_lock);
    std::lock_guard b(second, std::adopt_lock);
    EXPECT_TRUE(second.owns_lock());
  }
  {
    auto recursive = client().recursive_mutex(name("r"));
    std::lock_guard outer(recursive);
    std::unique_lock inner(recursive);
    EXPECT_TRUE(inner.owns_lock());
  }
  EXPECT_EQ(holder_count(name("a")), 0u);
  EXPECT_EQ(holder_count(name("b")), 0u);
  EXPECT_EQ(holder_count(name("r")), 0u);
}

TEST_P(Conformance, TimedLockHonoursItsTimeout) {
  auto other = connect();
  auto holder = other.mutex(name("m"));
  holder.lock();
  auto mutex = client().mutex(name("m"));

  auto start = Clock::now();
  EXPECT_FALSE(mutex.try_lock_for(200ms));
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);

  start = Clock::now();
  EXPECT_FALSE(mutex.try_lock_until(Clock::now() + 200ms));
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);

  start = Clock::now();
  EXPECT_FALSE(mutex.try_lock_until(std::chrono::system_clock::now() + 200ms));
  EXPECT_GE(elapsed_ms(start), 190);  // another clock: allow for the conversion
  EXPECT_LT(elapsed_ms(start), 5000);

  start = Clock::now();
  EXPECT_FALSE(mutex.try_lock_for(0ms));
  EXPECT_FALSE(mutex.try_lock());
  EXPECT_FALSE(mutex.try_lock_until(Clock::now() - 1s));  // a past deadline tries once
  EXPECT_LT(elapsed_ms(start), 5000);

  // A timed-out contender left the queue.
  EXPECT_EQ(waiter_count(name("m")), 0u);
  holder.unlock();
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

TEST_P(Conformance, TimedLockSucceedsWhenReleasedInTime) {
  Pipe locked;
  auto holder = std::async(std::launch::async, [&] {
    auto other = connect();
    auto mutex = other.mutex(name("m"));
    mutex.lock();
    locked.send();
    std::this_thread::sleep_for(150ms);
    mutex.unlock();  // from the thread that holds it
  });
  ASSERT_TRUE(locked.receive());
  auto mutex = client().mutex(name("m"));
  const auto start = Clock::now();
  EXPECT_TRUE(mutex.try_lock_for(5s));
  EXPECT_LT(elapsed_ms(start), 5000);
  if (mutex.owns_lock()) mutex.unlock();
  holder.get();
}

TEST_P(Conformance, HugeTimeoutsMeanForever) {
  auto mutex = client().mutex(name("m"));
  EXPECT_TRUE(mutex.try_lock_for(std::chrono::nanoseconds::max()));
  mutex.unlock();
  EXPECT_TRUE(mutex.try_lock_for(std::chrono::hours(24 * 365 * 1000)));
  mutex.unlock();
  EXPECT_TRUE(mutex.try_lock_until(Clock::time_point::max()));
  mutex.unlock();
  EXPECT_TRUE(mutex.try_lock_until(std::chrono::system_clock::time_point::max()));
  mutex.unlock();
}

TEST_P(Conformance, NegativeTimeoutsAreRejected) {
  auto mutex = client().mutex(name("m"));
  auto recursive = client().recursive_mutex(name("r"));
  auto shared = client().shared_mutex(name("s"));
  EXPECT_THROW(mutex.try_lock_for(-1ms), turnstile::InvalidArgument);
  EXPECT_THROW(mutex.try_lock_for(std::chrono::seconds(-5)), turnstile::InvalidArgument);
  EXPECT_THROW(recursive.try_lock_for(-1ms), turnstile::InvalidArgument);
  EXPECT_THROW(shared.try_lock_for(-1ms), turnstile::InvalidArgument);
  EXPECT_THROW(shared.try_lock_shared_for(-1ms), turnstile::InvalidArgument);
  auto reader = shared.reader();
  EXPECT_THROW(reader.try_lock_for(-1ms), turnstile::InvalidArgument);
  // Nothing was changed: no holder, no waiter, and the locks are free.
  for (const char* leaf : {"m", "r", "s"}) {
    const auto inspection = client().inspect(name(leaf));
    EXPECT_TRUE(inspection.holders.empty()) << leaf;
    EXPECT_TRUE(inspection.waiters.empty()) << leaf;
  }
  EXPECT_FALSE(mutex.owns_lock());
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

}  // namespace conformance
