// SPDX-License-Identifier: Apache-2.0
// MultiLock: all or nothing, over any mix of lockables; gives back in reverse order.
#include <mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {

// Wraps a lockable and logs what MultiLock does with it.
template <class L>
struct Logged {
  L& inner;
  std::string id;
  std::vector<std::string>& log;

  void lock() {
    inner.lock();
    log.push_back("lock " + id);
  }
  template <class Clock_, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock_, Duration>& when) {
    const bool ok = inner.try_lock_until(when);
    log.push_back((ok ? "lock " : "fail ") + id);
    return ok;
  }
  void unlock() {
    log.push_back("unlock " + id);
    inner.unlock();
  }
};

}  // namespace

TEST_P(Conformance, MultiLockIsAllOrNothing) {
  auto a = client().mutex(name("a"));
  auto b = client().mutex(name("b"));
  auto c = client().mutex(name("c"));
  auto other = connect();
  auto other_a = other.mutex(name("a"));
  auto other_b = other.mutex(name("b"));
  auto other_c = other.mutex(name("c"));
  other_b.lock();
  turnstile::MultiLock all(a, b, c);
  const auto start = Clock::now();
  EXPECT_FALSE(all.try_lock_for(200ms));
  EXPECT_GE(elapsed_ms(start), 200);
  EXPECT_LT(elapsed_ms(start), 5000);
  EXPECT_FALSE(all.try_lock());
  EXPECT_FALSE(a.owns_lock());
  EXPECT_FALSE(c.owns_lock());
  // What it took was given back: another client can take it.
  EXPECT_TRUE(other_a.try_lock());
  EXPECT_TRUE(other_c.try_lock());
  other_a.unlock();
  other_c.unlock();
  other_b.unlock();
  EXPECT_TRUE(all.try_lock_for(1s));
  EXPECT_TRUE(a.owns_lock());
  EXPECT_TRUE(b.owns_lock());
  EXPECT_TRUE(c.owns_lock());
  EXPECT_FALSE(other_a.try_lock());
  EXPECT_FALSE(other_b.try_lock());
  EXPECT_FALSE(other_c.try_lock());
  all.unlock();
  EXPECT_FALSE(a.owns_lock());
  EXPECT_TRUE(other_a.try_lock());
  EXPECT_TRUE(other_b.try_lock());
  EXPECT_TRUE(other_c.try_lock());
  other_a.unlock();
  other_b.unlock();
  other_c.unlock();
}

TEST_P(Conformance, MultiLockReleasesInReverseOrder) {
  auto a = client().mutex(name("a"));
  auto b = client().mutex(name("b"));
  auto c = client().mutex(name("c"));
  std::vector<std::string> log;
  Logged<turnstile::Mutex> la{a, "a", log}, lb{b, "b", log}, lc{c, "c", log};
  turnstile::MultiLock all(la, lb, lc);

  auto other = connect();
  auto other_c = other.mutex(name("c"));
  other_c.lock();
  EXPECT_FALSE(all.try_lock_for(100ms));
  EXPECT_EQ(log, (std::vector<std::string>{"lock a", "lock b", "fail c", "unlock b", "unlock a"}));
  other_c.unlock();

  log.clear();
  all.lock();
  EXPECT_EQ(log, (std::vector<std::string>{"lock a", "lock b", "lock c"}));
  log.clear();
  all.unlock();
  EXPECT_EQ(log, (std::vector<std::string>{"unlock c", "unlock b", "unlock a"}));
  EXPECT_EQ(holder_count(name("a")) + holder_count(name("b")) + holder_count(name("c")), 0u);
}

TEST_P(Conformance, MultiLockMixesEveryKindOfLockable) {
  auto mutex = client().mutex(name("m"));
  auto recursive = client().recursive_mutex(name("r"));
  auto shared = client().shared_mutex(name("rw"));
  auto reader = shared.reader();
  auto writer_shared = client().shared_mutex(name("w"));
  auto semaphore = client().semaphore(name("s"), 2);
  auto leases = semaphore.lockable(2);
  auto counter = client().permit_counter(name("c"));
  EXPECT_TRUE(counter.try_set_permits(1));
  auto permit = counter.lockable(1);
  std::timed_mutex local;
  turnstile::MultiLock inner(recursive, writer_shared);
  turnstile::MultiLock all(mutex, reader, leases, permit, local, inner);

  auto other = connect();
  {
    std::lock_guard guard(all);
    EXPECT_TRUE(mutex.owns_lock());
    EXPECT_TRUE(recursive.owns_lock());
    EXPECT_TRUE(shared.owns_shared());
    EXPECT_FALSE(shared.owns_lock());
    EXPECT_TRUE(writer_shared.owns_lock());
    EXPECT_TRUE(leases.lease().held());
    EXPECT_EQ(counter.available_permits(), 0);
    EXPECT_FALSE(local.try_lock());
    EXPECT_FALSE(other.mutex(name("m")).try_lock());
    EXPECT_FALSE(other.recursive_mutex(name("r")).try_lock());
    EXPECT_FALSE(other.shared_mutex(name("rw")).try_lock());
    EXPECT_FALSE(other.shared_mutex(name("w")).try_lock_shared());
    EXPECT_FALSE(other.semaphore(name("s"), 2).try_acquire().has_value());
  }
  EXPECT_FALSE(mutex.owns_lock());
  EXPECT_FALSE(recursive.owns_lock());
  EXPECT_FALSE(shared.owns_shared());
  EXPECT_FALSE(writer_shared.owns_lock());
  EXPECT_FALSE(leases.lease().held());
  EXPECT_EQ(counter.available_permits(), 1);
  EXPECT_TRUE(local.try_lock());
  local.unlock();
  auto om = other.mutex(name("m"));
  EXPECT_TRUE(om.try_lock());
  om.unlock();
  EXPECT_TRUE(other.semaphore(name("s"), 2).try_acquire(2).has_value());
}

TEST_P(Conformance, MultiLockGivesBackWhenAMemberThrows) {
  auto a = client().mutex(name("a"));
  auto b = client().mutex(name("b"));
  b.lock();  // this thread already holds b: taking it again is WouldDeadlock
  turnstile::MultiLock both(a, b);
  EXPECT_THROW(both.lock(), turnstile::WouldDeadlock);
  EXPECT_FALSE(a.owns_lock());
  EXPECT_TRUE(b.owns_lock());  // held before, still held
  b.unlock();
  auto other = connect();
  auto other_a = other.mutex(name("a"));
  EXPECT_TRUE(other_a.try_lock());
  other_a.unlock();
}

TEST_P(Conformance, MultiLockRefusesNegativeTimeouts) {
  auto a = client().mutex(name("a"));
  turnstile::MultiLock one(a);
  EXPECT_THROW(one.try_lock_for(-1ms), turnstile::InvalidArgument);
  EXPECT_FALSE(a.owns_lock());
}

}  // namespace conformance
