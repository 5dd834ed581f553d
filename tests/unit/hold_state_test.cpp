// SPDX-License-Identifier: Apache-2.0
// The core's hold-state machine (LossSignal): held and suspended alternate until lost, which is
// final; every change is told once, in order, and a callback may release the hold it is told of.
#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <vector>

#include "core/backend.hpp"

namespace {

using turnstile::HoldState;
using turnstile::HoldStateChange;
using turnstile::detail::LossSignal;

struct Recorded {
  std::mutex mutex;
  std::vector<HoldStateChange> changes;
  int lost_calls = 0;
};

std::shared_ptr<LossSignal> recording_signal(Recorded& recorded) {
  auto callbacks =
      std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{[&recorded](const turnstile::Error&) {
                                                                            std::lock_guard lock(recorded.mutex);
                                                                            ++recorded.lost_calls;
                                                                          },
                                                                          [&recorded](const HoldStateChange& change) {
                                                                            std::lock_guard lock(recorded.mutex);
                                                                            recorded.changes.push_back(change);
                                                                          },
                                                                          nullptr});
  auto signal = std::make_shared<LossSignal>("a/name", callbacks);
  signal->set_fencing_token(7);
  return signal;
}

TEST(HoldState, SuspendAndResumeAlternateAndAreToldOnce) {
  Recorded recorded;
  auto signal = recording_signal(recorded);
  EXPECT_EQ(signal->state(), HoldState::held);
  signal->resume();  // already held: nothing to tell
  signal->suspend("connection down");
  signal->suspend("still down");
  EXPECT_EQ(signal->state(), HoldState::suspended);
  EXPECT_FALSE(signal->token().stop_requested()) << "suspended is not lost";
  signal->resume();
  EXPECT_EQ(signal->state(), HoldState::held);
  ASSERT_EQ(recorded.changes.size(), 2u);
  EXPECT_EQ(recorded.changes[0].state, HoldState::suspended);
  EXPECT_EQ(recorded.changes[0].reason, "connection down");
  EXPECT_EQ(recorded.changes[0].name, "a/name");
  EXPECT_EQ(recorded.changes[0].fencing_token, 7u);
  EXPECT_EQ(recorded.changes[1].state, HoldState::held);
  EXPECT_EQ(recorded.changes[1].reason, "");
  EXPECT_EQ(recorded.lost_calls, 0);
}

TEST(HoldState, LostIsFinal) {
  Recorded recorded;
  auto signal = recording_signal(recorded);
  const auto token = signal->token();
  signal->suspend("connection down");
  signal->lose("session expired");
  signal->resume();
  signal->suspend("again");
  signal->lose("twice");
  EXPECT_EQ(signal->state(), HoldState::lost);
  EXPECT_TRUE(token.stop_requested());
  EXPECT_EQ(signal->reason(), "session expired");
  ASSERT_EQ(recorded.changes.size(), 2u);
  EXPECT_EQ(recorded.changes[1].state, HoldState::lost);
  EXPECT_EQ(recorded.changes[1].reason, "session expired");
  EXPECT_EQ(recorded.lost_calls, 1);
}

TEST(HoldState, CallbackMayReportTheSameHoldLost) {
  // A callback that releases the hold may find it lost: the release's lose() runs inside it.
  std::shared_ptr<LossSignal> signal;
  std::vector<HoldState> seen;
  auto callbacks =
      std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{nullptr,
                                                                          [&](const HoldStateChange& change) {
                                                                            seen.push_back(change.state);
                                                                            if (change.state == HoldState::suspended)
                                                                              signal->lose("gone at release");
                                                                          },
                                                                          nullptr});
  signal = std::make_shared<LossSignal>("n", callbacks);
  signal->suspend("down");
  EXPECT_EQ(signal->state(), HoldState::lost);
  EXPECT_EQ(seen, (std::vector{HoldState::suspended, HoldState::lost}));
}

