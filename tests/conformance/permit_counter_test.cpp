// SPDX-License-Identifier: Apache-2.0
// PermitCounter (Redisson RSemaphore semantics): arithmetic, waking, FIFO, bad arguments.
#include <future>
#include <mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {
using turnstile::Client;
}

TEST_P(Conformance, PermitCounterArithmetic) {
  auto counter = client().permit_counter(name("c"));
  EXPECT_EQ(counter.name(), name("c"));
  EXPECT_EQ(counter.available_permits(), 0);
  EXPECT_EQ(counter.drain_permits(), 0);  // never set: nothing to drain
  EXPECT_TRUE(counter.try_set_permits(5));
  EXPECT_FALSE(counter.try_set_permits(7));  // only once
  EXPECT_EQ(counter.available_permits(), 5);
  EXPECT_EQ(counter.add_permits(-2), 3);
  EXPECT_EQ(counter.add_permits(4), 7);
  EXPECT_EQ(counter.add_permits(0), 7);
  EXPECT_TRUE(counter.try_acquire(3));
  EXPECT_EQ(counter.available_permits(), 4);
  EXPECT_FALSE(counter.try_acquire(5));
  EXPECT_EQ(counter.available_permits(), 4);
  counter.release(2);
  EXPECT_EQ(counter.available_permits(), 6);
  EXPECT_EQ(counter.drain_permits(), 6);
  EXPECT_EQ(counter.available_permits(), 0);
  EXPECT_EQ(counter.drain_permits(), 0);
  EXPECT_FALSE(counter.try_set_permits(9));  // draining does not unset it
  EXPECT_FALSE(counter.try_acquire());
  // Negative counts are allowed through add_permits; acquiring needs them back above zero.
  EXPECT_EQ(counter.add_permits(-3), -3);
  EXPECT_FALSE(counter.try_acquire());
  counter.release(4);
  EXPECT_EQ(counter.available_permits(), 1);
  EXPECT_TRUE(counter.try_acquire());
  EXPECT_EQ(counter.available_permits(), 0);
  EXPECT_EQ(client().inspect(name("c")).permits, std::optional<std::int64_t>(0));
}

TEST_P(Conformance, PermitCounterIsSharedBetweenClients) {
  auto counter = client().permit_counter(name("c"));
  auto other = connect();
  auto same = other.permit_counter(name("c"));
  auto different = other.permit_counter(name("d"));
  EXPECT_TRUE(counter.try_set_permits(4));
  EXPECT_EQ(same.available_permits(), 4);
  EXPECT_FALSE(same.try_set_permits(1));
  EXPECT_TRUE(same.try_acquire(4));
  EXPECT_EQ(counter.available_permits(), 0);
  EXPECT_EQ(different.available_permits(), 0);
  EXPECT_TRUE(different.try_set_permits(1));
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, AddingToAnUnsetCounterCountsFromZero) {
  auto counter = client().permit_counter(name("c"));
  EXPECT_EQ(counter.add_permits(3), 3);
  EXPECT_EQ(counter.available_permits(), 3);
  auto other = client().permit_counter(name("d"));
  EXPECT_EQ(other.add_permits(-2), -2);
  EXPECT_EQ(other.available_permits(), -2);
}

