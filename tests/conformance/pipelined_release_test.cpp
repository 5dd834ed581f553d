// SPDX-License-Identifier: Apache-2.0
// unlock()'s release need not wait for the server (issue 25, BackendHold::release_pipelined):
// what a returned unlock() still guarantees, on every backend, whether or not it pipelines.
// This client's next request comes after the release; a failed release reaches the error
// handler and is retried; a client destroyed right after unlock() leaves nothing behind; a lost
// hold's unlock() still reports HoldLost.
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "conformance/support.hpp"
#include "support/tcp_proxy.hpp"

namespace conformance {
namespace {

using turnstile_test::TcpProxy;

// Long enough that no entry here ends by its TTL while a test looks: an entry gone was removed.
constexpr auto kLongTtl = 20000ms;

// The errors an error handler was given, by code (any thread).
class ReportedErrors {
 public:
  turnstile::ClientOptions options(std::chrono::milliseconds ttl) {
    turnstile::ClientOptions result;
    result.ttl = ttl;
    result.unlock_without_waiting = true;
    result.error_handler = [this](const turnstile::Error& error) {
      std::lock_guard lock(mutex_);
      codes_.push_back(error.code());
      messages_ += std::string(error.what()) + "\n";
    };
    return result;
  }
  std::size_t count(turnstile::ErrorCode code) const {
    std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(std::count(codes_.begin(), codes_.end(), code));
  }
  std::size_t total() const {
    std::lock_guard lock(mutex_);
    return codes_.size();
  }
  std::string messages() const {
    std::lock_guard lock(mutex_);
    return messages_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<turnstile::ErrorCode> codes_;
  std::string messages_;
};

bool network_family_behind_proxy(const std::string& url) {
  return url.rfind("file:", 0) != 0 && url.rfind("redis+sentinel:", 0) != 0 && url.rfind("redis+cluster:", 0) != 0;
}

}  // namespace

// The same client's next acquire of the name comes after its release (a try that does not wait
// finds the name free), on every primitive; another client gets it once the server has it.
turnstile::ClientOptions unlocking_without_waiting() {
  turnstile::ClientOptions options;
  options.unlock_without_waiting = true;
  return options;
}

TEST_P(Conformance, UnlockThenLockAgainBySameClientAndByAnother) {
  auto mine = connect(unlocking_without_waiting());
  auto mutex = mine.mutex(name("m"));
  auto other = connect();
  auto contender = other.mutex(name("m"));
  for (int round = 0; round < 20; ++round) {
    mutex.lock();
    mutex.unlock();
    ASSERT_TRUE(mutex.try_lock()) << "round " << round << ": this client's own release was not applied first";
    mutex.unlock();
  }
  ASSERT_TRUE(contender.try_lock_for(5s)) << "another client never got the name after unlock()";
  contender.unlock();

  auto pool = mine.semaphore(name("pool"), 1);
  auto rw = mine.shared_mutex(name("rw"));
  for (int round = 0; round < 10; ++round) {
    { auto lease = pool.acquire(); }  // the Lease's end is an unlock()
    ASSERT_TRUE(pool.try_acquire().has_value()) << "round " << round << ": the lease was still held";
    rw.lock_shared();
    rw.unlock_shared();
    ASSERT_TRUE(rw.try_lock()) << "round " << round << ": the read lock was still held";
    rw.unlock();
  }
  EXPECT_TRUE(eventually([&] { return holder_count(name("m")) == 0 && holder_count(name("rw")) == 0; }, 5s));
}

// A client ended right after unlock() leaves no entry behind: its end waits (bounded) for the
// releases it sent. Checked at once, well within the TTL.
TEST_P(Conformance, ClientEndedRightAfterUnlockLeavesNoEntry) {
  for (int round = 0; round < 5; ++round) {
    const auto lock_name = name("m" + std::to_string(round));
    {
      auto options = unlocking_without_waiting();
      options.ttl = kLongTtl;
      auto ending = connect(options);
      auto mutex = ending.mutex(lock_name);
      mutex.lock();
      auto lease = ending.semaphore(name("pool"), 2).acquire();
      mutex.unlock();
    }
    EXPECT_EQ(holder_count(lock_name), 0u) << "round " << round << ": the released entry outlived its client";
    EXPECT_EQ(holder_count(name("pool")), 0u) << "round " << round << ": the lease outlived its client";
  }
}

// A release cut off from the server reaches the error handler (BackendUnavailable), and the
// background retry removes the entry once the link is back, well within the TTL.
TEST_P(Conformance, UnlockWhoseReleaseFailsIsReportedAndRetried) {
  if (!network_family_behind_proxy(url())) GTEST_SKIP() << "no link to cut (or a proxy would not stand before it)";
  TcpProxy proxy(url());
  ReportedErrors errors;
  // A session timeout the C client's own limits keep short (ZooKeeper: 2/3 of it to declare
  // the link lost), long against the test.
  auto through = turnstile::Client::connect(proxy.url_through(url()), errors.options(6000ms));
  const auto lock_name = name("m");
  auto mutex = through.mutex(lock_name);
  mutex.lock();
  proxy.blackhole();
  OnExit heal([&] { proxy.forward(); });
  mutex.unlock();
  ASSERT_TRUE(eventually([&] { return errors.count(turnstile::ErrorCode::backend_unavailable) > 0; }, 15s))
      << "the failed release never reached the error handler: " << errors.messages();
  proxy.forward();
  EXPECT_TRUE(eventually([&] { return holder_count(lock_name) == 0; }, 10s))
      << "the background retry never removed the entry";
  auto contender = client().mutex(lock_name);
  EXPECT_TRUE(contender.try_lock_for(5s));
  if (contender.owns_lock()) contender.unlock();
  EXPECT_EQ(errors.count(turnstile::ErrorCode::hold_lost), 0u) << errors.messages();
}

// A hold already lost (its link cut past the loss bound) is still reported lost by unlock().
TEST_P(Conformance, UnlockOfALostHoldStillReportsHoldLost) {
  if (!network_family_behind_proxy(url())) GTEST_SKIP() << "no server lease to lose";
  TcpProxy proxy(url());
  ReportedErrors errors;
  auto through = turnstile::Client::connect(proxy.url_through(url()), errors.options(3000ms));
  auto mutex = through.mutex(name("m"));
  mutex.lock();
  proxy.blackhole();
  OnExit heal([&] { proxy.forward(); });
  ASSERT_TRUE(eventually([&] { return mutex.hold_state() == turnstile::HoldState::lost; }, 15s));
  proxy.forward();
  mutex.unlock();
  EXPECT_TRUE(eventually([&] { return errors.count(turnstile::ErrorCode::hold_lost) > 0; }, 10s))
      << "unlock() of a lost hold did not report HoldLost: " << errors.messages();
}

}  // namespace conformance
