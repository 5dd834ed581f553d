// SPDX-License-Identifier: Apache-2.0
// Client::metrics() and the event hook on every backend: acquires counted by outcome, holds by
// their end, events in order with the hold's fencing token; renewals and connections on the
// network backends, none on file://.
#include <mutex>
#include <thread>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Event;
using turnstile::EventKind;
using turnstile::Metrics;

// Every event a client told, for the test to read back.
class EventLog {
 public:
  turnstile::EventHandler handler() {
    return [this](const Event& event) {
      std::lock_guard lock(mutex_);
      events_.push_back(event);
    };
  }
  // The events about `name`, in the order they were told.
  std::vector<Event> about(const std::string& name) const {
    std::lock_guard lock(mutex_);
    std::vector<Event> found;
    for (const auto& event : events_) {
      if (event.name == name) found.push_back(event);
    }
    return found;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

std::uint64_t waits(const Metrics& metrics, const char* primitive, const char* outcome) {
  return metrics.histogram_count("turnstile_acquire_wait_seconds", {{"primitive", primitive}, {"outcome", outcome}});
}

}  // namespace

TEST_P(Conformance, MetricsCountSemaphoreAcquiresHoldsAndEvents) {
  EventLog log;
  turnstile::ClientOptions options;
  options.ttl = 2s;
  options.on_event = log.handler();
  auto own = connect(options);
  const auto sem_name = name("s");
  auto semaphore = own.semaphore(sem_name, 1);

  auto lease = semaphore.acquire();
  const auto token = lease.fencing_token();
  EXPECT_FALSE(semaphore.try_acquire_for(200ms)) << "the only permit is held";
  std::stop_source stop;
  std::thread waiter([&] { EXPECT_FALSE(semaphore.acquire(1, stop.get_token())); });
  EXPECT_TRUE(wait_for_waiters(sem_name, 1));
  stop.request_stop();
  waiter.join();

  auto held = own.metrics();
  EXPECT_EQ(waits(held, "semaphore", "admitted"), 1u);
  EXPECT_EQ(waits(held, "semaphore", "timed_out"), 1u);
  EXPECT_EQ(waits(held, "semaphore", "stopped"), 1u);
  EXPECT_EQ(waits(held, "semaphore", "failed"), 0u);
  EXPECT_EQ(held.value("turnstile_holds", {{"primitive", "semaphore"}}), 1);
  EXPECT_EQ(held.histogram_count("turnstile_hold_seconds"), 0u);
  lease.release();

  const auto released = own.metrics();
  EXPECT_EQ(released.histogram_count("turnstile_hold_seconds", {{"primitive", "semaphore"}}), 1u);
  EXPECT_EQ(released.value("turnstile_holds", {{"primitive", "semaphore"}}), 0);
  EXPECT_EQ(released.value("turnstile_holds_lost_total"), 0);
  for (const auto& entry : released.families()) {
    for (const auto& series : entry.series) {
      ASSERT_FALSE(series.labels.empty()) << entry.name;
      EXPECT_EQ(series.labels.front().first, "backend");
    }
  }

  // The hook runs on the client's own thread: its events come a moment later.
  EXPECT_TRUE(eventually([&] { return log.about(sem_name).size() >= 4; }, 5s));
  const auto events = log.about(sem_name);
  ASSERT_EQ(events.size(), 4u);
  const std::vector<std::pair<EventKind, std::string>> expected{{EventKind::acquired, "admitted"},
                                                                {EventKind::not_acquired, "timed_out"},
                                                                {EventKind::not_acquired, "stopped"},
                                                                {EventKind::released, ""}};
  for (std::size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].kind, expected[i].first) << i;
    EXPECT_EQ(events[i].outcome, expected[i].second) << i;
    EXPECT_EQ(events[i].primitive, "semaphore") << i;
    EXPECT_FALSE(events[i].backend.empty()) << i;
  }
  EXPECT_EQ(events.front().fencing_token, token);
  EXPECT_EQ(events.back().fencing_token, token);
  EXPECT_EQ(events[1].fencing_token, 0u);
}

TEST_P(Conformance, MetricsCountMutexHoldsAndTheClientsOwnWork) {
  EventLog log;
  turnstile::ClientOptions options;
  options.ttl = 2s;
  options.on_event = log.handler();
  options.metrics_name_label = true;
  auto own = connect(options);
  const auto lock_name = name("m");
  auto mutex = own.mutex(lock_name);
  mutex.lock();
  const auto token = mutex.fencing_token();
  const auto renewals = [&] { return own.metrics().histogram_count("turnstile_renewal_seconds"); };
  // A network backend renews its session or lease within a TTL (2 s here); file:// never does.
  if (has_server()) {
    EXPECT_TRUE(eventually([&] { return renewals() > 0; }, 20s));
  }
  mutex.unlock();

  const auto metrics = own.metrics();
  EXPECT_EQ(metrics.histogram_count("turnstile_hold_seconds", {{"primitive", "mutex"}, {"name", lock_name}}), 1u);
  EXPECT_EQ(waits(metrics, "mutex", "admitted"), 1u);
  if (has_server()) {
    EXPECT_GE(metrics.value("turnstile_connections_total"), 1);
  } else {
    EXPECT_EQ(metrics.value("turnstile_connections_total"), 0);
    EXPECT_EQ(renewals(), 0u);
  }
  EXPECT_TRUE(eventually([&] { return log.about(lock_name).size() >= 2; }, 5s));
  const auto events = log.about(lock_name);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, EventKind::acquired);
  EXPECT_EQ(events[1].kind, EventKind::released);
  EXPECT_EQ(events[0].fencing_token, token);
  EXPECT_EQ(events[1].fencing_token, token);
  EXPECT_GT(events[1].duration.count(), 0);
  EXPECT_NE(metrics.prometheus_text().find("name=\"" + lock_name + "\""), std::string::npos);
}

}  // namespace conformance
