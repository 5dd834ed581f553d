// SPDX-License-Identifier: Apache-2.0
// Late and repeated requests (issue 22; docs/architecture.md, "Late and repeated requests"):
// a write its sender gave up on changes nothing. A proxy holds the write back until the call
// that sent it has returned (timed out, thrown, or succeeded by a resend and released), then
// delivers it; or copies a counter change and sends the copy again after later changes. No
// entry, holder or permit may appear, and a counter change applies at most once. Skipped where
// no proxy can stand in front of the server (file://, Sentinel, Cluster).
#include <optional>
#include <stop_token>
#include <thread>

#include "conformance/late_support.hpp"
#include "conformance/support.hpp"

namespace conformance {
namespace {

constexpr auto kGiveUp = 300ms;   // how long a call whose write is held waits
constexpr auto kWindow = 1500ms;  // how long a late write is given to show
constexpr auto kTtl = 3000ms;     // short, so ZooKeeper's client gives up a stalled connection soon

#define SKIP_WITHOUT_PROXY()                                    \
  if (const auto why = late_skip_reason(url()); !why.empty()) { \
    GTEST_SKIP() << why;                                        \
  }

turnstile::ClientOptions late_options(const std::string& label) {
  turnstile::ClientOptions options;
  options.ttl = kTtl;
  options.holder_label = label;
  return options;
}

// One case: a client whose connections pass through the proxies, with a holder label of its
// own, and the backend's patterns for the name under test.
struct LateCase {
  LateCase(const std::string& url, const std::string& target)
      : label(unique_label()), rig(url, late_options(label)), patterns(late_patterns(url, label, target)) {}

  // Holds the nth chunk containing `pattern` while `call` runs on another thread; returns what
  // the call came to once it returned, with the write still held (fails the test when nothing
  // was held). With `cut`, the client's side of the held connection is reset once the write is
  // held, so that the client resends it on a new connection while the first copy stays held.
  // On a session-bound backend it also waits (bounded) for the client's new connection.
  Outcome hold_while(const std::string& pattern, int nth, std::function<bool()> call, bool cut = false) {
    const auto connections = rig.accepted();
    hold = rig.hold(pattern, nth);
    auto outcome = attempt(std::move(call));
    const bool held = hold->wait_held(5s);
    if (held && cut) hold->cut_client();
    EXPECT_EQ(outcome.wait_for(10s), std::future_status::ready) << "the call never returned";
    EXPECT_TRUE(held) << "the write never passed the proxy: nothing tested";
    if (patterns.session_bound) {
      EXPECT_TRUE(Conformance::eventually([&] { return rig.accepted() > connections; }, kTtl + 2s))
          << "the client never gave up its stalled connection";
    }
    return outcome.get();
  }
  void deliver() { hold->deliver(); }
  // Delivers once the client's own clean-up after the failed call is done (bounded), so that the
  // late write comes after it: the order in which a late write can undo a clean-up.
  void deliver_after_cleanup(turnstile::Client& observer, const std::string& name) {
    Conformance::eventually(
        [&] {
          const auto seen = observer.inspect(name);
          return seen.holders.empty() && seen.waiters.empty();
        },
        3s);
    deliver();
  }

