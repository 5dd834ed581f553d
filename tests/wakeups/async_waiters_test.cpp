// SPDX-License-Identifier: Apache-2.0
// Many async acquires on one name in one process (issue 26): they wait without a thread each.
// One client queues N lock_async() calls (N: $TURNSTILE_ASYNC_WAITERS, default 1,000; the
// async_waiters_long tests run 10,000) behind a held name, then
//   - counts this process's threads (/proc/self/task) against the count before queuing, with
//     the client's pool and the backend's I/O threads already running (a warm-up acquire);
//   - measures the client's memory per waiting acquire (RSS before and after queuing);
//   - proves they wait: nobody is admitted while the name is held, inspect shows N waiters;
//   - releases one hold at a time: each release admits exactly one acquire, the next in queue
//     order (checked against the queue inspect showed), and no two hold at once.
// The numbers are printed; only generous bounds are asserted (threads: at most 8 more than
// before queuing, whatever N; memory: 64 KiB a waiter, the goal being 4 KiB).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "conformance/support.hpp"
#include "wakeups/async_crowd.hpp"
#include "wakeups/probes.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// More threads than this over the count before queuing fails the test: a thread per waiter
// shows at once; the pool and an I/O thread started by the first wait stay well below it.
constexpr std::size_t kExtraThreads = 8;
constexpr double kKibPerWaiterBound = 64.0;

std::size_t waiters_wanted() {
  const char* text = std::getenv("TURNSTILE_ASYNC_WAITERS");
  const long n = text ? std::atol(text) : 1000;
  return n > 0 ? static_cast<std::size_t>(n) : 1000;
}

struct Peak {
  std::size_t threads = 0;
  void sample() { threads = std::max(threads, wakeups::thread_ids().size()); }
};

class AsyncWaiters : public conformance::Conformance {
 protected:
  // etcd keeps one key per client lease and name: a client's own waiters line up inside the
  // client, and inspect shows the one at the head of that line, waiting on the server.
  bool line_inside_client() const { return url().rfind("etcd", 0) == 0; }
  std::size_t visible(std::size_t waiting) const {
    return line_inside_client() ? std::min<std::size_t>(waiting, 1) : waiting;
  }

  // Queues `n` lock_async() on `name`, in waves (each seen queued before the next), stopping
  // early when the process gains more than kExtraThreads threads. Returns how many it queued.
  std::size_t queue(wakeups::AsyncCrowd& crowd, const std::string& name, std::size_t n, std::size_t threads_before,
                    Peak& peak) {
    const std::size_t wave = std::max<std::size_t>(50, n / 20);
    for (std::size_t i = 0; i < n; ++i) {
      crowd.add(client().mutex(name));
      if ((i + 1) % wave != 0 && i + 1 != n) continue;
      if (!wait_for_waiters(name, visible(i + 1), 120s)) {
        ADD_FAILURE() << "queued: " << waiter_count(name) << " of " << i + 1
                      << "; acquires failed: " << wakeups::joined(crowd.errors());
        return i + 1;
      }
      peak.sample();
      if (peak.threads > threads_before + kExtraThreads) {
        ADD_FAILURE() << "a thread per waiter? " << peak.threads << " threads after " << i + 1 << " waiters, "
                      << threads_before << " before: " << wakeups::thread_names();
        return i + 1;
      }
    }
    return n;
  }
};

