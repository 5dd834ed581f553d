// SPDX-License-Identifier: Apache-2.0
// SharedMutex: many readers, a writer excludes everyone, reentrancy on both sides, downgrade,
// no upgrade, FIFO between readers and writers, and the standard guards.
#include <atomic>
#include <future>
#include <mutex>
#include <random>
#include <shared_mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {
using turnstile::Client;
}

TEST_P(Conformance, ManyReadersHoldAtOnce) {
  constexpr int kReaders = 5;
  auto shared = client().shared_mutex(name("rw"));
  std::atomic<int> holding{0};
  std::atomic<int> saw_everyone{0};
  th::HoldRecorder recorder;
  run_threads(kReaders, [&](int) {
    auto own = connect();
    auto mine = own.shared_mutex(name("rw"));
    Stopwatch watch;
    if (!mine.try_lock_shared_for(10s)) return;
    watch.held();
    ++holding;
    if (eventually([&] { return holding.load() == kReaders; }, 10s)) ++saw_everyone;
    recorder.record(watch.finish(mine.name(), "shared", 1, mine.fencing_token()));
    mine.unlock_shared();
  });
  EXPECT_EQ(saw_everyone.load(), kReaders) << "readers did not all hold at the same time";
  expect_sound(recorder.records());
  EXPECT_EQ(th::max_concurrency(recorder.records()), kReaders);
  // The readers of one thread of the client are not affected.
  EXPECT_FALSE(shared.owns_shared());
}

TEST_P(Conformance, WriterExcludesReadersAndWriters) {
  auto shared = client().shared_mutex(name("rw"));
  auto other = connect();
  auto contender = other.shared_mutex(name("rw"));
  shared.lock();
  EXPECT_TRUE(shared.owns_lock());
  EXPECT_FALSE(contender.try_lock_shared());
  EXPECT_FALSE(contender.try_lock());
  EXPECT_FALSE(contender.try_lock_shared_for(100ms));
  shared.unlock();
  EXPECT_FALSE(shared.owns_lock());

  shared.lock_shared();
  EXPECT_FALSE(contender.try_lock());
  EXPECT_TRUE(contender.try_lock_shared());
  EXPECT_TRUE(contender.owns_shared());
  EXPECT_EQ(holder_count(name("rw")), 2u);
  contender.unlock_shared();
  EXPECT_FALSE(contender.try_lock());
  shared.unlock_shared();
  EXPECT_TRUE(contender.try_lock());
  contender.unlock();
}

TEST_P(Conformance, SharedMutexIsReentrantOnBothSides) {
  auto shared = client().shared_mutex(name("rw"));
  auto other = connect();
  auto contender = other.shared_mutex(name("rw"));
  shared.lock_shared();
  shared.lock_shared();
  EXPECT_TRUE(shared.try_lock_shared());
  shared.unlock_shared();
  shared.unlock_shared();
  EXPECT_TRUE(shared.owns_shared());
  EXPECT_FALSE(contender.try_lock());
  shared.unlock_shared();
  EXPECT_FALSE(shared.owns_shared());

  shared.lock();
  EXPECT_TRUE(shared.try_lock());  // a writer may lock again
  shared.unlock();
  EXPECT_TRUE(shared.owns_lock());
  EXPECT_FALSE(contender.try_lock_shared());
  shared.unlock();
  EXPECT_TRUE(contender.try_lock());
  contender.unlock();
}