  std::string label;
  LateRig rig;
  LatePatterns patterns;
  std::optional<LateRig::Hold> hold;
};

// A PermitCounter case: the counter set to `start` by a direct client, and its handle through
// the proxies.
struct CounterCase : LateCase {
  CounterCase(const std::string& url, turnstile::Client& observer, const std::string& name, std::int64_t start)
      : LateCase(url, name), direct(observer.permit_counter(name)), counter(rig.client().permit_counter(name)),
        set(direct.try_set_permits(start)) {}
  turnstile::PermitCounter direct;
  turnstile::PermitCounter counter;
  bool set;  // false when the counter was set already: nothing tested
};

// True when a holder or waiter of `name` shows within the window: a late write that landed.
bool entry_shows(turnstile::Client& observer, const std::string& name) {
  return shows_within(
      [&] {
        const auto seen = observer.inspect(name);
        return !seen.holders.empty() || !seen.waiters.empty();
      },
      kWindow);
}

// True when the count leaves `expected` within the window.
bool count_moves(turnstile::PermitCounter& counter, std::int64_t expected) {
  return shows_within([&] { return counter.available_permits() != expected; }, kWindow);
}

// A new client locks `name` at once (and unlocks): nobody holds it.
bool lockable_at_once(turnstile::Client other, const std::string& name) {
  auto mutex = other.mutex(name);
  if (!mutex.try_lock()) return false;
  mutex.unlock();
  return true;
}

}  // namespace

// (a) A Mutex try_lock_for whose join is held times out; another client locks and unlocks;
// the join lands: no holder or waiter may appear, and a third client locks at once.
TEST_P(Conformance, LateJoinOfAGivenUpMutexCreatesNoEntry) {
  SKIP_WITHOUT_PROXY();
  const auto lock_name = name("m");
  LateCase late(url(), lock_name);
  auto mutex = late.rig.client().mutex(lock_name);
  const auto outcome =
      late.hold_while(late.patterns.join, late.patterns.join_nth, [&] { return mutex.try_lock_for(kGiveUp); });
  ASSERT_FALSE(outcome.succeeded) << "locked with its join held";
  ASSERT_TRUE(lockable_at_once(connect(), lock_name)) << "the name is taken while the join is held";
  late.deliver_after_cleanup(client(), lock_name);
  EXPECT_FALSE(entry_shows(client(), lock_name)) << "the late join made an entry (" << outcome.error << ")";
  EXPECT_TRUE(lockable_at_once(connect(), lock_name)) << "a ghost holds the name";
}

// (b) The same with a Semaphore (limit 2, acquire 1), holding the write that makes its lease
// held (on Consul the take after the join): no lease held by nobody.
TEST_P(Conformance, LateJoinOfAGivenUpSemaphoreHoldsNoPermit) {
  SKIP_WITHOUT_PROXY();
  const auto sem_name = name("s");
  LateCase late(url(), sem_name);
  auto semaphore = late.rig.client().semaphore(sem_name, 2);
  const auto outcome = late.hold_while(late.patterns.lease, late.patterns.lease_nth,
                                       [&] { return semaphore.try_acquire_for(kGiveUp, 1).has_value(); });
  ASSERT_FALSE(outcome.succeeded) << "admitted with its write held";
  late.deliver_after_cleanup(client(), sem_name);
  EXPECT_FALSE(entry_shows(client(), sem_name)) << "the late write made an entry (" << outcome.error << ")";
  EXPECT_TRUE(connect().semaphore(sem_name, 2).try_acquire(2).has_value()) << "a permit is held by nobody";
}

// (b) The same with a SharedMutex reader: no reader held by nobody (a writer locks at once).
TEST_P(Conformance, LateHoldOfAGivenUpReaderCreatesNoReader) {
  SKIP_WITHOUT_PROXY();
  const auto lock_name = name("rw");
  LateCase late(url(), lock_name);
  auto shared = late.rig.client().shared_mutex(lock_name);
  const auto outcome = late.hold_while(late.patterns.lease, late.patterns.lease_nth, [&] {
    if (!shared.try_lock_shared_for(kGiveUp)) return false;
    shared.unlock_shared();  // by the thread that locked
    return true;
  });
  ASSERT_FALSE(outcome.succeeded) << "a reader with its write held";
  late.deliver_after_cleanup(client(), lock_name);
  EXPECT_FALSE(entry_shows(client(), lock_name)) << "the late write made a reader (" << outcome.error << ")";
  auto writer = connect().shared_mutex(lock_name);
  EXPECT_TRUE(writer.try_lock()) << "a reader held by nobody keeps writers out";
  if (writer.owns_lock()) writer.unlock();
}

// (c) A join held, and the client's connection reset meanwhile: the client resends the join on
// a new connection, locks and unlocks; then the first copy lands: it must not make the name
// held again.
TEST_P(Conformance, LateFirstCopyOfAJoinAfterTheReleaseCreatesNoEntry) {
  SKIP_WITHOUT_PROXY();
  const auto lock_name = name("m");
  LateCase late(url(), lock_name);
  auto mutex = late.rig.client().mutex(lock_name);
  // Locked by the client's own resend, or else by the caller trying again; unlocked (by the
  // thread that locked: a Mutex belongs to its thread) before the first copy lands.
  const auto lock_and_unlock = [&](std::chrono::milliseconds timeout) {
    if (!mutex.try_lock_for(timeout)) return false;
    mutex.unlock();
    return true;
  };
  const auto outcome = late.hold_while(
      late.patterns.join, late.patterns.join_nth, [&] { return lock_and_unlock(4s); }, true);
  ASSERT_TRUE(outcome.succeeded || lock_and_unlock(5s)) << "the client could not lock again: " << outcome.error;
  late.deliver_after_cleanup(client(), lock_name);
  EXPECT_FALSE(entry_shows(client(), lock_name))
      << "the first copy of the join made an entry after the unlock ("
      << (outcome.succeeded ? "locked by a resend" : "locked by a second call after: " + outcome.error) << ")";
  EXPECT_TRUE(lockable_at_once(connect(), lock_name)) << "a ghost holds the name";
}

// (d) PermitCounter: acquire(2) of 5 whose take is held gives up at its deadline; the take
// lands: the count is 5 again (3 only if the call said it took them), and nobody is in line.
TEST_P(Conformance, LateTakeOfAGivenUpCounterAcquireTakesNothing) {
  SKIP_WITHOUT_PROXY();
  const auto counter_name = name("c");
  CounterCase late(url(), client(), counter_name, 5);
  ASSERT_TRUE(late.set);
  const auto outcome = late.hold_while(late.patterns.take, late.patterns.take_nth,
                                       [&] { return late.counter.try_acquire_for(kGiveUp, 2); });
  late.deliver();
  EXPECT_FALSE(count_moves(late.direct, outcome.succeeded ? 3 : 5))
      << "the late take changed the count to " << late.direct.available_permits() << " after the acquire "
      << (outcome.succeeded ? "took 2" : "took nothing: " + outcome.error);
  EXPECT_EQ(waiter_count(counter_name), 0u) << "a waiter nobody owns is in line";
}

// (d) The same, the acquire ended by a stop instead of its deadline.
TEST_P(Conformance, LateTakeOfAStoppedCounterAcquireTakesNothing) {
  SKIP_WITHOUT_PROXY();
  const auto counter_name = name("c");
  CounterCase late(url(), client(), counter_name, 5);
  ASSERT_TRUE(late.set);
  std::stop_source stop;
  std::jthread stopper([&] {
    std::this_thread::sleep_for(kGiveUp);
    stop.request_stop();
  });
  const auto outcome = late.hold_while(late.patterns.take, late.patterns.take_nth,
                                       [&] { return late.counter.try_acquire_for(10s, 2, stop.get_token()); });
  late.deliver();
  EXPECT_FALSE(count_moves(late.direct, outcome.succeeded ? 3 : 5))
      << "the late take changed the count to " << late.direct.available_permits() << " after the stopped acquire "
      << (outcome.succeeded ? "took 2" : "took nothing: " + outcome.error);
  EXPECT_EQ(waiter_count(counter_name), 0u) << "a waiter nobody owns is in line";
}

// (d) A PermitCounter acquire(2) with none free waits in line; its place in line is held and
// the call gives up; the place lands late: once 5 permits are added, another client takes 1 at
// once, and nobody is in line.
TEST_P(Conformance, LatePlaceInLineOfAGivenUpCounterAcquireBlocksNobody) {
  SKIP_WITHOUT_PROXY();
  const auto counter_name = name("c");
  CounterCase late(url(), client(), counter_name, 0);
  ASSERT_TRUE(late.set);
  const auto outcome = late.hold_while(late.patterns.line, late.patterns.line_nth,
                                       [&] { return late.counter.try_acquire_for(kGiveUp, 2); });
  ASSERT_FALSE(outcome.succeeded) << "took 2 of 0 permits";
  late.deliver_after_cleanup(client(), counter_name);
  EXPECT_FALSE(shows_within([&] { return waiter_count(counter_name) > 0; }, kWindow))
      << "the late place in line made a waiter nobody owns (" << outcome.error << ")";
  late.direct.add_permits(5);
  EXPECT_TRUE(connect().permit_counter(counter_name).try_acquire_for(1s, 1)) << "a ghost waiter is served first";
  EXPECT_EQ(late.direct.available_permits(), 4);
}

// (d) A PermitCounter add(3) whose write is held while the client's connection is reset: the
// client resends or gives up; then the first copy lands, with nothing changed in between: the
// count is 8 if the add said so, else 5 (a change its sender gave up on changes nothing).
TEST_P(Conformance, LateFirstCopyOfACounterAddAppliesAtMostOnce) {
  SKIP_WITHOUT_PROXY();
  const auto counter_name = name("c");
  CounterCase late(url(), client(), counter_name, 5);
  ASSERT_TRUE(late.set);
  const auto outcome = late.hold_while(
      late.patterns.add, late.patterns.add_nth, [&] { return late.counter.add_permits(3) == 8; }, true);
  late.deliver();
  EXPECT_FALSE(count_moves(late.direct, outcome.succeeded ? 8 : 5))
      << "the first copy of add(3) changed the count to " << late.direct.available_permits() << " after the add "
      << (outcome.succeeded ? "returned 8" : "threw: " + outcome.error);
}

// (d) PermitCounter: add(3) is applied once, however many changes come before its copy does.
// Replayed on a new connection where a copy can be (Redis, Consul); elsewhere the add is held
// until its call gave up and delivered after the changes.
TEST_P(Conformance, LateCopyOfACounterAddIsAppliedAtMostOnce) {
  SKIP_WITHOUT_PROXY();
  const auto counter_name = name("c");
  CounterCase late(url(), client(), counter_name, 5);
  ASSERT_TRUE(late.set);
  std::int64_t expected = 5;
  std::optional<LateRig::Copy> copy;
  if (late.patterns.replays) {
    copy = late.rig.duplicate(late.patterns.add, late.patterns.add_nth);
    EXPECT_EQ(late.counter.add_permits(3), 8);
    ASSERT_TRUE(copy->wait_seen(1s)) << "the add never passed the proxy: nothing tested";
    expected = 8;
  } else if (late.hold_while(late.patterns.add, late.patterns.add_nth, [&] { return late.counter.add_permits(3) == 8; })
                 .succeeded) {
    expected = 8;
  }
  // More changes than any memory of recent requests could span: by the same client where the
  // copy is replayed (its own requests must not push the first out of memory); directly where
  // the add is held (the client's connection may still be reconnecting).
  for (int i = 0; i < 20; ++i) (copy ? late.counter : late.direct).add_permits(1);
  expected += 20;
  if (copy) copy->replay();
  if (late.hold) late.deliver();
  EXPECT_FALSE(count_moves(late.direct, expected))
      << "the late copy of add(3) changed the count to " << late.direct.available_permits() << ", not " << expected;
}

// (e) An election candidate whose join is held gives up; the join lands after its clean-up: no
// candidate appears, and another leads at once. Where elections exist (redis:// and consul:// so far).
TEST_P(Conformance, LateJoinOfAGivenUpCandidateCreatesNoEntry) {
  SKIP_WITHOUT_PROXY();
  const auto election_name = name("e");
  LateCase late(url(), election_name);
  std::optional<turnstile::Election> election;
  try {
    election.emplace(late.rig.client().election(election_name));
  } catch (const turnstile::InvalidArgument& error) {
    GTEST_SKIP() << error.what();
  }
  // The value carries the holder label as an entry's data does (" label=…"), so the join
  // pattern finds the join where the value is the entry's whole data (zk://, etcd://).
  const auto value = "ghost label=" + late.label;
  const auto outcome = late.hold_while(late.patterns.join, late.patterns.join_nth,
                                       [&] { return election->campaign_for(value, kGiveUp); });
  ASSERT_FALSE(outcome.succeeded) << "led with its join held";
  late.deliver_after_cleanup(client(), election_name);
  EXPECT_FALSE(entry_shows(client(), election_name)) << "the late join made a candidate (" << outcome.error << ")";
  auto other = connect().election(election_name);
  EXPECT_TRUE(other.campaign_for("real", 0ms)) << "a ghost leads";
}

// (f) A proclaim is applied at most once: its copy, sent again after a newer proclaim, never
// brings the older value back. Where a copy can be replayed and elections exist (redis://).
TEST_P(Conformance, LateCopyOfAProclaimDoesNotUndoANewerOne) {
  SKIP_WITHOUT_PROXY();
  const auto election_name = name("e");
  LateCase late(url(), election_name);
  if (!late.patterns.replays) GTEST_SKIP() << "no copy can be replayed here";
  std::optional<turnstile::Election> election;
  try {
    election.emplace(late.rig.client().election(election_name));
  } catch (const turnstile::InvalidArgument& error) {
    GTEST_SKIP() << error.what();
  }
  election->campaign("start");
  const std::string older = "older-" + late.label;
  auto copy = late.rig.duplicate(late_value_pattern(url(), older), 1);
  election->proclaim(older);
  ASSERT_TRUE(copy.wait_seen(1s)) << "the proclaim never passed the proxy: nothing tested";
  election->proclaim("newer");
  copy.replay();
  EXPECT_FALSE(shows_within([&] { return election->leader()->value != "newer"; }, kWindow))
      << "the copy of an older proclaim changed the value to " << election->leader()->value;
}

}  // namespace conformance
