// SPDX-License-Identifier: Apache-2.0
// Regressions of the safety reviews that every backend must pass the same way: the largest
// permit counts carried exactly and one more refused with nothing written (issue 10.5, 10.6),
// names that look like another name's entries or keys (10.11, 10.12), and a PermitCounter
// Lockable locked twice (10.16).
#include <thread>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::max_permits;

// ZooKeeper holds one lease node per permit (Curator's layout), so it may refuse a large permit
// count per acquire, with InvalidArgument; every other backend takes any count up to the max.
bool caps_permits_per_acquire(const std::string& url) {
  return url.rfind("zk", 0) == 0 || url.rfind("zookeeper", 0) == 0;
}

// Curator's protection prefix with a fixed uuid, as a forged node name would carry it.
const std::string kForgedUuid = "_c_00000000-0000-0000-0000-000000000000-";

// Names under a base name that look like its entries, lines or counters on some backend:
// ZooKeeper's nodes (Curator's layout), etcd's keys (`NAME/<lease hex>[_<n>]`), plus siblings
// that look like its Redis keys.
std::vector<std::string> forged_names(const std::string& base) {
  std::vector<std::string> names;
  const std::vector<std::string> leaves{"x-lock-0000000000",
                                        kForgedUuid + "lock-0000000000",
                                        kForgedUuid + "__READ__0000000000",
                                        kForgedUuid + "__WRIT__0000000000",
                                        "locks",
                                        "leases",
                                        "locks/" + kForgedUuid + "lock-0000000000",
                                        "leases/" + kForgedUuid + "lease-0000000000",
                                        "permits",
                                        "permit-waiters",
                                        "694d7a1b2c3d4e5f",
                                        "694d7a1b2c3d4e5f_1",
                                        "0"};
  for (const auto& leaf : leaves) names.push_back(base + "/" + leaf);
  for (const char* suffix : {"seq", "q", "e", "x", "r"}) names.push_back("turnstile:{" + base + "}:" + suffix);
  return names;
}

// Locks a forged name that nobody holds; false when the backend refused the name
// (InvalidArgument: allowed, as it refuses before writing anything). Failing to get it at once
// means it waits for another name's entry: a test failure.
bool lock_forged(turnstile::Mutex& mutex) {
  try {
    const bool got = mutex.try_lock();
    EXPECT_TRUE(got) << "'" << mutex.name() << "' waits for another name's entry";
    return got;
  } catch (const turnstile::InvalidArgument&) {
    return false;
  }
}

}  // namespace

TEST_P(Conformance, SemaphoreLimitAboveMaxPermitsIsRefusedWithNothingWritten) {
  const auto over = name("over");
  EXPECT_THROW((void)client().semaphore(over, max_permits + 1).try_acquire(), turnstile::InvalidArgument);
  const auto seen = client().inspect(over);
  EXPECT_EQ(seen.mode, "");
  EXPECT_TRUE(seen.holders.empty());
  EXPECT_TRUE(seen.waiters.empty());

  const auto top = name("top");
  auto semaphore = client().semaphore(top, max_permits);
  EXPECT_THROW((void)semaphore.try_acquire(max_permits + 1), turnstile::InvalidArgument);
  EXPECT_EQ(client().inspect(top).mode, "") << "a refused acquire writes nothing";
  auto lease = semaphore.try_acquire(1);
  ASSERT_TRUE(lease);
  const auto held = client().inspect(top);
  EXPECT_EQ(held.mode, "semaphore");
  EXPECT_EQ(held.limit, max_permits) << "the limit must round-trip exactly";
  ASSERT_EQ(held.holders.size(), 1u);
  EXPECT_EQ(held.holders[0].permits, 1);
}

// Issue 10.6: with limit max_permits, a full hold leaves no room for one more (the old
// signed-overflow predicate admitted it at INT64_MAX).
TEST_P(Conformance, SemaphoreAtMaxPermitsAdmitsNoMore) {
  const auto top = name("top");
  auto semaphore = client().semaphore(top, max_permits);
  auto other = connect().semaphore(top, max_permits);
  std::optional<turnstile::Lease> all;
  try {
    all = semaphore.try_acquire(max_permits);
    ASSERT_TRUE(all) << "nobody else holds any of it";
  } catch (const turnstile::InvalidArgument& refused) {
    ASSERT_TRUE(caps_permits_per_acquire(url()))
        << "only a per-permit layout may refuse max_permits: " << refused.what();
  }
  if (all) {
    const auto seen = client().inspect(top);
    ASSERT_EQ(seen.holders.size(), 1u);
    EXPECT_EQ(seen.holders[0].permits, max_permits) << "the permit count must round-trip exactly";
    EXPECT_FALSE(other.try_acquire(1)) << "one permit beyond max_permits was granted";
    EXPECT_FALSE(semaphore.try_acquire(1));
    all->release();
  }
  auto one = semaphore.try_acquire(1);
  ASSERT_TRUE(one);
  try {
    EXPECT_FALSE(other.try_acquire(max_permits)) << "max_permits + 1 leases granted at once";
  } catch (const turnstile::InvalidArgument& refused) {
    EXPECT_TRUE(caps_permits_per_acquire(url())) << refused.what();
  }
  EXPECT_EQ(client().inspect(top).holders.size(), 1u);
}