TEST_P(Conformance, WriterMayDowngrade) {
  auto shared = client().shared_mutex(name("rw"));
  auto other = connect();
  auto contender = other.shared_mutex(name("rw"));
  shared.lock();
  const auto token = shared.fencing_token();
  shared.lock_shared();  // a writer may also read
  EXPECT_TRUE(shared.owns_lock());
  EXPECT_TRUE(shared.owns_shared());
  EXPECT_FALSE(contender.try_lock_shared());  // still a writer
  shared.unlock();                            // downgrade: the read lock remains
  EXPECT_FALSE(shared.owns_lock());
  EXPECT_TRUE(shared.owns_shared());
  EXPECT_EQ(shared.fencing_token(), token);     // the same hold
  EXPECT_FALSE(contender.try_lock_for(100ms));  // a second writer still waits
  EXPECT_TRUE(contender.try_lock_shared());     // readers may join now
  contender.unlock_shared();
  shared.unlock_shared();
  EXPECT_FALSE(shared.owns_shared());
  EXPECT_TRUE(contender.try_lock());
  EXPECT_GT(contender.fencing_token(), token);
  contender.unlock();
}

TEST_P(Conformance, DowngradeWakesWaitingReaders) {
  const auto lock_name = name("rw");
  auto shared = client().shared_mutex(lock_name);
  shared.lock();
  OnExit release([&] {
    if (shared.owns_lock()) shared.unlock();
    if (shared.owns_shared()) shared.unlock_shared();
  });
  auto reader = std::async(std::launch::async, [&] {
    auto other = connect();
    auto mine = other.shared_mutex(lock_name);
    if (!mine.try_lock_shared_for(15s)) return false;
    mine.unlock_shared();
    return true;
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 1));
  shared.lock_shared();
  shared.unlock();
  ASSERT_EQ(reader.wait_for(5s), std::future_status::ready) << "the downgrade did not admit the reader";
  EXPECT_TRUE(reader.get());
}

TEST_P(Conformance, ReaderAskingToWriteGetsWouldDeadlock) {
  auto shared = client().shared_mutex(name("rw"));
  shared.lock_shared();
  EXPECT_THROW(shared.lock(), turnstile::WouldDeadlock);
  EXPECT_FALSE(shared.try_lock());  // a try cannot deadlock: busy (issue 24)
  EXPECT_THROW(shared.try_lock_for(50ms), turnstile::WouldDeadlock);
  EXPECT_THROW(shared.try_lock_until(Clock::now() + 50ms), turnstile::WouldDeadlock);
  EXPECT_TRUE(shared.owns_shared());
  EXPECT_FALSE(shared.owns_lock());
  shared.unlock_shared();
  EXPECT_TRUE(shared.try_lock());
  shared.unlock();
}

TEST_P(Conformance, ReaderArrivingAfterAWaitingWriterWaits) {
  const auto lock_name = name("rw");
  auto shared = client().shared_mutex(lock_name);
  shared.lock_shared();
  OnExit release([&] {
    if (shared.owns_shared()) shared.unlock_shared();
  });
  std::atomic<bool> writer_holds{false};
  auto writer = std::async(std::launch::async, [&] {
    auto other = connect();
    auto mine = other.shared_mutex(lock_name);
    if (!mine.try_lock_for(15s)) return false;
    writer_holds = true;
    std::this_thread::sleep_for(50ms);
    writer_holds = false;
    mine.unlock();
    return true;
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 1));
  // FIFO: a new reader queues behind the waiting writer instead of starving it.
  auto late = connect();
  auto late_reader = late.shared_mutex(lock_name);
  EXPECT_FALSE(late_reader.try_lock_shared_for(200ms));
  auto late_result = std::async(std::launch::async, [&] {
    if (!late_reader.try_lock_shared_for(15s)) return false;
    const bool overlapped = writer_holds.load();
    late_reader.unlock_shared();
    return !overlapped;
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 2));
  release.dismiss();
  shared.unlock_shared();
  ASSERT_EQ(writer.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(writer.get());
  ASSERT_EQ(late_result.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(late_result.get()) << "the late reader overlapped the writer";
}

TEST_P(Conformance, ReadersAndWritersKeepTheRulesAcrossThreads) {
  const auto lock_name = name("rw");
  th::HoldRecorder recorder;
  run_threads(6, [&](int t) {
    auto own = connect();
    auto shared = own.shared_mutex(lock_name);
    std::mt19937 random(static_cast<unsigned>(t));
    for (int i = 0; i < 15; ++i) {
      if (random() % 3 == 0) {
        Stopwatch watch;
        std::unique_lock guard(shared);
        watch.held();
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 300));
        recorder.record(watch.finish(lock_name, "exclusive", 1, shared.fencing_token()));
      } else {
        Stopwatch watch;
        std::shared_lock guard(shared);
        watch.held();
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 300));
        recorder.record(watch.finish(lock_name, "shared", 1, shared.fencing_token()));
      }
    }
  });
  EXPECT_EQ(recorder.size(), 90u);
  expect_sound(recorder.records());
}

