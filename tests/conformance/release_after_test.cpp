// SPDX-License-Identifier: Apache-2.0
// release_after (the CLI's --hold-at-least, ShedLock's lockAtLeastFor): the entry stays in the
// queue until its time, after its holder has gone, and then admits the waiter behind it.
#include <future>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Client;

constexpr auto kKeep = 2s;

}  // namespace

TEST_P(Conformance, ReleaseAfterKeepsTheNameHeldAfterItsProcessExits) {
  const auto n = name("cron");
  auto keeper = Child::spawn_gated([&] {
    auto client = Client::connect(url());
    auto mutex = client.mutex(n);
    mutex.lock();
    try {
      mutex.release_after(kKeep);
    } catch (const turnstile::InvalidArgument&) {
      return 3;  // this backend keeps nothing
    }
    return 0;
  });
  const auto before = Clock::now();
  keeper.start();
  const int status = keeper.wait();
  if (status == 3) GTEST_SKIP() << "this backend cannot keep a hold after its release";
  ASSERT_EQ(status, 0);

  auto mutex = client().mutex(n);
  EXPECT_FALSE(mutex.try_lock()) << "the kept hold let a newcomer in";
  const auto seen = client().inspect(n);
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_TRUE(seen.holders[0].kept_until.has_value());

  auto waiter = std::async(std::launch::async, [&] {
    const bool got = mutex.try_lock_for(30s);
    return std::pair{got, Clock::now()};
  });
  ASSERT_TRUE(wait_for_waiters(n, 1));  // it really waits behind the kept entry
  const auto [got, admitted_at] = waiter.get();
  ASSERT_TRUE(got);
  EXPECT_GE(admitted_at - before, kKeep) << "admitted before the kept hold ended";
  mutex.unlock();
}

TEST_P(Conformance, ReleaseAfterKeepsASemaphoreLease) {
  const auto n = name("pool");
  auto semaphore = client().semaphore(n, 1);
  auto lease = semaphore.acquire();
  const auto before = Clock::now();
  try {
    lease.release_after(kKeep);
  } catch (const turnstile::InvalidArgument&) {
    GTEST_SKIP() << "this backend cannot keep a hold after its release";
  }
  EXPECT_FALSE(lease.held());
  auto other = connect();
  auto contender = other.semaphore(n, 1);
  EXPECT_FALSE(contender.try_acquire().has_value());
  auto next = contender.try_acquire_for(30s);
  ASSERT_TRUE(next.has_value());
  EXPECT_GE(Clock::now() - before, kKeep);
}

}  // namespace conformance
