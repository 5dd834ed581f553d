// SPDX-License-Identifier: Apache-2.0
// Cancellable waits: a stop requested while a contender waits in line makes it leave the queue
// before the call returns (a signal in `turnstile run`, a service shutting down). The entry must
// be gone at once, not a TTL later: the next contender is admitted without waiting.
#include <future>

#include "conformance/support.hpp"

namespace conformance {
namespace {

TEST_P(Conformance, AStopWhileWaitingForAMutexLeavesTheQueue) {
  auto holder_client = connect();
  auto held = holder_client.mutex(name("lock"));
  auto waiter_client = connect();
  auto waiter = waiter_client.mutex(name("lock"));
  std::stop_source stop;
  std::future<bool> waiting;
  held.lock();
  // Declared after the future: on a failed assertion the holder leaves first, so the future's
  // destructor is not left waiting for a waiter that waits for the holder.
  OnExit unlock_holder([&] { held.unlock(); });
  waiting = std::async(std::launch::async, [&] { return waiter.lock(stop.get_token()); });
  ASSERT_TRUE(wait_for_waiters(name("lock"), 1)) << "the waiter never joined the queue";
  ASSERT_EQ(waiting.wait_for(200ms), std::future_status::timeout) << "admitted beside the holder";
  const auto stopped = Clock::now();
  stop.request_stop();
  ASSERT_EQ(waiting.wait_for(10s), std::future_status::ready) << "a requested stop did not end the wait";
  EXPECT_FALSE(waiting.get());
  EXPECT_LT(elapsed_ms(stopped), 5000) << "the wait ended long after the stop";
  EXPECT_FALSE(waiter.owns_lock());
  EXPECT_EQ(waiter_count(name("lock")), 0u) << "the stopped waiter left its entry in the queue";

  // The entry is gone: after the holder leaves, a third contender is admitted at once.
  unlock_holder.dismiss();
  held.unlock();
  auto third = connect().mutex(name("lock"));
  EXPECT_TRUE(third.try_lock_for(3s)) << "a stopped waiter's entry still blocks the name";
  third.unlock();
}

TEST_P(Conformance, AStopWhileWaitingForLeasesOrAReadLockLeavesTheQueue) {
  auto holder_client = connect();
  auto semaphore = holder_client.semaphore(name("sem"), 2);
  auto writer = holder_client.shared_mutex(name("rw"));
  auto waiter_client = connect();
  auto waiting_semaphore = waiter_client.semaphore(name("sem"), 2);
  auto reader = waiter_client.shared_mutex(name("rw"));
  std::stop_source stop;
  std::future<std::optional<turnstile::Lease>> leases;
  std::future<bool> read;
  std::optional<turnstile::Lease> lease = semaphore.acquire(2);
  writer.lock();
  OnExit let_go([&] {
    writer.unlock();
    lease.reset();
  });
  leases = std::async(std::launch::async, [&] { return waiting_semaphore.acquire(1, stop.get_token()); });
  read = std::async(std::launch::async, [&] { return reader.lock_shared(stop.get_token()); });
  ASSERT_TRUE(wait_for_waiters(name("sem"), 1));
  ASSERT_TRUE(wait_for_waiters(name("rw"), 1));
  stop.request_stop();
  ASSERT_EQ(leases.wait_for(10s), std::future_status::ready);
  ASSERT_EQ(read.wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(leases.get().has_value());
  EXPECT_FALSE(read.get());
  EXPECT_EQ(waiter_count(name("sem")), 0u);
  EXPECT_EQ(waiter_count(name("rw")), 0u);
  lease->release();
  EXPECT_TRUE(connect().semaphore(name("sem"), 2).try_acquire_for(3s, 2).has_value());
}

TEST_P(Conformance, AStopWhileWaitingForPermitsLeavesTheLine) {
  const auto counter_name = name("permits");
  auto counter = client().permit_counter(counter_name);
  ASSERT_TRUE(counter.try_set_permits(0));
  auto waiter_client = connect();
  auto waiting_counter = waiter_client.permit_counter(counter_name);
  std::stop_source stop;
  auto waiting = std::async(std::launch::async, [&] { return waiting_counter.acquire(1, stop.get_token()); });
  OnExit unblock([&] {
    if (waiting.valid() && waiting.wait_for(0s) != std::future_status::ready) counter.release(1);
  });
  ASSERT_TRUE(wait_for_waiters(counter_name, 1)) << "the waiter never joined the line";
  ASSERT_EQ(waiting.wait_for(200ms), std::future_status::timeout) << "took a permit that was not there";
  stop.request_stop();
  ASSERT_EQ(waiting.wait_for(10s), std::future_status::ready) << "a requested stop did not end the wait";
  EXPECT_FALSE(waiting.get());
  EXPECT_EQ(waiter_count(counter_name), 0u) << "the stopped waiter stayed in line";
  // Its place is gone: a permit released now is there for anyone, at once.
  counter.release(1);
  EXPECT_TRUE(connect().permit_counter(counter_name).try_acquire());
  EXPECT_EQ(counter.available_permits(), 0);
}

TEST_P(Conformance, AStopRequestedBeforeTheCallNeverJoins) {
  auto holder = client().mutex(name("lock"));
  holder.lock();
  OnExit unlock_holder([&] { holder.unlock(); });
  std::stop_source stop;
  stop.request_stop();
  auto other = connect().mutex(name("lock"));
  EXPECT_FALSE(other.lock(stop.get_token()));
  EXPECT_EQ(waiter_count(name("lock")), 0u);
}

}  // namespace
}  // namespace conformance