TEST_P(AsyncWaiters, ManyWaitOnOneNameWithoutAThreadEach) {
  wakeups::raise_descriptor_limit();
  const std::size_t n = waiters_wanted();
  const auto name = this->name("crowd");
  // The warm-up: the client's pool and the backend's I/O threads start before the count.
  {
    auto warm = client().mutex(name);
    auto lease = warm.lock_async().get();
    ASSERT_TRUE(lease.has_value());
  }
  // The holder has a client of its own (on etcd, a client's own holder and waiters share one
  // turn on the name inside the client: none of them would wait on the server).
  auto holder_client = connect();
  auto holder = holder_client.mutex(name);
  holder.lock();
  wakeups::AsyncCrowd crowd(n);
  const std::size_t threads_before = wakeups::thread_ids().size();
  const std::string names_before = wakeups::thread_names();
  const long rss_before = wakeups::rss_kib();
  Peak peak;
  peak.sample();

  const auto queue_start = Clock::now();
  const std::size_t queued_count = queue(crowd, name, n, threads_before, peak);
  ASSERT_EQ(queued_count, n);
  const double queue_seconds = std::chrono::duration<double>(Clock::now() - queue_start).count();
  // Until every acquire sleeps (the process's threads stay put for half a second).
  std::vector<pid_t> tids = wakeups::thread_ids();
  std::erase(tids, wakeups::this_thread_id());
  std::vector<long> switches;
  wakeups::wait_until_quiet([&] { return wakeups::switches_of(tids); }, nullptr, switches);
  peak.sample();
  const long rss_queued = wakeups::rss_kib();
  const auto queued = client().inspect(name);
  ASSERT_EQ(queued.holders.size(), 1u);
  ASSERT_EQ(queued.waiters.size(), visible(n));
  ASSERT_EQ(crowd.admitted(), 0u) << "admitted while the name was held";
  const double kib_per_waiter = static_cast<double>(rss_queued - rss_before) / static_cast<double>(n);
  std::printf(
      "[ async    ] %s: %zu async waiters queued in %.1f s; threads %zu before, %zu with them queued [%s]; "
      "before: [%s]; client memory %.2f KiB per waiter (RSS %ld -> %ld KiB)\n",
      GetParam().label.c_str(), n, queue_seconds, threads_before, peak.threads, wakeups::thread_names().c_str(),
      names_before.c_str(), kib_per_waiter, rss_before, rss_queued);

  // One release at a time: exactly one admission each, the next in queue order (a hold's token
  // is its entry's, but on consul:// where it is the lock key's index: there the queue inspect
  // shows at each checkpoint tells the order; etcd's line inside the client is not shown).
  const bool tokens_name_entries = url().rfind("consul:", 0) != 0 && !line_inside_client();
  std::uint64_t last_token = 0;
  const std::size_t checkpoint = std::max<std::size_t>(1, n / 10);
  const auto drain_start = Clock::now();
  holder.unlock();
  for (std::size_t k = 0; k < n; ++k) {
    const auto index = crowd.wait_for_admission(k, 60s);
    ASSERT_TRUE(index.has_value()) << "admission " << k << " did not come; " << crowd.errors().size() << " errors";
    auto lease = crowd.take(*index);
    ASSERT_TRUE(lease.has_value()) << "admission " << k << " holds nothing";
    if (k % checkpoint == 0 || k + 1 == n) {
      const auto now = client().inspect(name);
      ASSERT_EQ(now.holders.size(), 1u) << "after admission " << k;
      // etcd: this client holds now, with its one key of the name: its next waiter has none yet.
      ASSERT_EQ(now.waiters.size(), line_inside_client() ? 0 : n - k - 1) << "after admission " << k;
      for (std::size_t w = 0; w < now.waiters.size() && !line_inside_client(); ++w) {
        ASSERT_EQ(now.waiters[w].fencing_token, queued.waiters[k + 1 + w].fencing_token) << "waiter moved";
      }
    }
    ASSERT_EQ(crowd.admitted(), k + 1) << "a second admission while admission " << k << " holds";
    if (tokens_name_entries) {
      ASSERT_EQ(lease->fencing_token(), queued.waiters[k].fencing_token) << "admitted out of order: " << k;
    }
    ASSERT_GT(lease->fencing_token(), last_token) << "admission " << k;
    last_token = lease->fencing_token();
    peak.sample();
    lease.reset();  // the release that admits the next
  }
  const double drain_seconds = std::chrono::duration<double>(Clock::now() - drain_start).count();
  std::printf("[ async    ] %s: %zu admitted one at a time in %.1f s (%.0f us per handoff); peak %zu threads\n",
              GetParam().label.c_str(), n, drain_seconds, drain_seconds * 1e6 / static_cast<double>(n), peak.threads);
  EXPECT_LE(peak.threads, threads_before + kExtraThreads) << "threads now: " << wakeups::thread_names();
#if !defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's shadow memory and quarantine inflate RSS: printed above, not judged.
  EXPECT_LT(kib_per_waiter, kKibPerWaiterBound) << "client memory per waiting acquire";
#endif
}

INSTANTIATE_TEST_SUITE_P(Backends, AsyncWaiters, ::testing::ValuesIn(conformance::backend_params()),
                         conformance::param_label);

}  // namespace
