// SPDX-License-Identifier: Apache-2.0
// Semaphore and Lease: the limit is never exceeded (threads and processes), leases return on
// release, destruction and move, FIFO without barging, and every bad argument is refused.
#include <atomic>
#include <future>
#include <mutex>
#include <random>

#include "conformance/support.hpp"

namespace conformance {
namespace {
using turnstile::Client;
}

TEST_P(Conformance, SemaphoreLimitHoldsAcrossThreads) {
  constexpr std::int64_t kLimit = 3;
  const auto sem_name = name("s");
  th::HoldRecorder recorder;
  std::atomic<int> timeouts{0};
  run_threads(8, [&](int t) {
    auto own = connect();
    auto semaphore = own.semaphore(sem_name, kLimit);
    std::mt19937 random(static_cast<unsigned>(t));
    for (int i = 0; i < 12; ++i) {
      const std::int64_t n = 1 + static_cast<std::int64_t>(random() % 2);
      Stopwatch watch;
      auto lease = semaphore.try_acquire_for(15s, n);
      if (!lease) {
        ++timeouts;
        return;
      }
      watch.held();
      std::this_thread::sleep_for(std::chrono::microseconds(random() % 400));
      recorder.record(watch.finish(sem_name, "lease", lease->permits(), lease->fencing_token()));
    }
  });
  EXPECT_EQ(timeouts.load(), 0) << "contenders waited 15 s for a semaphore of limit 3 (a lost wake-up?)";
  EXPECT_EQ(recorder.size(), 96u);
  expect_sound(recorder.records(), kLimit);
  EXPECT_LE(th::max_concurrency(recorder.records()), kLimit);
  EXPECT_GT(th::max_concurrency(recorder.records()), 0);
  EXPECT_EQ(holder_count(sem_name), 0u);
}

TEST_P(Conformance, SemaphoreLimitHoldsAcrossProcesses) {
  constexpr std::int64_t kLimit = 2;
  const auto sem_name = name("s");
  const auto history = scratch_path("history");
  std::vector<Child> children;
  for (int c = 0; c < 5; ++c) {
    children.push_back(Child::spawn([&, c] {
      auto own = Client::connect(url());
      auto semaphore = own.semaphore(sem_name, kLimit);
      th::FileHoldRecorder recorder(history);
      std::mt19937 random(static_cast<unsigned>(c) + 7);
      for (int i = 0; i < 10; ++i) {
        const std::int64_t n = 1 + static_cast<std::int64_t>(random() % 2);
        Stopwatch watch;
        auto lease = semaphore.try_acquire_for(15s, n);
        if (!lease) return 3;  // 15 s for a semaphore of limit 2: a lost wake-up
        watch.held();
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 600));
        recorder.record(watch.finish(sem_name, "lease", n, lease->fencing_token()));
      }
      return 0;
    }));
  }
  {
    auto semaphore = client().semaphore(sem_name, kLimit);
    th::FileHoldRecorder recorder(history);
    for (int i = 0; i < 10; ++i) {
      Stopwatch watch;
      auto lease = semaphore.try_acquire_for(15s);
      ASSERT_TRUE(lease.has_value()) << "waited 15 s for a semaphore of limit 2 (a lost wake-up?)";
      watch.held();
      recorder.record(watch.finish(sem_name, "lease", 1, lease->fencing_token()));
    }
  }
  for (auto& child : children) EXPECT_EQ(child.wait(20s), 0) << "3 means a child waited 15 s for a lease";
  const auto records = th::load_history(history);
  EXPECT_EQ(records.size(), 60u);
  expect_sound(records, kLimit);
  EXPECT_LE(th::max_concurrency(records), kLimit);
}

