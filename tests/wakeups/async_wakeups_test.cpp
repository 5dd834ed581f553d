// SPDX-License-Identifier: Apache-2.0
// wakeups_test.cpp's measurement with async waiters (issue 26): 1000 lock_async() on one held
// name, one release, and the server's own counters (see wakeups_test.cpp for what each backend
// counts) say that it woke exactly one waiter. A waiter here has no thread: the wake-up comes
// from the backend's event (watch, Pub/Sub message, blocking query, byte watch) and runs the next
// look on the client's pool. file:// has no server to count on: the threads of this process that
// ran after the release are printed, the one admission and the queue order are checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "conformance/support.hpp"
#include "wakeups/async_crowd.hpp"
#include "wakeups/probes.hpp"

namespace {

using namespace std::chrono_literals;
using namespace wakeups;
using Clock = std::chrono::steady_clock;

class AsyncWakeups : public conformance::Conformance {};

TEST_P(AsyncWakeups, OneReleaseWakesOneOfAThousandAsyncWaiters) {
  const auto name = this->name("async-herd");
  // The server may still be busy with the blocking count's thousand waiters leaving (the Consul
  // stand-in answers one request at a time: the first connect here once timed out): until it
  // answers again.
  ASSERT_TRUE(eventually(
      [&] {
        try {
          client();
          return true;
        } catch (const turnstile::BackendUnavailable&) {
          return false;
        }
      },
      120s));
  const auto plan = herd_plan(url(), name);  // etcd: a client per waiter (see there)
  ASSERT_EQ(plan.problem(url()), "");
  // A thousand on every backend again: a Consul client's waiters on one queue share one blocking
  // query (one connection, not one each), so the stand-in no longer serves a thousand waiting
  // queries on a thread each while the joins come in.
  const std::size_t waiters = plan.waiters;
  std::optional<turnstile::Client> own_holder_client;
  if (plan.client_per_waiter) own_holder_client.emplace(connect(plan.options));
  auto& client = own_holder_client ? *own_holder_client : this->client();
  auto holder = client.mutex(name);
  holder.lock();
  const long rss_before = rss_kib();

  std::vector<turnstile::Client> clients;  // before the crowd: they outlive its acquires
  clients.reserve(plan.client_per_waiter ? waiters : 0);
  AsyncCrowd crowd(waiters);
  const auto queue_start = Clock::now();
  for (std::size_t i = 0; i < waiters; ++i) {
    if (plan.client_per_waiter) clients.push_back(connect(plan.options));
    crowd.add((plan.client_per_waiter ? clients.back() : client).mutex(name));
    // In waves of 50, as wakeups_test.cpp: what is measured is the release, not the joins.
    if ((i + 1) % 50 == 0 || i + 1 == waiters) {
      ASSERT_TRUE(wait_for_waiters(name, i + 1, 60s))
          << "queued: " << waiter_count(name) << " of " << i + 1 << "; acquires failed: " << joined(crowd.errors());
    }
  }
  const double queue_seconds = std::chrono::duration<double>(Clock::now() - queue_start).count();
  const auto queued = client.inspect(name);
  ASSERT_EQ(queued.holders.size(), 1u);
  ASSERT_EQ(queued.waiters.size(), waiters);

  // Every thread of the process but this one (which waits for the admission below).
  std::vector<pid_t> tids = thread_ids();
  std::erase(tids, this_thread_id());
  const auto switches = [&] { return switches_of(tids); };
  std::vector<long> before;
  const Counts server_before = wait_until_quiet(switches, plan.server.get(), before);
  const long rss_queued = rss_kib();
  ASSERT_EQ(crowd.admitted(), 0u) << "admitted while the name was held";
  // ZooKeeper: this test's waiters share one session, so the server fires one watch at a release
  // whoever watches (wakeups_test.cpp): what makes it one waiter woken is that each watches the
  // entry just ahead of it, one watched path per waiter (wchs).
  const std::string watched = plan.scheme == "zk" ? ask(host_port(url()), "wchs") : "";

  holder.unlock();
  ASSERT_TRUE(crowd.wait_for_admission(0, 20s)) << "nobody admitted after the release";
  std::this_thread::sleep_for(1s);  // room for any other waiter to wake
  const std::size_t threads_ran = changed_count(before, switches());
  const auto counts = plan.server ? plan.server->since(server_before) : Counts{};
  const auto held = client.inspect(name);

  std::printf(
      "[ wakeups  ] %s async: %zu waiters%s queued in %.1f s; after one release %zu of the process's %zu other "
      "threads ran",
      GetParam().label.c_str(), waiters, plan.client_per_waiter ? " (a client each)" : "", queue_seconds, threads_ran,
      tids.size());
  if (plan.server)
    std::printf("; server: %g %s, %g %s", counts.woken, plan.server->woken_means(), counts.requests,
                plan.server->requests_mean());
  std::printf("; client memory %.2f KiB per waiter (RSS %ld -> %ld KiB)\n",
              static_cast<double>(rss_queued - rss_before) / static_cast<double>(waiters), rss_before, rss_queued);
  EXPECT_EQ(crowd.admitted(), 1u) << "one release admits one waiter";
  for (const auto& error : crowd.errors()) ADD_FAILURE() << error;
  EXPECT_EQ(order_change(queued, held), "");
  // Exactly one, as with blocking waiters: a herd would show as hundreds.
  if (plan.server) {
    EXPECT_EQ(counts.woken, 1) << plan.server->woken_means();
  }
  if (plan.scheme == "zk") {
    EXPECT_GE(number_after(watched, "connections watching"), static_cast<double>(waiters))
        << "paths watched while the thousand waited (wchs): " << watched;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, AsyncWakeups, ::testing::ValuesIn(conformance::backend_params()),
                         conformance::param_label);

}  // namespace
