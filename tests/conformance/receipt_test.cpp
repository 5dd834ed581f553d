// SPDX-License-Identifier: Apache-2.0
// Client::release_receipt: another process (a holder's watcher after its SIGKILL) removes exactly
// the entry a receipt names, admitting the next waiter at once, and nothing else: not a new
// holder of the name, not twice.
#include <future>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using namespace std::chrono_literals;

turnstile::SteadyClock::time_point in(std::chrono::milliseconds how_long) {
  return turnstile::SteadyClock::now() + how_long;
}

// Quiet: the holder whose entry the receipt removed may report its hold lost.
turnstile::ClientOptions quiet() {
  turnstile::ClientOptions options;
  options.error_handler = [](const turnstile::Error&) {};
  return options;
}

}  // namespace

TEST_P(Conformance, ReleaseReceiptAdmitsTheWaiterAndRemovesNothingElse) {
  auto holder = connect(quiet());
  auto mutex = holder.mutex(name("m"));
  mutex.lock();
  const auto receipt = mutex.release_receipt();
  if (!has_server()) {
    // file://: a hold ends with its process; nothing is left for a receipt to remove.
    EXPECT_EQ(receipt, "");
    EXPECT_FALSE(client().release_receipt(receipt, in(1s)));
    return;
  }
  ASSERT_FALSE(receipt.empty());
  auto other = connect();
  auto waiter_mutex = other.mutex(name("m"));
  // The waiter's hold is its thread's: it lets go when told.
  std::promise<void> let_go;
  std::promise<std::pair<bool, std::uint64_t>> admitted;
  auto waiter = std::async(std::launch::async, [&] {
    const bool got = waiter_mutex.try_lock_for(60s);
    admitted.set_value({got, got ? waiter_mutex.fencing_token() : 0});
    if (!got) return;
    let_go.get_future().wait();
    waiter_mutex.unlock();
  });
  ASSERT_TRUE(wait_for_waiters(name("m"), 1));  // really waiting behind the holder
  EXPECT_TRUE(client().release_receipt(receipt, in(5s)));
  auto admission = admitted.get_future();
  ASSERT_EQ(admission.wait_for(30s), std::future_status::ready) << "the waiter was not admitted";
  const auto [got, token] = admission.get();
  ASSERT_TRUE(got);
  EXPECT_GT(token, mutex.fencing_token());
  // Again (its answer may repeat the first one's): the new holder's entry is not the receipt's.
  client().release_receipt(receipt, in(5s));
  EXPECT_EQ(holder_count(name("m")), 1u);
  auto third = connect().mutex(name("m"));
  EXPECT_FALSE(third.try_lock()) << "the receipt removed the new holder's entry";
  let_go.set_value();
  waiter.get();
  mutex.unlock();  // its entry is gone: reported to the (quiet) handler, nothing removed
  EXPECT_TRUE(third.try_lock());
  third.unlock();
}

TEST_P(Conformance, ReleaseReceiptOfALeaseFreesItsPermit) {
  if (!has_server()) GTEST_SKIP() << "file://: nothing outlives the holder";
  auto holder = connect(quiet());
  auto lease = holder.semaphore(name("s"), 1).acquire();
  const auto receipt = lease.release_receipt();
  auto other = connect().semaphore(name("s"), 1);
  EXPECT_FALSE(other.try_acquire().has_value());
  EXPECT_TRUE(client().release_receipt(receipt, in(5s)));
  auto next = other.try_acquire_for(10s);
  EXPECT_TRUE(next.has_value()) << "the lease's permit was not freed";
  client().release_receipt(receipt, in(5s));  // again: the new lease stays
  EXPECT_FALSE(other.try_acquire().has_value());
}

TEST_P(Conformance, ReleaseReceiptRefusesWhatIsNotOne) {
  if (!has_server()) GTEST_SKIP() << "file://: every receipt is empty";
  EXPECT_THROW(client().release_receipt("not a receipt", in(1s)), turnstile::InvalidArgument);
  EXPECT_THROW(client().release_receipt("zk1 0", in(1s)), turnstile::InvalidArgument);
}

}  // namespace conformance
