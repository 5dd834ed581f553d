// SPDX-License-Identifier: Apache-2.0
// Metrics snapshots in Prometheus' text format (exact text, label escapes), the histograms'
// buckets, the name label's cap, and events as JSON lines.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <utility>

#include "core/telemetry.hpp"
#include "turnstile/metrics.hpp"
#include "turnstile/turnstile.hpp"

namespace {

using turnstile::Event;
using turnstile::EventKind;
using turnstile::Metrics;
using namespace std::chrono_literals;
namespace detail = turnstile::detail;

Metrics small_snapshot() {
  Metrics::Family lost{
      .name = "turnstile_holds_lost_total",
      .help = "Holds lost.",
      .type = Metrics::Type::counter,
      .series = {{.labels = {{"backend", "redis"}, {"cause", "failover"}}, .value = 3, .histogram = {}}}};
  Metrics::Family pending{.name = "turnstile_background_removals_pending",
                          .help = "Pending.",
                          .type = Metrics::Type::gauge,
                          .series = {{.labels = {}, .value = 0, .histogram = {}}}};
  Metrics::Histogram waits{.upper_bounds = {0.001, 0.5}, .counts = {2, 1, 1}, .sum = 1.25};
  Metrics::Family wait{.name = "turnstile_acquire_wait_seconds",
                       .help = "Waits.",
                       .type = Metrics::Type::histogram,
                       .series = {{.labels = {{"primitive", "mutex"}}, .value = 0, .histogram = waits}}};
  return Metrics({lost, pending, wait});
}

TEST(Metrics, RendersTheTextExpositionFormat) {
  EXPECT_EQ(small_snapshot().prometheus_text(),
            "# HELP turnstile_holds_lost_total Holds lost.\n"
            "# TYPE turnstile_holds_lost_total counter\n"
            "turnstile_holds_lost_total{backend=\"redis\",cause=\"failover\"} 3\n"
            "# HELP turnstile_background_removals_pending Pending.\n"
            "# TYPE turnstile_background_removals_pending gauge\n"
            "turnstile_background_removals_pending 0\n"
            "# HELP turnstile_acquire_wait_seconds Waits.\n"
            "# TYPE turnstile_acquire_wait_seconds histogram\n"
            "turnstile_acquire_wait_seconds_bucket{primitive=\"mutex\",le=\"0.001\"} 2\n"
            "turnstile_acquire_wait_seconds_bucket{primitive=\"mutex\",le=\"0.5\"} 3\n"
            "turnstile_acquire_wait_seconds_bucket{primitive=\"mutex\",le=\"+Inf\"} 4\n"
            "turnstile_acquire_wait_seconds_sum{primitive=\"mutex\"} 1.25\n"
            "turnstile_acquire_wait_seconds_count{primitive=\"mutex\"} 4\n");
}

TEST(Metrics, EscapesLabelValuesAndHelp) {
  Metrics::Family family{.name = "turnstile_holds_lost_total",
                         .help = "back\\slash and\nnew line",
                         .type = Metrics::Type::counter,
                         .series = {{.labels = {{"name", "a\"b\\c\nd"}}, .value = 1, .histogram = {}}}};
  EXPECT_EQ(Metrics({family}).prometheus_text(),
            "# HELP turnstile_holds_lost_total back\\\\slash and\\nnew line\n"
            "# TYPE turnstile_holds_lost_total counter\n"
            "turnstile_holds_lost_total{name=\"a\\\"b\\\\c\\nd\"} 1\n");
}

TEST(Metrics, SumsTheSeriesThatMatch) {
  const auto metrics = small_snapshot();
  EXPECT_EQ(metrics.value("turnstile_holds_lost_total"), 3);
  EXPECT_EQ(metrics.value("turnstile_holds_lost_total", {{"cause", "failover"}}), 3);
  EXPECT_EQ(metrics.value("turnstile_holds_lost_total", {{"cause", "entry_gone"}}), 0);
  EXPECT_EQ(metrics.histogram_count("turnstile_acquire_wait_seconds", {{"primitive", "mutex"}}), 4u);
  EXPECT_EQ(metrics.histogram_count("turnstile_holds_lost_total"), 0u);  // not a histogram
  EXPECT_EQ(metrics.value("turnstile_no_such_metric"), 0);
}

TEST(Metrics, BucketsIncludeTheirUpperBound) {
  // The renewals' bounds: 0.5 ms, 1 ms, 2.5 ms ... 2.5 s.
  detail::HistogramCells<detail::kRoundTripBounds> cells;
  cells.observe(-5ns);       // a clock that went back: counted as zero
  cells.observe(500'000ns);  // on the first bound: le="0.0005"
  cells.observe(500'001ns);  // just past it: le="0.001"
  cells.observe(1'000'000ns);
  cells.observe(10s);  // past every bound: +Inf
  const auto histogram = cells.read();
  std::vector<std::uint64_t> expected(detail::kRoundTripBounds.size() + 1, 0);
  expected[0] = 2;
  expected[1] = 2;
  expected.back() = 1;
  EXPECT_EQ(histogram.counts, expected);
  ASSERT_EQ(histogram.upper_bounds.size(), detail::kRoundTripBounds.size());
  EXPECT_DOUBLE_EQ(histogram.upper_bounds.front(), 0.0005);
  EXPECT_DOUBLE_EQ(histogram.upper_bounds.back(), 2.5);
  EXPECT_DOUBLE_EQ(histogram.sum, (500'000 + 500'001 + 1'000'000 + 10'000'000'000.0) / 1e9);
  EXPECT_EQ(histogram.count(), 5u);
}

// An acquire of `name` counted as admitted, so that its series show.
void count_acquire(detail::Telemetry& telemetry, const std::string& name) {
  const auto now = turnstile::SteadyClock::now();
  telemetry.acquire_ended(telemetry.cells(name, 0), 0, name, detail::AcquireOutcome::admitted, now, now);
}

TEST(Metrics, NameLabelIsOptInAndCapped) {
  detail::Telemetry unnamed("file", false, {});
  count_acquire(unnamed, "a");
  count_acquire(unnamed, "b");
  const auto plain = unnamed.snapshot(0);
  EXPECT_EQ(plain.prometheus_text().find("name=\""), std::string::npos);
  EXPECT_EQ(plain.histogram_count("turnstile_acquire_wait_seconds", {{"outcome", "admitted"}}), 2u);

  detail::Telemetry named("file", true, {});
  const auto extra = 5;
  for (std::size_t i = 0; i < detail::Telemetry::kMaxNames + extra; ++i) count_acquire(named, "n/" + std::to_string(i));
  count_acquire(named, "n/0");  // a name seen before the cap keeps its own series
  const auto metrics = named.snapshot(0);
  const auto* holds = metrics.family("turnstile_hold_seconds");
  ASSERT_NE(holds, nullptr);
  EXPECT_EQ(holds->series.size(), detail::Telemetry::kMaxNames + 1);  // the first 1,000 and "/other"
  const auto admitted = [&](const std::string& name) {
    return metrics.histogram_count("turnstile_acquire_wait_seconds", {{"name", name}, {"outcome", "admitted"}});
  };
  EXPECT_EQ(admitted("/other"), static_cast<std::uint64_t>(extra));
  EXPECT_EQ(admitted("n/0"), 2u);
  EXPECT_EQ(admitted("n/999"), 1u);
  EXPECT_EQ(admitted("n/1000"), 0u);
}

// A stop requested before the call ends the acquire as surely as one requested while it waits:
// both are counted as stopped (the early one was counted nowhere, so stops went missing).
TEST(Metrics, AnAcquireStoppedBeforeTheCallIsCountedAsStopped) {
  char dir[] = "/tmp/turnstile-metrics-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  {
    auto client = turnstile::Client::connect(std::string("file://") + dir);
    std::stop_source stop;
    stop.request_stop();
    auto mutex = client.mutex("job");
    EXPECT_FALSE(mutex.lock(stop.get_token()));
    auto semaphore = client.semaphore("pool", 1);
    EXPECT_FALSE(semaphore.acquire(1, stop.get_token()));
    auto counter = client.permit_counter("quota");
    EXPECT_FALSE(counter.acquire(1, stop.get_token()));
    // The async forms end at once too, and are counted the same.
    turnstile::AsyncOptions stopped_already;
    stopped_already.stop = stop.get_token();
    EXPECT_FALSE(mutex.lock_async(stopped_already).get());
    EXPECT_FALSE(semaphore.acquire_async(1, stopped_already).get());
    EXPECT_FALSE(counter.acquire_async(1, stopped_already).get());
    const auto metrics = client.metrics();
    for (const char* primitive : {"mutex", "semaphore", "permit_counter"}) {
      const auto stopped =
          metrics.histogram_count("turnstile_acquire_wait_seconds", {{"primitive", primitive}, {"outcome", "stopped"}});
      EXPECT_EQ(stopped, 2u) << primitive << "\n" << metrics.prometheus_text();
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Metrics, HoldsGaugeIsAdmittedMinusEnded) {
  detail::Telemetry telemetry("redis", false, {});
  count_acquire(telemetry, "a");
  count_acquire(telemetry, "a");
  telemetry.cells("a", 0).hold.observe(1ms);
  const auto metrics = telemetry.snapshot(2);
  EXPECT_EQ(metrics.value("turnstile_holds", {{"backend", "redis"}, {"primitive", "mutex"}}), 1);
  EXPECT_EQ(metrics.value("turnstile_background_removals_pending"), 2);
}

TEST(Metrics, BackendReportsCountRenewalsAndConnections) {
  std::vector<EventKind> told;
  detail::Telemetry telemetry("etcd", false, [&](const Event& event) { told.push_back(event.kind); });
  auto& reports = telemetry.backend_reports();
  reports.connected(false);
  reports.renewed(3ms);
  reports.renewal_failed("no answer");
  reports.opened_another();            // after a first connection: a reconnect
  telemetry.wait_until_events_told();  // the hook runs on the telemetry's own thread
  const auto metrics = telemetry.snapshot(0);
  EXPECT_EQ(metrics.value("turnstile_connections_total"), 2);
  EXPECT_EQ(metrics.value("turnstile_reconnects_total"), 1);
  EXPECT_EQ(metrics.histogram_count("turnstile_renewal_seconds", {{"backend", "etcd"}}), 1u);
  EXPECT_EQ(metrics.value("turnstile_renewal_failures_total"), 1);
  EXPECT_EQ(told, (std::vector<EventKind>{EventKind::connected, EventKind::renewed, EventKind::renewal_failed,
                                          EventKind::reconnected}));
}

// Red team (issue 28, F1): the hook ran on the thread where the event happened, so a hook that
// blocked (`run --events -` writing to a pipe nobody read) stopped the renewal thread until the
// server expired the holds: two holders. Telling never waits for the hook now; past the bound,
// events are dropped and counted.
TEST(Metrics, ABlockedHookHoldsUpNoTellerAndWhatOverflowsIsDroppedAndCounted) {
  std::promise<void> unblock;
  const auto unblocked = unblock.get_future().share();
  std::atomic<bool> entered{false};
  std::atomic<std::size_t> told{0};
  detail::Telemetry telemetry("redis", false, [&, unblocked](const Event&) {
    entered = true;
    unblocked.wait();
    ++told;
  });
  auto& reports = telemetry.backend_reports();
  const std::size_t extra = 5;
  auto teller = std::async(std::launch::async, [&] {
    reports.renewed(1ms);
    while (!entered) std::this_thread::yield();  // the first is in the hook: the rest wait
    for (std::size_t i = 0; i < detail::EventQueue::kMaxWaiting + extra; ++i) reports.renewed(1ms);
  });
  const bool returned = teller.wait_for(20s) == std::future_status::ready;
  EXPECT_TRUE(returned) << "telling waited for a blocked hook";
  EXPECT_EQ(telemetry.snapshot(0).value("turnstile_events_dropped_total"), static_cast<double>(extra));
  unblock.set_value();
  telemetry.wait_until_events_told();
  EXPECT_EQ(told.load(), detail::EventQueue::kMaxWaiting + 1);
}

// In a child of fork() the hook's thread is not there: telling drops the event, and the end of
// the client's telemetry joins nothing (joining the parent's thread would wait for good).
TEST(Metrics, AForkedChildDropsItsEventsAndItsEndDoesNotHang) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "fork() of a process with threads, under ThreadSanitizer";
#endif
  std::atomic<int> told{0};
  auto telemetry = std::make_unique<detail::Telemetry>("redis", false, [&](const Event&) { ++told; });
  telemetry->backend_reports().renewed(1ms);
  telemetry->wait_until_events_told();
  const pid_t child = fork();
  if (child == 0) {
    telemetry->backend_reports().renewed(1ms);
    const bool dropped = telemetry->snapshot(0).value("turnstile_events_dropped_total") == 1;
    telemetry.reset();
    _exit(dropped ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  bool ended = false;
  for (int tenth = 0; tenth < 100 && !ended; ++tenth) {
    ended = waitpid(child, &status, WNOHANG) == child;
    if (!ended) std::this_thread::sleep_for(100ms);
  }
  if (!ended) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  EXPECT_TRUE(ended) << "the child's end waited for a thread it does not have";
  EXPECT_TRUE(ended && WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's event was not dropped";
  EXPECT_EQ(told.load(), 1);
}

Event sample_event() {
  Event event;
  event.kind = EventKind::lost;
  event.time = std::chrono::system_clock::time_point(1'795'803'431'915'473us);
  event.backend = "zookeeper";
  event.primitive = "mutex";
  event.name = "jobs/\"nightly\"";
  event.fencing_token = 42;
  event.outcome = "session_expired";
  event.reason = "its ZooKeeper session expired";
  event.duration = 1500ms;
  return event;
}

TEST(Events, JsonLineHasEveryFieldThatIsSet) {
  EXPECT_EQ(turnstile::to_json_line(sample_event()),
            "{\"time\":\"2026-11-27T18:17:11.915473Z\",\"event\":\"lost\",\"backend\":\"zookeeper\","
            "\"primitive\":\"mutex\",\"name\":\"jobs/\\\"nightly\\\"\",\"fencing_token\":42,"
            "\"outcome\":\"session_expired\",\"reason\":\"its ZooKeeper session expired\","
            "\"duration_seconds\":1.5}\n");
  Event bare;
  bare.kind = EventKind::connected;
  bare.time = std::chrono::system_clock::time_point(0us);
  bare.reason = "bad \xff byte";
  EXPECT_EQ(
      turnstile::to_json_line(bare),
      "{\"time\":\"1970-01-01T00:00:00.000000Z\",\"event\":\"connected\",\"reason\":\"bad \xef\xbf\xbd byte\"}\n");
}

TEST(Events, SinkWritesOneLinePerEvent) {
  std::array<int, 2> pipe_fds{};
  ASSERT_EQ(::pipe(pipe_fds.data()), 0);
  auto sink = turnstile::json_lines_sink(pipe_fds[1]);
  sink(sample_event());
  sink(sample_event());
  ::close(pipe_fds[1]);
  std::string read_back;
  std::array<char, 4096> buffer{};
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer.data(), buffer.size())) > 0;) read_back.append(buffer.data(), n);
  ::close(pipe_fds[0]);
  const auto line = turnstile::to_json_line(sample_event());
  EXPECT_EQ(read_back, line + line);
}

// A pipe nobody reads, filled to the last byte; its write end blocking again, so that only the
// sink's own bound can end a write into it.
class FullPipe {
 public:
  FullPipe() {
    EXPECT_EQ(::pipe(fds_.data()), 0);
    EXPECT_EQ(::fcntl(fds_[1], F_SETFL, O_NONBLOCK), 0);
    for (const std::string block(4096, 'x'); ::write(fds_[1], block.data(), block.size()) > 0;) filled_ += 4096;
    EXPECT_EQ(::fcntl(fds_[1], F_SETFL, 0), 0);
    EXPECT_EQ(::fcntl(fds_[0], F_SETFL, O_NONBLOCK), 0);
  }
  ~FullPipe() {
    for (const int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  FullPipe(const FullPipe&) = delete;
  FullPipe& operator=(const FullPipe&) = delete;
  int write_end() const { return fds_[1]; }
  std::size_t filled() const { return filled_; }
  // Reads what the pipe holds now (at most `most` bytes).
  std::string drain(std::size_t most = SIZE_MAX) {
    std::string read_back;
    std::array<char, 4096> buffer{};
    while (read_back.size() < most) {
      const auto n = ::read(fds_[0], buffer.data(), std::min(buffer.size(), most - read_back.size()));
      if (n <= 0) break;
      read_back.append(buffer.data(), static_cast<std::size_t>(n));
    }
    return read_back;
  }
  // Closes the write end and reads the rest.
  std::string rest() {
    ::close(std::exchange(fds_[1], -1));
    return drain();
  }

 private:
  std::array<int, 2> fds_{-1, -1};
  std::size_t filled_ = 0;
};

// A reader that takes nothing (a full pipe nobody reads) costs the line, never a hang: the
// client's later events and its end must not wait on it. Once the reader drains the pipe, the
// next line is written whole. The same write serves the CLI's messages (complain()).
TEST(Events, ASinkWhoseReaderTakesNothingDropsTheLineInsteadOfWaiting) {
  FullPipe pipe;
  auto sink = turnstile::json_lines_sink(pipe.write_end());
  auto told = std::async(std::launch::async, [&] { sink(sample_event()); });
  ASSERT_EQ(told.wait_for(60s), std::future_status::ready) << "the sink waited for a reader that never read";
  const auto drained = pipe.drain();
  EXPECT_EQ(drained.find('{'), std::string::npos) << "a line went into a pipe that had no room for it";
  EXPECT_GE(drained.size(), pipe.filled());
  sink(sample_event());
  EXPECT_EQ(pipe.rest(), turnstile::to_json_line(sample_event()));
}

// A line longer than the room a pipe has left: a blocking write of it all waited for good for
// the rest (no reader), now the part that fits is written and the rest given up after a second.
// The torn line is ended before the next one, which arrives whole on a line of its own.
TEST(Events, ALineCutShortIsEndedBeforeTheNextOne) {
  FullPipe pipe;
  ASSERT_EQ(pipe.drain(4096).size(), 4096u);  // room for one page, no more
  auto sink = turnstile::json_lines_sink(pipe.write_end());
  auto long_event = sample_event();
  long_event.reason = std::string(6000, 'r');  // a line of over 6,000 bytes
  auto told = std::async(std::launch::async, [&] { sink(long_event); });
  ASSERT_EQ(told.wait_for(60s), std::future_status::ready) << "the sink waited for room the pipe never had";
  const auto drained = pipe.drain();
  const auto torn_at = drained.find('{');
  ASSERT_NE(torn_at, std::string::npos) << "nothing of the long line was written";
  EXPECT_EQ(drained.find('\n', torn_at), std::string::npos) << "the long line was not cut short: nothing tested";
  sink(sample_event());
  EXPECT_EQ(pipe.rest(), "\n" + turnstile::to_json_line(sample_event())) << "the next line was glued to the torn one";
}

TEST(Events, NamesEveryKind) {
  EXPECT_STREQ(turnstile::to_string(EventKind::not_acquired), "not_acquired");
  EXPECT_STREQ(turnstile::to_string(EventKind::renewal_failed), "renewal_failed");
  EXPECT_STREQ(turnstile::to_string(EventKind::reconnected), "reconnected");
}

}  // namespace