TEST_P(Conformance, PermitCounterCarriesMaxPermitsExactlyAndRefusesMore) {
  auto counter = client().permit_counter(name("count"));
  EXPECT_THROW(counter.try_set_permits(max_permits + 1), turnstile::InvalidArgument);
  EXPECT_FALSE(client().inspect(counter.name()).permits.has_value()) << "a refused try_set wrote a value";
  EXPECT_TRUE(counter.try_set_permits(max_permits));
  EXPECT_EQ(counter.available_permits(), max_permits);
  EXPECT_EQ(client().inspect(counter.name()).permits, std::optional<std::int64_t>(max_permits));

  EXPECT_THROW(counter.add_permits(1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.release(1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.add_permits(max_permits + 1), turnstile::InvalidArgument);
  EXPECT_THROW(counter.try_acquire(max_permits + 1), turnstile::InvalidArgument);
  EXPECT_EQ(counter.available_permits(), max_permits) << "a refused change changed the count";

  EXPECT_TRUE(counter.try_acquire(max_permits));
  EXPECT_EQ(counter.available_permits(), 0);
  EXPECT_EQ(counter.add_permits(-max_permits), -max_permits);
  EXPECT_THROW(counter.add_permits(-1), turnstile::InvalidArgument);
  EXPECT_EQ(counter.available_permits(), -max_permits);
  EXPECT_EQ(counter.add_permits(max_permits), 0);
  counter.release(max_permits);
  EXPECT_EQ(counter.drain_permits(), max_permits);
  EXPECT_EQ(counter.available_permits(), 0);
}

// Issue 10.16: locking a PermitCounter's Lockable view again while it holds would take permits
// that one unlock() could never return.
TEST_P(Conformance, PermitCounterLockableLockedTwiceKeepsTheCount) {
  auto counter = client().permit_counter(name("count"));
  ASSERT_TRUE(counter.try_set_permits(5));
  auto view = counter.lockable(2);
  view.lock();
  EXPECT_THROW(view.lock(), turnstile::WouldDeadlock);
  EXPECT_THROW((void)view.try_lock(), turnstile::WouldDeadlock);
  EXPECT_THROW((void)view.try_lock_for(50ms), turnstile::WouldDeadlock);
  EXPECT_THROW((void)view.try_lock_until(Clock::now() + 50ms), turnstile::WouldDeadlock);
  EXPECT_EQ(counter.available_permits(), 3);
  view.unlock();
  EXPECT_EQ(counter.available_permits(), 5);
  view.unlock();  // holds nothing: returns nothing
  EXPECT_EQ(counter.available_permits(), 5);
  EXPECT_TRUE(view.try_lock());
  EXPECT_EQ(counter.available_permits(), 3);
  view.unlock();
}

// Issue 10.12: no name can forge another name's queue entries. Each forged name is locked by a
// second client while the base name is held, and the other way round: neither waits for the
// other, and inspect of the base shows only its own entries.
TEST_P(Conformance, NamesLookingLikeAnotherNamesEntriesAreIndependentLocks) {
  const auto base = name("a");
  auto other = connect();
  auto mine = client().mutex(base);
  for (const auto& forged : forged_names(base)) {
    SCOPED_TRACE(forged);
    auto theirs = other.mutex(forged);
    ASSERT_TRUE(mine.try_lock());
    if (lock_forged(theirs)) {
      const auto seen = client().inspect(base);
      EXPECT_EQ(seen.holders.size(), 1u) << "the forged name's entry counts as the base's";
      EXPECT_TRUE(seen.waiters.empty());
      theirs.unlock();
    }
    mine.unlock();

    if (!lock_forged(theirs)) continue;  // refused
    const auto seen = client().inspect(base);
    EXPECT_TRUE(seen.holders.empty() && seen.waiters.empty()) << "the forged name's entry shows as the base's";
    EXPECT_TRUE(mine.try_lock()) << "the base name waits for a forged entry";
    if (mine.owns_lock()) mine.unlock();
    theirs.unlock();
  }
}

TEST_P(Conformance, NamesLookingLikeASemaphoresLeasesDoNotTakeItsPermits) {
  const auto base = name("s");
  auto other = connect();
  auto semaphore = client().semaphore(base, 1);
  for (const auto& forged : forged_names(base)) {
    SCOPED_TRACE(forged);
    auto theirs = other.mutex(forged);
    if (!lock_forged(theirs)) continue;
    auto lease = semaphore.try_acquire();
    EXPECT_TRUE(lease) << "the Semaphore counts a forged entry as a lease or a place in line";
    if (lease) {
      const auto seen = client().inspect(base);
      EXPECT_EQ(seen.holders.size(), 1u);
      EXPECT_TRUE(seen.waiters.empty());
      EXPECT_FALSE(connect().semaphore(base, 1).try_acquire()) << "and the forged name must not free one either";
    }
    theirs.unlock();
  }
}

TEST_P(Conformance, NamesLookingLikeACountersStateLeaveItsValue) {
  const auto base = name("c");
  auto other = connect();
  auto counter = client().permit_counter(base);
  for (const auto& forged : forged_names(base)) {
    SCOPED_TRACE(forged);
    auto theirs = other.mutex(forged);
    if (!lock_forged(theirs)) continue;
    EXPECT_EQ(counter.drain_permits(), 0) << "the counter reads a forged node or key as its value";
    EXPECT_EQ(counter.add_permits(7), 7);
    EXPECT_TRUE(counter.try_acquire(3));
    EXPECT_EQ(counter.available_permits(), 4);
    theirs.unlock();
    EXPECT_EQ(counter.available_permits(), 4);
    counter.drain_permits();
  }
}

// Issue 10.11: a PermitCounter named like a lock's own keys ("turnstile:{jobs}:seq" on Redis)
// must not reach them: its changes either work on a value of its own or are refused with
// InvalidArgument, and the lock's fencing tokens keep increasing while its hold stays intact.
TEST_P(Conformance, CounterNamedLikeALocksKeysLeavesTheLockAlone) {
  const auto jobs = name("jobs");
  auto lock = client().mutex(jobs);
  auto other = connect();
  auto rival = other.mutex(jobs);
  std::uint64_t last = 0;
  for (const char* suffix : {"seq", "q", "e", "x", "r", "w"}) {
    const auto forged = "turnstile:{" + jobs + "}:" + std::string(suffix);
    SCOPED_TRACE(forged);
    ASSERT_TRUE(lock.try_lock_for(5s));
    EXPECT_GT(lock.fencing_token(), last) << "fencing tokens must strictly increase";
    last = lock.fencing_token();
    try {
      auto counter = other.permit_counter(forged);
      counter.drain_permits();
      counter.add_permits(-5);
      EXPECT_EQ(counter.available_permits(), -5);
      counter.drain_permits();
      EXPECT_TRUE(counter.try_set_permits(3) || counter.available_permits() == 0);
    } catch (const turnstile::InvalidArgument&) {
      // Refused before anything was written: allowed.
    }
    EXPECT_FALSE(rival.try_lock()) << "the counter's changes freed the held lock";
    const auto seen = client().inspect(jobs);
    EXPECT_EQ(seen.holders.size(), 1u);
    EXPECT_EQ(lock.hold_state(), turnstile::HoldState::held);
    lock.unlock();
    if (rival.owns_lock()) rival.unlock();
  }
  ASSERT_TRUE(rival.try_lock_for(5s));
  EXPECT_GT(rival.fencing_token(), last) << "the counter reset the lock's fencing counter";
  rival.unlock();
}

// Issue 10.11 for PermitCounters: one counter's name must not reach another counter's waiting
// line (Redis keeps it in "{NAME}:turnstile:waiters").
TEST_P(Conformance, CounterNamedLikeAnotherCountersLineLeavesItsWaiterAlone) {
  const auto jobs = name("jobs");
  auto counter = client().permit_counter(jobs);
  ASSERT_TRUE(counter.try_set_permits(0));
  auto other = connect();
  std::atomic<bool> got{false};
  std::thread waiter([&] { got = other.permit_counter(jobs).try_acquire_for(10s); });
  OnExit join([&] {
    counter.add_permits(1);
    waiter.join();
  });
  std::this_thread::sleep_for(300ms);  // let it queue (a counter's line is not inspectable)
  for (const auto& forged : {"{" + jobs + "}:turnstile:waiters", jobs + ":turnstile:waiters"}) {
    SCOPED_TRACE(forged);
    try {
      auto rival = client().permit_counter(forged);
      EXPECT_EQ(rival.add_permits(2), 2);
      EXPECT_EQ(rival.drain_permits(), 2);
    } catch (const turnstile::InvalidArgument&) {
      // Refused before anything was written: allowed.
    }
  }
  EXPECT_FALSE(got) << "no permit was added to the counter itself";
  counter.add_permits(1);
  EXPECT_TRUE(eventually([&] { return got.load(); }, 5s)) << "the waiter lost its place in line";
  EXPECT_EQ(counter.available_permits(), 0);
}

}  // namespace conformance
