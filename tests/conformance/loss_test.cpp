// SPDX-License-Identifier: Apache-2.0
// Holders that die: a process killed with SIGKILL releases what it held (and its place in a
// queue) at once; a hold that was not lost never signals its stop token.
#include <signal.h>

#include <future>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Client;

// How long a dead holder may keep its hold: at once on the embedded backend (the kernel drops
// its locks), one short session TTL on the network backends.
std::chrono::milliseconds death_bound(const std::string& url) {
  return url.rfind("file:", 0) == 0 ? std::chrono::milliseconds(5s) : std::chrono::milliseconds(15s);
}

// Children that will be killed ask for a short session TTL (ignored by the embedded backend).
Client connect_short_lived(const std::string& url) {
  turnstile::ClientOptions options;
  options.ttl = 2s;
  return Client::connect(url, options);
}

// Forks a child that connects, runs `take` (which acquires and keeps what it took alive), tells
// the parent through the pipe, then waits to be killed.
template <class Take>
Child spawn_holder(const std::string& url, Pipe& ready, Take take) {
  return Child::spawn([&url, &ready, take]() -> int {
    auto own = connect_short_lived(url);
    auto keep = take(own);
    ready.send();
    linger_in_child();
  });
}

}  // namespace

TEST_P(Conformance, KilledMutexHolderReleasesItsHold) {
  const auto lock_name = name("m");
  Pipe ready;
  auto child = spawn_holder(url(), ready, [&](Client& own) {
    auto mutex = std::make_shared<turnstile::Mutex>(own.mutex(lock_name));
    mutex->lock();
    return mutex;
  });
  ASSERT_TRUE(ready.receive()) << "the child never locked";
  auto mutex = client().mutex(lock_name);
  EXPECT_FALSE(mutex.try_lock());
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  const auto start = Clock::now();
  EXPECT_TRUE(mutex.try_lock_for(death_bound(url())));
  EXPECT_LT(elapsed_ms(start), death_bound(url()).count());
  if (mutex.owns_lock()) mutex.unlock();
}

TEST_P(Conformance, KilledHolderWakesABlockedWaiter) {
  const auto lock_name = name("m");
  Pipe ready;
  auto child = spawn_holder(url(), ready, [&](Client& own) {
    auto mutex = std::make_shared<turnstile::Mutex>(own.mutex(lock_name));
    mutex->lock();
    return mutex;
  });
  ASSERT_TRUE(ready.receive()) << "the child never locked";
  auto waiter = std::async(std::launch::async, [&] {
    auto mutex = client().mutex(lock_name);
    if (!mutex.try_lock_for(18s)) return false;
    mutex.unlock();
    return true;
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 1));
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  ASSERT_EQ(waiter.wait_for(death_bound(url())), std::future_status::ready)
      << "the waiter did not wake when its holder died";
  EXPECT_TRUE(waiter.get());
}

TEST_P(Conformance, KilledWaiterLeavesTheQueue) {
  const auto lock_name = name("m");
  Pipe started;
  auto child = Child::spawn_gated([&]() -> int {
    auto own = connect_short_lived(url());
    auto mutex = own.mutex(lock_name);
    started.send();
    mutex.lock();  // queued behind the parent; killed while waiting
    linger_in_child();
  });
  auto holder = client().mutex(lock_name);
  holder.lock();
  OnExit release_holder([&] { holder.unlock(); });
  child.start();
  ASSERT_TRUE(started.receive());
  ASSERT_TRUE(wait_for_waiters(lock_name, 1));
  auto behind = std::async(std::launch::async, [&] {
    auto other = connect();
    auto mutex = other.mutex(lock_name);
    if (!mutex.try_lock_for(18s)) return false;
    mutex.unlock();
    return true;
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 2));
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  EXPECT_TRUE(wait_for_waiters(lock_name, 1, death_bound(url()))) << "the dead waiter is still listed";
  release_holder.dismiss();
  holder.unlock();
  ASSERT_EQ(behind.wait_for(death_bound(url())), std::future_status::ready) << "the dead waiter blocked the queue";
  EXPECT_TRUE(behind.get());
}

TEST_P(Conformance, KilledSemaphoreHolderReturnsItsLeases) {
  const auto sem_name = name("s");
  Pipe ready;
  auto child = spawn_holder(url(), ready, [&](Client& own) {
    return std::make_shared<turnstile::Lease>(own.semaphore(sem_name, 2).acquire(2));
  });
  ASSERT_TRUE(ready.receive()) << "the child never acquired";
  auto semaphore = client().semaphore(sem_name, 2);
  EXPECT_FALSE(semaphore.try_acquire().has_value());
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  const auto start = Clock::now();
  auto lease = semaphore.try_acquire_for(death_bound(url()), 2);
  EXPECT_TRUE(lease.has_value());
  EXPECT_LT(elapsed_ms(start), death_bound(url()).count());
}