TEST_P(Conformance, LeasesReturnOnReleaseDestructionAndMove) {
  auto semaphore = client().semaphore(name("s"), 3);
  auto other = connect();
  auto probe = other.semaphore(name("s"), 3);
  auto a = semaphore.acquire();
  EXPECT_TRUE(a.held());
  EXPECT_TRUE(static_cast<bool>(a));
  EXPECT_EQ(a.name(), name("s"));
  EXPECT_EQ(a.permits(), 1);
  auto b = semaphore.acquire(2);
  EXPECT_EQ(b.permits(), 2);
  EXPECT_NE(a.fencing_token(), b.fencing_token());
  EXPECT_FALSE(probe.try_acquire().has_value());

  // release()
  a.release();
  EXPECT_FALSE(a.held());
  EXPECT_THROW(a.release(), turnstile::NotHeld);
  {
    auto c = probe.try_acquire();
    ASSERT_TRUE(c.has_value());
    EXPECT_FALSE(probe.try_acquire().has_value());
  }  // destruction
  EXPECT_EQ(holder_count(name("s")), 1u);

  // move construction carries the lease, the source holds nothing
  const auto token = b.fencing_token();
  turnstile::Lease moved(std::move(b));
  EXPECT_FALSE(b.held());
  EXPECT_THROW(b.release(), turnstile::NotHeld);
  EXPECT_TRUE(moved.held());
  EXPECT_EQ(moved.fencing_token(), token);
  EXPECT_EQ(holder_count(name("s")), 1u);

  // move assignment onto a held lease releases what it held
  auto d = semaphore.acquire();
  EXPECT_FALSE(probe.try_acquire().has_value());
  d = std::move(moved);
  EXPECT_EQ(d.fencing_token(), token);
  EXPECT_EQ(d.permits(), 2);
  EXPECT_EQ(holder_count(name("s")), 1u);
  {
    auto e = probe.try_acquire();
    EXPECT_TRUE(e.has_value());
  }
  // self-move-assignment keeps the lease
  auto& alias = d;
  d = std::move(alias);
  EXPECT_TRUE(d.held());

  // a lease may be released from another thread
  std::async(std::launch::async, [lease = std::move(d)]() mutable { lease.release(); }).get();
  const auto full = probe.try_acquire(3);
  EXPECT_TRUE(full.has_value()) << "leases were not all returned";
}

TEST_P(Conformance, SemaphoreServesWaitersInArrivalOrderWithoutBarging) {
  const auto sem_name = name("s");
  auto semaphore = client().semaphore(sem_name, 2);
  auto first = semaphore.acquire();
  std::optional<turnstile::Lease> keep_first(std::move(first));
  std::mutex order_mutex;
  std::vector<std::string> order;
  const auto contender = [&](std::string label, std::int64_t n) {
    return std::async(std::launch::async, [&, label, n] {
      auto own = connect();
      auto mine = own.semaphore(sem_name, 2);
      auto lease = mine.try_acquire_for(15s, n);
      if (!lease) return false;
      {
        std::lock_guard lock(order_mutex);
        order.push_back(label);
      }
      std::this_thread::sleep_for(20ms);
      return true;
    });
  };
  std::future<bool> wants_two, wants_one;
  OnExit free_first([&] { keep_first.reset(); });  // before the futures wait, on early exit
  wants_two = contender("two", 2);
  ASSERT_TRUE(wait_for_waiters(sem_name, 1));
  wants_one = contender("one", 1);
  ASSERT_TRUE(wait_for_waiters(sem_name, 2));
  // One lease is free, but the contender for two arrived first: the later one must not barge.
  std::this_thread::sleep_for(200ms);
  {
    std::lock_guard lock(order_mutex);
    EXPECT_TRUE(order.empty()) << "'" << order.front() << "' barged ahead";
  }
  EXPECT_EQ(waiter_count(sem_name), 2u);
  keep_first.reset();
  ASSERT_EQ(wants_two.wait_for(10s), std::future_status::ready);
  ASSERT_EQ(wants_one.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(wants_two.get());
  EXPECT_TRUE(wants_one.get());
  EXPECT_EQ(order, (std::vector<std::string>{"two", "one"}));
}

TEST_P(Conformance, ReleasedLeaseWakesAWaiter) {
  const auto sem_name = name("s");
  auto semaphore = client().semaphore(sem_name, 1);
  std::optional<turnstile::Lease> lease = semaphore.acquire();
  auto waiter = std::async(std::launch::async, [&] {
    auto own = connect();
    return own.semaphore(sem_name, 1).try_acquire_for(15s).has_value();
  });
  OnExit release([&] { lease.reset(); });
  ASSERT_TRUE(wait_for_waiters(sem_name, 1));
  lease.reset();
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
}

TEST_P(Conformance, SemaphoreTimeoutsAreHonoured) {
  auto semaphore = client().semaphore(name("s"), 1);
  auto held = semaphore.acquire();
  auto other = connect();
  auto contender = other.semaphore(name("s"), 1);
  auto start = Clock::now();
  EXPECT_FALSE(contender.try_acquire_for(200ms).has_value());
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);
  start = Clock::now();
  EXPECT_FALSE(contender.try_acquire_until(Clock::now() + 200ms).has_value());
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);
  EXPECT_FALSE(contender.try_acquire().has_value());
  EXPECT_EQ(waiter_count(name("s")), 0u);
}

