// SPDX-License-Identifier: Apache-2.0
// The core's queue predicate (evaluate_queue) at the edges of its arithmetic: limits and permit
// counts up to INT64_MAX, and nonsense counts a peer may have written, never overflow into an
// admission.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace {

using turnstile::detail::EntryKind;
using turnstile::detail::evaluate_queue;
using turnstile::detail::QueueEntryView;
using turnstile::detail::WaitFor;

constexpr auto kMax = std::numeric_limits<std::int64_t>::max();

TEST(QueuePredicate, AFullSemaphoreAtInt64MaxAdmitsNoMore) {
  // acquire(INT64_MAX) holds; try_acquire(1) behind it must wait (it was admitted: the sum
  // INT64_MAX + 1 overflowed to a negative number).
  const std::vector<QueueEntryView> queue{{EntryKind::lease, kMax}, {EntryKind::lease, 1}};
  EXPECT_TRUE(evaluate_queue(queue, 0, kMax).admitted());
  const auto verdict = evaluate_queue(queue, 1, kMax);
  EXPECT_FALSE(verdict.admitted());
  EXPECT_EQ(verdict.wait, WaitFor::any_holder_leave);
}

TEST(QueuePredicate, HugeCountsAheadMakeTheNextWaitForAdmission) {
  const std::vector<QueueEntryView> queue{
      {EntryKind::lease, kMax - 1}, {EntryKind::lease, kMax}, {EntryKind::lease, kMax}, {EntryKind::lease, 1}};
  EXPECT_TRUE(evaluate_queue(queue, 0, kMax).admitted());
  EXPECT_EQ(evaluate_queue(queue, 1, kMax).wait, WaitFor::any_holder_leave);
  const auto third = evaluate_queue(queue, 2, kMax);
  EXPECT_EQ(third.wait, WaitFor::admission);
  EXPECT_EQ(third.index, 1u);
  EXPECT_EQ(evaluate_queue(queue, 3, kMax).wait, WaitFor::admission);
}

TEST(QueuePredicate, NegativeOrZeroCountsFromPeersCountAsOnePermit) {
  // A peer's entry claiming -5 permits must not make room for more than the limit.
  const std::vector<QueueEntryView> queue{{EntryKind::lease, -5}, {EntryKind::lease, 0}, {EntryKind::lease, 1}};
  EXPECT_TRUE(evaluate_queue(queue, 0, 2).admitted());
  EXPECT_TRUE(evaluate_queue(queue, 1, 2).admitted());
  EXPECT_FALSE(evaluate_queue(queue, 2, 2).admitted());
}

TEST(QueuePredicate, ExactFitAtTheLimitIsAdmittedAndOneMoreIsNot) {
  const std::vector<QueueEntryView> queue{{EntryKind::lease, 3}, {EntryKind::lease, 4}, {EntryKind::lease, 1}};
  EXPECT_TRUE(evaluate_queue(queue, 1, 7).admitted());
  EXPECT_FALSE(evaluate_queue(queue, 2, 7).admitted());
}

TEST(QueuePredicate, AFirstRequestAboveANonsenseLimitWaitsAndNeverIndexesBeforeTheQueue) {
  const std::vector<QueueEntryView> queue{{EntryKind::lease, 2}};
  const auto verdict = evaluate_queue(queue, 0, -1);
  EXPECT_FALSE(verdict.admitted());
  EXPECT_EQ(verdict.wait, WaitFor::any_holder_leave);
}

}  // namespace