TEST_P(Conformance, KilledReaderReleasesItsReadLock) {
  const auto lock_name = name("rw");
  Pipe ready;
  auto child = spawn_holder(url(), ready, [&](Client& own) {
    auto shared = std::make_shared<turnstile::SharedMutex>(own.shared_mutex(lock_name));
    shared->lock_shared();
    return shared;
  });
  ASSERT_TRUE(ready.receive()) << "the child never locked";
  auto shared = client().shared_mutex(lock_name);
  EXPECT_FALSE(shared.try_lock());
  EXPECT_TRUE(shared.try_lock_shared());  // readers share
  shared.unlock_shared();
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  EXPECT_TRUE(shared.try_lock_for(death_bound(url())));
  if (shared.owns_lock()) shared.unlock();
}

TEST_P(Conformance, KilledWriterReleasesItsWriteLock) {
  const auto lock_name = name("rw");
  Pipe ready;
  auto child = spawn_holder(url(), ready, [&](Client& own) {
    auto shared = std::make_shared<turnstile::SharedMutex>(own.shared_mutex(lock_name));
    shared->lock();
    return shared;
  });
  ASSERT_TRUE(ready.receive()) << "the child never locked";
  auto shared = client().shared_mutex(lock_name);
  EXPECT_FALSE(shared.try_lock_shared());
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  EXPECT_TRUE(shared.try_lock_shared_for(death_bound(url())));
  if (shared.owns_shared()) shared.unlock_shared();
}

// A holder that stops running (SIGSTOP, a long GC pause, a VM freeze) past its TTL has lost its
// hold to the next waiter: when it runs again, it must be told before it acts on it. The
// embedded backend's holds live exactly as long as the process, paused or not.
TEST_P(Conformance, HolderPausedPastItsTtlIsToldWhenItResumes) {
  if (url().rfind("file:", 0) == 0) GTEST_SKIP() << "embedded holds do not expire while the holder lives";
  const auto lock_name = name("paused");
  Pipe ready, verdict;
  auto child = Child::spawn([&]() -> int {
    auto own = connect_short_lived(url());
    auto mutex = own.mutex(lock_name);
    mutex.lock();
    const auto lost = mutex.lost_token();
    ready.send();
    // Paused here by the parent; once resumed, the hold must be reported lost.
    const auto deadline = Clock::now() + 20s;
    while (!lost.stop_requested() && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
    verdict.send(lost.stop_requested() ? 'L' : 'H');
    try {
      mutex.release();
    } catch (const turnstile::HoldLost&) {
      return 0;  // release() reports the loss too
    }
    return 5;
  });
  ASSERT_TRUE(ready.receive()) << "the child never locked";
  auto mutex = client().mutex(lock_name);
  EXPECT_FALSE(mutex.try_lock());
  child.kill(SIGSTOP);
  // The paused holder stops renewing: its hold runs out and this waiter gets the lock.
  ASSERT_TRUE(mutex.try_lock_for(death_bound(url())));
  child.kill(SIGCONT);
  EXPECT_EQ(verdict.receive(15s), 'L') << "the resumed holder was not told it lost the hold";
  EXPECT_EQ(child.wait(), 0);
  EXPECT_TRUE(mutex.owns_lock());
  mutex.unlock();
}

TEST_P(Conformance, HoldsThatAreNotLostDoNotSignal) {
  // A short TTL (2 s: renewals every ~0.7 s on every network backend), held for longer than
  // one TTL: only renewals that really get through keep these holds from being reported lost.
  auto short_lived = connect_short_lived(url());
  auto mutex = short_lived.mutex(name("m"));
  auto shared = short_lived.shared_mutex(name("rw"));
  auto semaphore = short_lived.semaphore(name("s"), 3);
  mutex.lock();
  shared.lock_shared();
  auto lease = semaphore.acquire(2);
  const auto mutex_lost = mutex.lost_token();
  const auto shared_lost = shared.lost_token();
  const auto lease_lost = lease.lost_token();
  EXPECT_TRUE(mutex_lost.stop_possible());
  EXPECT_FALSE(mutex_lost.stop_requested());
  EXPECT_FALSE(shared_lost.stop_requested());
  EXPECT_FALSE(lease_lost.stop_requested());
  std::this_thread::sleep_for(2500ms);  // past the TTL: at least three renewal rounds
  EXPECT_FALSE(mutex_lost.stop_requested());
  EXPECT_FALSE(shared_lost.stop_requested());
  EXPECT_FALSE(lease_lost.stop_requested());
  EXPECT_NO_THROW(mutex.release());
  EXPECT_NO_THROW(shared.release_shared());
  EXPECT_NO_THROW(lease.release());
  EXPECT_FALSE(mutex_lost.stop_requested());
  EXPECT_FALSE(lease_lost.stop_requested());
}

TEST_P(Conformance, LossQueriesWithoutAHoldThrowNotHeld) {
  auto mutex = client().mutex(name("m"));
  EXPECT_THROW(mutex.lost_token(), turnstile::NotHeld);
  EXPECT_THROW(mutex.fencing_token(), turnstile::NotHeld);
  turnstile::Lease empty;
  EXPECT_FALSE(empty.held());
  EXPECT_FALSE(static_cast<bool>(empty));
  EXPECT_THROW(empty.lost_token(), turnstile::NotHeld);
  EXPECT_THROW(empty.fencing_token(), turnstile::NotHeld);
  EXPECT_THROW(empty.name(), turnstile::NotHeld);
  EXPECT_THROW(empty.permits(), turnstile::NotHeld);
}

}  // namespace conformance