TEST_P(Conformance, PermitCounterRefusesBadArguments) {
  auto counter = client().permit_counter(name("c"));
  EXPECT_THROW(counter.try_set_permits(-1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.acquire(0), turnstile::InvalidArgument);
  EXPECT_THROW(counter.acquire(-1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.try_acquire(0), turnstile::InvalidArgument);
  EXPECT_THROW(counter.try_acquire_for(10ms, -4), turnstile::InvalidArgument);
  EXPECT_THROW(counter.try_acquire_for(-1ms), turnstile::InvalidArgument);
  EXPECT_THROW(counter.try_acquire_for(-1ms, 1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.release(0), turnstile::InvalidArgument);
  EXPECT_THROW(counter.release(-2), turnstile::InvalidArgument);
  EXPECT_THROW(counter.lockable(0), turnstile::InvalidArgument);
  // Nothing changed: still never set.
  EXPECT_EQ(client().inspect(name("c")).permits, std::nullopt);
  EXPECT_TRUE(counter.try_set_permits(0));
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, PermitCounterWaiterWakesOnRelease) {
  const auto counter_name = name("c");
  auto counter = client().permit_counter(counter_name);
  EXPECT_TRUE(counter.try_set_permits(0));
  std::atomic<bool> done{false};
  auto waiter = std::async(std::launch::async, [&] {
    auto own = connect();
    const bool got = own.permit_counter(counter_name).try_acquire_for(15s, 2);
    done = true;
    return got;
  });
  OnExit unblock([&] {
    if (!done) counter.release(100);
  });
  ASSERT_TRUE(wait_for_waiters(counter_name, 1));
  counter.release(1);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(done.load()) << "took 2 permits when only 1 was there";
  counter.release(1);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready) << "the waiter did not wake";
  EXPECT_TRUE(waiter.get());
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, PermitCounterWaiterInAnotherProcessWakes) {
  // Forked before this process connects (and so starts threads): under the sanitizers, a child
  // forked while another thread held their allocator's lock never got past its first malloc.
  const auto counter_name = name("c");
  Pipe started;
  auto child = Child::spawn_gated([&] {
    auto own = Client::connect(url());
    auto mine = own.permit_counter(counter_name);
    started.send();
    return mine.try_acquire_for(15s, 2) ? 0 : 1;
  });
  auto counter = client().permit_counter(counter_name);
  EXPECT_TRUE(counter.try_set_permits(0));
  child.start();
  ASSERT_TRUE(started.receive());
  ASSERT_TRUE(wait_for_waiters(counter_name, 1));
  counter.release(1);
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(child.running()) << "took 2 permits when only 1 was there";
  counter.add_permits(1);
  EXPECT_EQ(child.wait(5s), 0);
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, PermitCounterWaitersAreServedInArrivalOrder) {
  const auto counter_name = name("c");
  auto counter = client().permit_counter(counter_name);
  EXPECT_TRUE(counter.try_set_permits(0));
  std::mutex order_mutex;
  std::vector<std::string> order;
  const auto waiter = [&](std::string label, std::int64_t n) {
    return std::async(std::launch::async, [&, label, n] {
      auto own = connect();
      if (!own.permit_counter(counter_name).try_acquire_for(15s, n)) return false;
      std::lock_guard lock(order_mutex);
      order.push_back(label);
      return true;
    });
  };
  std::future<bool> wants_two, wants_one;
  OnExit unblock([&] { counter.release(100); });
  wants_two = waiter("two", 2);
  ASSERT_TRUE(wait_for_waiters(counter_name, 1));
  wants_one = waiter("one", 1);
  ASSERT_TRUE(wait_for_waiters(counter_name, 2));
  counter.release(1);  // enough for the second, not the first: it must not barge
  std::this_thread::sleep_for(200ms);
  {
    std::lock_guard lock(order_mutex);
    EXPECT_TRUE(order.empty()) << "'" << order.front() << "' barged ahead";
  }
  counter.release(1);
  ASSERT_EQ(wants_two.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(wants_two.get());
  counter.release(1);
  ASSERT_EQ(wants_one.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(wants_one.get());
  EXPECT_EQ(order, (std::vector<std::string>{"two", "one"}));
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, PermitCounterTimeoutsAreHonoured) {
  auto counter = client().permit_counter(name("c"));
  auto start = Clock::now();
  EXPECT_FALSE(counter.try_acquire_for(200ms));
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);
  start = Clock::now();
  EXPECT_FALSE(counter.try_acquire_until(Clock::now() + 200ms, 3));
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);
  EXPECT_EQ(waiter_count(name("c")), 0u);
  // A timed-out waiter took nothing.
  counter.release(3);
  EXPECT_EQ(counter.available_permits(), 3);
}

TEST_P(Conformance, PermitCounterLockableTakesAndReturns) {
  auto counter = client().permit_counter(name("c"));
  EXPECT_TRUE(counter.try_set_permits(3));
  auto two = counter.lockable(2);
  two.unlock();  // not held: returns nothing
  EXPECT_EQ(counter.available_permits(), 3);
  {
    std::lock_guard guard(two);
    EXPECT_EQ(counter.available_permits(), 1);
  }
  EXPECT_EQ(counter.available_permits(), 3);
  {
    std::unique_lock lock(two, std::try_to_lock);
    EXPECT_TRUE(lock.owns_lock());
    EXPECT_EQ(counter.available_permits(), 1);
  }
  counter.add_permits(-2);
  {
    std::unique_lock lock(two, 50ms);
    EXPECT_FALSE(lock.owns_lock());
  }
  EXPECT_EQ(counter.available_permits(), 1);
}

}  // namespace conformance