namespace {

using turnstile::detail::check_queue_mode;
using turnstile::detail::QueueMode;
using turnstile::detail::QueueRequest;

// One row: a queue written as kinds and permits ("x" exclusive, "s" shared, "l3" a lease of 3),
// the index of ours, the limit, and the expected verdict.
struct PredicateRow {
  std::vector<std::string> queue;
  std::size_t mine;
  std::int64_t limit;
  WaitFor wait;
  std::size_t index;
};

std::vector<QueueEntryView> parse_queue(const std::vector<std::string>& spec) {
  std::vector<QueueEntryView> queue;
  for (const auto& entry : spec) {
    const auto kind = entry[0] == 'x' ? EntryKind::exclusive : entry[0] == 's' ? EntryKind::shared : EntryKind::lease;
    queue.push_back({kind, entry.size() > 1 ? std::stoll(entry.substr(1)) : 1});
  }
  return queue;
}

TEST(QueuePredicate, EveryPrimitivesRuleInOneTable) {
  const std::vector<PredicateRow> rows{
      // Mutex / writer: first holds; the rest wait for the entry just ahead.
      {{"x"}, 0, 0, WaitFor::nothing, 0},
      {{"x", "x"}, 1, 0, WaitFor::leave, 0},
      {{"x", "x", "x"}, 2, 0, WaitFor::leave, 1},
      {{"s", "x"}, 1, 0, WaitFor::leave, 0},
      // Readers: held unless a writer is ahead; wait for the nearest writer ahead.
      {{"s", "s"}, 1, 0, WaitFor::nothing, 0},
      {{"x", "s"}, 1, 0, WaitFor::exclusive_end, 0},
      {{"x", "s", "x", "s"}, 3, 0, WaitFor::exclusive_end, 2},
      {{"s", "x", "s", "s"}, 3, 0, WaitFor::exclusive_end, 1},
      // Leases: held while everything ahead plus ours fits; FIFO behind a waiter.
      {{"l2", "l1"}, 1, 3, WaitFor::nothing, 0},
      {{"l2", "l2"}, 1, 3, WaitFor::any_holder_leave, 0},
      {{"l2", "l2", "l1"}, 2, 3, WaitFor::admission, 1},  // would fit, but a bigger waiter is ahead
      {{"l3"}, 0, 3, WaitFor::nothing, 0},
      {{"l1", "l1", "l1", "l1"}, 3, 3, WaitFor::any_holder_leave, 0},
  };
  for (const auto& row : rows) {
    const auto verdict = evaluate_queue(parse_queue(row.queue), row.mine, row.limit);
    std::string shown;
    for (const auto& entry : row.queue) shown += entry + " ";
    EXPECT_EQ(verdict.wait, row.wait) << "queue " << shown << "mine " << row.mine << " limit " << row.limit;
    if (!verdict.admitted()) {
      EXPECT_EQ(verdict.index, row.index) << "queue " << shown << "mine " << row.mine;
    }
  }
}

TEST(QueueMode, LocksSemaphoresAndLimitsDoNotMix) {
  const auto request = [](EntryKind kind, std::int64_t limit) {
    return QueueRequest{.name = "n", .kind = kind, .limit = limit};
  };
  const auto lock = request(EntryKind::exclusive, 0);
  const auto reader = request(EntryKind::shared, 0);
  const auto lease = request(EntryKind::lease, 5);
  for (const auto* each : {&lock, &reader, &lease}) EXPECT_NO_THROW(check_queue_mode(*each, QueueMode::none, 0));
  EXPECT_NO_THROW(check_queue_mode(lock, QueueMode::lock, 0));
  EXPECT_NO_THROW(check_queue_mode(reader, QueueMode::lock, 0));
  EXPECT_NO_THROW(check_queue_mode(lease, QueueMode::semaphore, 5));
  EXPECT_THROW(check_queue_mode(lock, QueueMode::semaphore, 5), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(reader, QueueMode::semaphore, 5), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(lease, QueueMode::lock, 0), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(lease, QueueMode::semaphore, 4), turnstile::LimitMismatch);
}

TEST(QueueMode, AnElectionIsNeitherALockNorASemaphore) {
  const QueueRequest candidate{.name = "n", .primitive = turnstile::detail::Primitive::election, .value = "v"};
  const QueueRequest lock{.name = "n"};
  const QueueRequest lease{.name = "n", .kind = EntryKind::lease, .limit = 5};
  EXPECT_EQ(turnstile::detail::mode_of(candidate), QueueMode::election);
  EXPECT_NO_THROW(check_queue_mode(candidate, QueueMode::none, 0));
  EXPECT_NO_THROW(check_queue_mode(candidate, QueueMode::election, 0));
  EXPECT_THROW(check_queue_mode(candidate, QueueMode::lock, 0), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(candidate, QueueMode::semaphore, 5), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(lock, QueueMode::election, 0), turnstile::KindMismatch);
  EXPECT_THROW(check_queue_mode(lease, QueueMode::election, 0), turnstile::KindMismatch);
  try {
    check_queue_mode(lock, QueueMode::election, 0);
  } catch (const turnstile::KindMismatch& error) {
    EXPECT_STREQ(error.what(), "'n' is in use as an election; it cannot be a lock at the same time");
  }
}

}  // namespace
