// The core's queue predicate (evaluate_queue) at the edges of its arithmetic: limits and permit
// counts up to INT64_MAX, and nonsense counts a peer may have written, never overflow into an
// admission.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

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