TEST_P(Conformance, ReadersAndWritersKeepTheRulesAcrossProcesses) {
  const auto lock_name = name("rw");
  const auto history = scratch_path("history");
  std::vector<Child> children;
  for (int c = 0; c < 4; ++c) {
    children.push_back(Child::spawn([&, c] {
      auto own = Client::connect(url());
      auto shared = own.shared_mutex(lock_name);
      th::FileHoldRecorder recorder(history);
      std::mt19937 random(static_cast<unsigned>(c) + 100);
      for (int i = 0; i < 15; ++i) {
        const bool write = random() % 3 == 0;
        Stopwatch watch;
        if (!(write ? shared.try_lock_for(15s) : shared.try_lock_shared_for(15s))) return 3;
        watch.held();
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 500));
        recorder.record(watch.finish(lock_name, write ? "exclusive" : "shared", 1, shared.fencing_token()));
        if (write) {
          shared.unlock();
        } else {
          shared.unlock_shared();
        }
      }
      return 0;
    }));
  }
  for (auto& child : children) EXPECT_EQ(child.wait(20s), 0);
  const auto records = th::load_history(history);
  EXPECT_EQ(records.size(), 60u);
  expect_sound(records);
}

TEST_P(Conformance, SharedMutexWorksWithStandardGuards) {
  auto shared = client().shared_mutex(name("rw"));
  {
    std::shared_lock reader(shared);
    EXPECT_TRUE(reader.owns_lock());
    EXPECT_TRUE(shared.owns_shared());
  }
  EXPECT_FALSE(shared.owns_shared());
  {
    std::shared_lock reader(shared, 1s);
    EXPECT_TRUE(reader.owns_lock());
  }
  {
    std::shared_lock reader(shared, std::try_to_lock);
    EXPECT_TRUE(reader.owns_lock());
  }
  {
    std::shared_lock reader(shared, std::defer_lock);
    EXPECT_TRUE(reader.try_lock_until(Clock::now() + 1s));
  }
  {
    std::unique_lock writer(shared);
    EXPECT_TRUE(shared.owns_lock());
  }
  {
    std::lock_guard writer(shared);
    EXPECT_TRUE(shared.owns_lock());
  }
  {
    auto view = shared.reader();
    std::lock_guard reader(view);
    EXPECT_TRUE(shared.owns_shared());
    EXPECT_FALSE(shared.owns_lock());
  }
  {
    auto view = shared.reader();
    std::unique_lock reader(view, 1s);
    EXPECT_TRUE(reader.owns_lock());
  }
  EXPECT_FALSE(shared.owns_shared());
  EXPECT_FALSE(shared.owns_lock());
  EXPECT_EQ(holder_count(name("rw")), 0u);
}

TEST_P(Conformance, MutexAndSharedMutexOfOneNameShareOneQueue) {
  auto mutex = client().mutex(name("x"));
  auto other = connect();
  auto shared = other.shared_mutex(name("x"));
  mutex.lock();
  EXPECT_FALSE(shared.try_lock_shared());
  EXPECT_FALSE(shared.try_lock());
  mutex.unlock();
  shared.lock_shared();
  EXPECT_FALSE(mutex.try_lock());
  shared.unlock_shared();
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

}  // namespace conformance
