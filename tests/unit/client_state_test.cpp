// A client's background release (ClientState over GuaranteedRemoval), through the internal
// headers, with a backend whose release answers as told: no server involved.
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/client_state.hpp"
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
  HoldRecord record(state, "x", 1, std::make_unique<FlakyHold>(calls, 2), state->new_loss_signal("x"));
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
    HoldRecord record(state, "y", 1, std::make_unique<FlakyHold>(calls, -1), state->new_loss_signal("y"));
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
  HoldRecord record(state, "z", 1, std::make_unique<LostOnRetry>(calls), state->new_loss_signal("z"));
  EXPECT_THROW(record.release(), turnstile::BackendUnavailable);
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (calls < 2 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(400ms);
  EXPECT_EQ(calls, 2);
  std::lock_guard lock(reports.mutex);
  ASSERT_EQ(reports.messages.size(), 1u);
  EXPECT_NE(reports.messages[0].find("someone else's"), std::string::npos) << reports.messages[0];
}

}  // namespace
