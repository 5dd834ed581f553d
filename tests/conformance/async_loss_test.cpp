// SPDX-License-Identifier: Apache-2.0
// Loss notices for holds acquired asynchronously (issue 26): such a hold is registered with the
// client's loss signal as a blocking one is, so a holder cut off from its server past the TTL is
// told by the documented bound — its Lease's lost_token() and hold_state(), and
// ClientOptions::on_hold_state — for a lock and a Semaphore lease alike. Network backends only
// (file:// holds live as long as their process).
#include <cstdio>
#include <mutex>
#include <optional>
#include <vector>

#include "conformance/fault_support.hpp"

namespace conformance {

using namespace faults;

// What on_hold_state told, by any thread.
class HoldStateLog {
 public:
  turnstile::HoldStateHandler handler() {
    return [this](const turnstile::HoldStateChange& change) {
      std::lock_guard lock(mutex_);
      changes_.push_back(change);
    };
  }
  bool told_lost(const std::string& name, std::uint64_t fencing_token) const {
    std::lock_guard lock(mutex_);
    return std::any_of(changes_.begin(), changes_.end(), [&](const turnstile::HoldStateChange& change) {
      return change.name == name && change.fencing_token == fencing_token && change.state == turnstile::HoldState::lost;
    });
  }

 private:
  mutable std::mutex mutex_;
  std::vector<turnstile::HoldStateChange> changes_;
};

TEST_P(Conformance, AsyncHoldsCutOffFromTheServerAreToldTheyAreLost) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  HoldStateLog log;
  auto options = with_ttl(kShortTtl);
  options.on_hold_state = log.handler();
  options.error_handler = [](const turnstile::Error&) {};  // the lost holds' releases at the end
  auto cut_off = connect_through(proxy, url(), options);
  auto lock = cut_off.mutex(name("async-held"));
  auto semaphore = cut_off.semaphore(name("async-leased"), 2);
  auto lock_lease = lock.lock_async().get();
  auto semaphore_lease = semaphore.acquire_async(1).get();
  ASSERT_TRUE(lock_lease && semaphore_lease) << "an uncontended async acquire acquired nothing";
  LossTime lock_lost(lock_lease->lost_token()), semaphore_lost(semaphore_lease->lost_token());
  OnExit reconnect([&] { proxy.forward(); });

  const auto cut = proxy.blackhole_when_quiet(kQuiet);
  const auto bound = cut + kShortTtl - loss_margin(kShortTtl);
  ASSERT_TRUE(eventually([&] { return lock_lost.reported() && semaphore_lost.reported(); }, kShortTtl + 10s))
      << "an async hold was never reported lost (lock: " << lock_lost.reported()
      << ", semaphore: " << semaphore_lost.reported() << ")";
  EXPECT_LE(lock_lost.at(), bound) << "the lock's loss came " << ms(lock_lost.at() - cut) << " ms after the cut";
  EXPECT_LE(semaphore_lost.at(), bound) << "the lease's loss came " << ms(semaphore_lost.at() - cut) << " ms after";
  EXPECT_EQ(lock_lease->hold_state(), turnstile::HoldState::lost);
  EXPECT_EQ(semaphore_lease->hold_state(), turnstile::HoldState::lost);
  EXPECT_TRUE(eventually([&] {
    return log.told_lost(name("async-held"), lock_lease->fencing_token()) &&
           log.told_lost(name("async-leased"), semaphore_lease->fencing_token());
  })) << "on_hold_state was not told of both losses";
}

// A client ended while its server does not answer (the link cut as a paused server looks:
// connections open, nothing answered), with async acquires pending, ends within a bound and
// leaves nothing behind: each pending acquire's leave shares one deadline, what it could not
// confirm goes to the background removal, which the client's end drains by its bound; the
// server removes the rest with the client's session or lease once the link heals.
TEST_P(Conformance, AClientEndedWhileItsServerIsPausedEndsItsPendingAcquiresWithinABound) {
  SKIP_WITHOUT_SERVER();
  constexpr std::size_t kPending = 100;
  // The client's end: within one call limit (the TimePolicy cap, 5 s). The leaves share one
  // deadline (AsyncDriver::kLeavesAtEnd, 1 s) and the background's drain has its own bound
  // (drain_at_end, 1 s): ~2 s, with room for a loaded machine.
  constexpr auto kBound = 5s;
  TcpProxy proxy(url());
  OnExit reconnect([&] { proxy.forward(); });
  // Readers behind a writer: each joins the server's queue at once (etcd queues one client's
  // writers in the client first, docs/architecture.md).
  auto holder = client().shared_mutex(name("paused"));
  holder.lock();
  auto options = with_ttl(kShortTtl);
  options.error_handler = [](const turnstile::Error&) {};  // the removals it gives up at its end
  std::optional<turnstile::Client> paused = connect_through(proxy, url(), options);
  std::optional<turnstile::SharedMutex> mutex = paused->shared_mutex(name("paused"));
  std::vector<turnstile::Acquiring<std::optional<turnstile::Lease>>> pending;
  for (std::size_t i = 0; i < kPending; ++i) pending.push_back(mutex->lock_shared_async());
  ASSERT_TRUE(wait_for_waiters(name("paused"), kPending, 30s)) << "the async acquires did not all queue";

  proxy.blackhole();
  const auto start = Clock::now();
  mutex.reset();
  paused.reset();  // the last handle: the client ends
  const auto took = Clock::now() - start;
  EXPECT_LE(took, kBound) << "the client's end took " << ms(took) << " ms with its server paused";
  for (auto& acquiring : pending) {
    ASSERT_TRUE(acquiring.ready()) << "a pending acquire outlived its client";
    EXPECT_THROW(acquiring.get(), turnstile::BackendUnavailable);
  }
  proxy.forward();
  holder.unlock();
  EXPECT_TRUE(eventually([&] { return waiter_count(name("paused")) == 0 && holder_count(name("paused")) == 0; },
                         kShortTtl + 20s))
      << waiter_count(name("paused")) << " waiters of the ended client stayed on the server";
  std::printf("[ client end with %zu pending, server paused: %lld ms ]\n", kPending, static_cast<long long>(ms(took)));
}

}  // namespace conformance