TEST_P(Conformance, SemaphoreRefusesBadArguments) {
  const auto sem_name = name("s");
  EXPECT_THROW(client().semaphore(sem_name, 0), turnstile::InvalidArgument);
  EXPECT_THROW(client().semaphore(sem_name, -3), turnstile::InvalidArgument);
  auto semaphore = client().semaphore(sem_name, 3);
  EXPECT_EQ(semaphore.limit(), 3);
  EXPECT_EQ(semaphore.name(), sem_name);
  EXPECT_THROW(semaphore.acquire(0), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.acquire(-1), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.acquire(4), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.try_acquire(4), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.try_acquire(0), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.try_acquire_for(10ms, 4), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.try_acquire_for(-1ms), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.try_acquire_until(Clock::now() + 10ms, -2), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.lockable(0), turnstile::InvalidArgument);
  EXPECT_THROW(semaphore.lockable(4), turnstile::InvalidArgument);
  // Nothing changed.
  const auto inspection = client().inspect(sem_name);
  EXPECT_TRUE(inspection.holders.empty());
  EXPECT_TRUE(inspection.waiters.empty());
  EXPECT_EQ(inspection.mode, "");
  auto all = semaphore.try_acquire(3);
  EXPECT_TRUE(all.has_value());
}

TEST_P(Conformance, SemaphoreContendersMustAgreeOnTheLimit) {
  const auto sem_name = name("s");
  auto three = client().semaphore(sem_name, 3);
  auto other = connect();
  auto two = other.semaphore(sem_name, 2);
  {
    auto lease = three.acquire();
    EXPECT_THROW(two.acquire(), turnstile::LimitMismatch);
    EXPECT_THROW(two.try_acquire(), turnstile::LimitMismatch);
    EXPECT_THROW(two.try_acquire_for(100ms), turnstile::LimitMismatch);
    // The same client disagreeing is refused as well.
    EXPECT_THROW(client().semaphore(sem_name, 4).try_acquire(), turnstile::LimitMismatch);
    // The holder is untouched.
    EXPECT_TRUE(lease.held());
    EXPECT_EQ(holder_count(sem_name), 1u);
    EXPECT_EQ(client().inspect(sem_name).limit, 3);
  }
  // Once nobody is queued, a new limit may start.
  auto lease = two.try_acquire(2);
  EXPECT_TRUE(lease.has_value());
  EXPECT_EQ(client().inspect(sem_name).limit, 2);
}

TEST_P(Conformance, LockAndSemaphoreOnOneNameAreAKindMismatch) {
  const auto shared_name = name("x");
  {
    auto mutex = client().mutex(shared_name);
    std::lock_guard guard(mutex);
    auto other = connect();
    EXPECT_THROW(other.semaphore(shared_name, 2).acquire(), turnstile::KindMismatch);
    EXPECT_THROW(other.semaphore(shared_name, 2).try_acquire(), turnstile::KindMismatch);
  }
  {
    auto lease = client().semaphore(shared_name, 2).acquire();
    auto other = connect();
    EXPECT_THROW(other.mutex(shared_name).lock(), turnstile::KindMismatch);
    EXPECT_THROW(other.mutex(shared_name).try_lock(), turnstile::KindMismatch);
    EXPECT_THROW(other.recursive_mutex(shared_name).try_lock_for(100ms), turnstile::KindMismatch);
    EXPECT_THROW(other.shared_mutex(shared_name).lock_shared(), turnstile::KindMismatch);
    EXPECT_EQ(client().inspect(shared_name).mode, "semaphore");
    EXPECT_EQ(holder_count(shared_name), 1u);
  }
  auto mutex = client().mutex(shared_name);
  EXPECT_TRUE(mutex.try_lock());
  EXPECT_EQ(client().inspect(shared_name).mode, "lock");
  mutex.unlock();
}

TEST_P(Conformance, SemaphoreLockableWorksWithGuards) {
  auto semaphore = client().semaphore(name("s"), 3);
  auto other = connect();
  auto probe = other.semaphore(name("s"), 3);
  auto two = semaphore.lockable(2);
  {
    std::lock_guard guard(two);
    EXPECT_TRUE(two.lease().held());
    EXPECT_EQ(two.lease().permits(), 2);
    EXPECT_FALSE(probe.try_acquire(2).has_value());
  }
  EXPECT_FALSE(two.lease().held());
  {
    std::unique_lock lock(two, 1s);
    EXPECT_TRUE(lock.owns_lock());
  }
  EXPECT_TRUE(probe.try_acquire(3).has_value());
}

}  // namespace conformance
