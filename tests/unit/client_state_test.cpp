// SPDX-License-Identifier: Apache-2.0
// A client's background release (ClientState over GuaranteedRemoval), through the internal
// headers, with a backend whose release answers as told: no server involved.
#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend_loader.hpp"
#include "core/client_state.hpp"
#include "core/url.hpp"
#include "turnstile/error.hpp"

namespace {

using namespace std::chrono_literals;
using namespace turnstile::detail;

// A hold whose release throws BackendUnavailable `failures` times (forever when negative).
class FlakyHold final : public BackendHold {
 public:
  FlakyHold(std::atomic<int>& calls, int failures) : calls_(calls), failures_(failures) {}
  std::uint64_t fencing_token() const override { return 7; }
  void downgrade() override {}
  void release() override {
    const int call = ++calls_;
    if (failures_ < 0 || call <= failures_) throw turnstile::BackendUnavailable("no answer");
  }

 private:
  std::atomic<int>& calls_;
  int failures_;
};

// Only holds are made by hand here: the queue and counter calls are never made.
class NoBackend final : public Backend {
 public:
  std::unique_ptr<QueuePlace> join(const QueueRequest&, bool, turnstile::Deadline, Standing&) override {
    throw turnstile::BackendUnavailable("not in this test");
  }
  std::unique_ptr<CounterLine> counter_line(const std::string&, std::int64_t, const std::stop_token&) override {
    throw turnstile::BackendUnavailable("not in this test");
  }
  turnstile::Inspection inspect(const std::string&, turnstile::Deadline) override { return {}; }
  bool counter_try_set(const std::string&, std::int64_t) override { return false; }
  std::int64_t counter_add(const std::string&, std::int64_t) override { return 0; }
  std::optional<std::int64_t> counter_get(const std::string&) override { return std::nullopt; }
  std::int64_t counter_drain(const std::string&) override { return 0; }
};

struct Reports {
  std::mutex mutex;
  std::vector<std::string> messages;
  turnstile::ClientOptions options() {
    turnstile::ClientOptions options;
    options.unlock_without_waiting = true;
    options.error_handler = [this](const turnstile::Error& error) {
      std::lock_guard lock(mutex);
      messages.push_back(error.what());
    };
    return options;
  }
};

std::shared_ptr<ClientState> make_state(Reports& reports) {
  return std::make_shared<ClientState>("test://", std::make_unique<NoBackend>(), reports.options(), true);
}

TEST(ClientStateRelease, AFailedReleaseIsRetriedInTheBackgroundUntilDone) {
  Reports reports;
  auto state = make_state(reports);
  std::atomic<int> calls{0};
  HoldRecord record(state, "x", 1, std::make_unique<FlakyHold>(calls, 2),
                    state->new_loss_signal("x", metered(Primitive::mutex)));
  EXPECT_THROW(record.release(), turnstile::BackendUnavailable);
  ASSERT_EQ(calls, 1);
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (calls < 3 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(calls, 3);  // 100 ms, then 200 ms later: done
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(calls, 3);  // and never again
  std::lock_guard lock(reports.mutex);
  EXPECT_TRUE(reports.messages.empty());
}

TEST(ClientStateRelease, AReleaseNotDoneByTheClientsEndIsTriedOnceMoreAndReported) {
  Reports reports;
  std::atomic<int> calls{0};
  {
    auto state = make_state(reports);
    HoldRecord record(state, "y", 1, std::make_unique<FlakyHold>(calls, -1),
                      state->new_loss_signal("y", metered(Primitive::mutex)));
    EXPECT_THROW(record.release(), turnstile::BackendUnavailable);
  }                     // the record (released) and then the state end here
  EXPECT_GE(calls, 2);  // the caller's try and the end's
  std::lock_guard lock(reports.mutex);
  ASSERT_EQ(reports.messages.size(), 1u);
  EXPECT_NE(reports.messages[0].find("the hold on 'y'"), std::string::npos) << reports.messages[0];
}

TEST(ClientStateRelease, ALossFoundByTheBackgroundReleaseIsReportedOnce) {
  Reports reports;
  auto state = make_state(reports);
  std::atomic<int> calls{0};
  class LostOnRetry final : public BackendHold {
   public:
    explicit LostOnRetry(std::atomic<int>& calls) : calls_(calls) {}
    std::uint64_t fencing_token() const override { return 9; }
    void downgrade() override {}
    void release() override {
      if (++calls_ == 1) throw turnstile::BackendUnavailable("no answer");
      throw turnstile::HoldLost("the entry was someone else's");
    }

   private:
    std::atomic<int>& calls_;
  };
  HoldRecord record(state, "z", 1, std::make_unique<LostOnRetry>(calls),
                    state->new_loss_signal("z", metered(Primitive::mutex)));
  EXPECT_THROW(record.release(), turnstile::BackendUnavailable);
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (calls < 2 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(400ms);
  EXPECT_EQ(calls, 2);
  std::lock_guard lock(reports.mutex);
  ASSERT_EQ(reports.messages.size(), 1u);
  EXPECT_NE(reports.messages[0].find("someone else's"), std::string::npos) << reports.messages[0];
}

// A hold whose pipelined release is answered later, from another thread, by answer(): as a
// backend that sends the release and hears back on its own thread. Its plain release()
// (the background retry's) succeeds.
class DeferredHold final : public BackendHold {
 public:
  DeferredHold(std::atomic<int>& plain_releases, std::shared_ptr<ReleaseDone> pending)
      : plain_releases_(plain_releases), pending_(std::move(pending)) {}
  std::uint64_t fencing_token() const override { return 11; }
  void downgrade() override {}
  void release() override { ++plain_releases_; }
  void release_pipelined(ReleaseDone done) override { *pending_ = std::move(done); }

 private:
  std::atomic<int>& plain_releases_;
  std::shared_ptr<ReleaseDone> pending_;
};

// Runs the pending `done` on another thread after `delay`, with `error`.
std::thread answer_later(std::shared_ptr<BackendHold::ReleaseDone> pending, std::chrono::milliseconds delay,
                         std::exception_ptr error) {
  return std::thread([pending, delay, error] {
    std::this_thread::sleep_for(delay);
    auto done = std::move(*pending);
    done(error);
  });
}

// unlock()'s release (a hold record's end) does not wait: its failure comes later, from the
// backend's thread, is reported and retried by the background release. (Before issue 25 the
// record's end called release() and waited.)
TEST(ClientStateRelease, AnUnlocksReleaseIsSentAndItsLaterFailureReportedAndRetried) {
  Reports reports;
  auto state = make_state(reports);
  std::atomic<int> plain{0};
  auto pending = std::make_shared<BackendHold::ReleaseDone>();
  {
    HoldRecord record(state, "p", 1, std::make_unique<DeferredHold>(plain, pending),
                      state->new_loss_signal("p", metered(Primitive::mutex)));
  }
  ASSERT_TRUE(*pending) << "the record's end did not send a pipelined release";
  EXPECT_EQ(plain, 0) << "the record's end waited for a plain release";
  answer_later(pending, 0ms, std::make_exception_ptr(turnstile::BackendUnavailable("link cut"))).join();
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (plain < 1 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(plain, 1) << "the failed pipelined release was not retried";
  std::lock_guard lock(reports.mutex);
  ASSERT_EQ(reports.messages.size(), 1u);
  EXPECT_NE(reports.messages[0].find("retried in the background"), std::string::npos) << reports.messages[0];
}

// The client's end waits (bounded) for the answers still due, so a release answered just after
// unlock() is handled (here: a failure, reported) before the client is gone.
TEST(ClientStateRelease, TheClientsEndWaitsForAPipelinedReleasesAnswer) {
  Reports reports;
  std::atomic<int> plain{0};
  auto pending = std::make_shared<BackendHold::ReleaseDone>();
  std::thread answer;
  {
    auto state = make_state(reports);
    {
      HoldRecord record(state, "q", 1, std::make_unique<DeferredHold>(plain, pending),
                        state->new_loss_signal("q", metered(Primitive::mutex)));
    }
    ASSERT_TRUE(*pending);
    answer = answer_later(pending, 300ms, std::make_exception_ptr(turnstile::HoldLost("gone")));
  }  // the state's end: the answer comes during its wait
  {
    std::lock_guard lock(reports.mutex);
    ASSERT_EQ(reports.messages.size(), 1u) << "the client ended before its release's answer";
    EXPECT_NE(reports.messages[0].find("gone"), std::string::npos) << reports.messages[0];
  }
  answer.join();
}

}  // namespace

namespace {

// A backend refers to its client's telemetry (its BackendReports): however a caller keeps the
// pieces connect_backend() gives, the telemetry lives exactly as long as the backend. Before,
// dropping ConnectedBackend::telemetry freed it under a live backend (three arm tests crashed).
TEST(ConnectedBackend, TheBackendKeepsTheTelemetryItReportsTo) {
  char dir[] = "/tmp/turnstile-connected-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  {
    auto connected = connect_backend(parse_url(std::string("file://") + dir + "/root"), turnstile::ClientOptions{});
    const std::weak_ptr<Telemetry> telemetry = connected.telemetry;
    connected.telemetry.reset();
    EXPECT_FALSE(telemetry.expired()) << "the telemetry went while its backend lived";
    connected.backend.reset();
    EXPECT_TRUE(telemetry.expired()) << "the telemetry outlived everything that refers to it";
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