TEST(HoldState, ConcurrentChangesEndLostAndToldInOrder) {
  for (int round = 0; round < 50; ++round) {
    Recorded recorded;
    auto signal = recording_signal(recorded);
    std::thread flapper([&] {
      for (int i = 0; i < 200; ++i) {
        signal->suspend("down");
        signal->resume();
      }
    });
    std::thread loser([&] { signal->lose("expired"); });
    flapper.join();
    loser.join();
    std::lock_guard lock(recorded.mutex);
    ASSERT_FALSE(recorded.changes.empty());
    EXPECT_EQ(recorded.changes.back().state, HoldState::lost) << "nothing is told after lost";
    for (std::size_t i = 1; i < recorded.changes.size(); ++i) {
      EXPECT_NE(recorded.changes[i].state, recorded.changes[i - 1].state) << "each change told once";
    }
    EXPECT_EQ(recorded.lost_calls, 1);
  }
}

TEST(HoldState, Names) {
  EXPECT_STREQ(turnstile::to_string(HoldState::held), "held");
  EXPECT_STREQ(turnstile::to_string(HoldState::suspended), "suspended");
  EXPECT_STREQ(turnstile::to_string(HoldState::lost), "lost");
}

// With the client's telemetry, each change is counted by its cause in the hold's cells and told
// to the event hook, in order, with the hold's name and token; nothing after the loss.
TEST(HoldState, ChangesAreCountedByCauseAndToldAsEvents) {
  using turnstile::Event;
  using turnstile::EventKind;
  using namespace turnstile::detail;
  std::vector<Event> events;
  auto telemetry = std::make_shared<Telemetry>("redis", false, [&](const Event& event) { events.push_back(event); });
  auto& cells = telemetry->cells("a/name", metered(Primitive::semaphore));
  auto callbacks = std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{nullptr, nullptr, telemetry});
  auto signal = std::make_shared<LossSignal>("a/name", callbacks, metered(Primitive::semaphore), &cells);
  signal->set_fencing_token(9);
  signal->suspend("the connection dropped", SuspendCause::connection_lost);
  signal->suspend("still down", SuspendCause::connection_lost);  // no change: not counted again
  signal->resume();
  signal->lose("its session expired", LossCause::session_expired);
  signal->suspend("after the loss");
  signal->lose("again", LossCause::entry_gone);

  const auto count = [](const auto& counter) { return counter.load(); };
  telemetry->wait_until_events_told();  // the hook runs on the telemetry's own thread
  EXPECT_EQ(count(cells.suspended[static_cast<std::size_t>(SuspendCause::connection_lost)]), 1u);
  EXPECT_EQ(count(cells.suspended[static_cast<std::size_t>(SuspendCause::renewal_unanswered)]), 0u);
  EXPECT_EQ(count(cells.lost[static_cast<std::size_t>(LossCause::session_expired)]), 1u);
  EXPECT_EQ(count(cells.lost[static_cast<std::size_t>(LossCause::entry_gone)]), 0u);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, EventKind::suspended);
  EXPECT_EQ(events[0].outcome, "connection_lost");
  EXPECT_EQ(events[0].reason, "the connection dropped");
  EXPECT_EQ(events[1].kind, EventKind::resumed);
  EXPECT_EQ(events[2].kind, EventKind::lost);
  EXPECT_EQ(events[2].outcome, "session_expired");
  for (const auto& event : events) {
    EXPECT_EQ(event.name, "a/name");
    EXPECT_EQ(event.fencing_token, 9u);
    EXPECT_EQ(event.primitive, "semaphore");
    EXPECT_EQ(event.backend, "redis");
  }
  const auto text = telemetry->snapshot(0).prometheus_text();
  EXPECT_EQ(text.find("turnstile_holds_lost_total{backend=\"redis\",primitive=\"semaphore\""), std::string::npos)
      << "a primitive without acquires has no series";
}

}  // namespace
