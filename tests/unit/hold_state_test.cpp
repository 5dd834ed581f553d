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
                                                                          }});
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
      std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{nullptr, [&](const HoldStateChange& change) {
                                                                            seen.push_back(change.state);
                                                                            if (change.state == HoldState::suspended)
                                                                              signal->lose("gone at release");
                                                                          }});
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

}  // namespace
