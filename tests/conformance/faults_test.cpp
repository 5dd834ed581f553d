// SPDX-License-Identifier: Apache-2.0
// Network faults between a client and its server, made with a loopback proxy
// (tests/support/tcp_proxy.hpp): a cut link (black hole: no answers, no reset) and lost replies.
// Issues 10.2, 10.2b, 10.16, 15.5/15.6, 16.11. Only the network backends have a server lease to
// lose or a reply to lose; on file:// these tests are skipped.
#include <algorithm>
#include <future>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <stop_token>

#include "conformance/fault_support.hpp"

namespace conformance {

using namespace faults;

// Issue 10.2: while other threads of the same client wait in long timed acquires, a hold whose
// link to the server is cut is reported lost by the documented bound, and unlock() of the lost
// hold does not stall behind the reconnect.
TEST_P(Conformance, CutOffHoldIsReportedLostWithinTheBoundWhileOtherThreadsWait) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(kShortTtl));
  std::vector<turnstile::Mutex> busy;
  for (int i = 0; i < 3; ++i) {
    busy.push_back(client().mutex(name("busy" + std::to_string(i))));
    busy.back().lock();
  }
  auto held = cut_off.mutex(name("held"));
  held.lock();
  LossTime lost(held.lost_token());
  std::vector<std::thread> waiters;
  OnExit cleanup([&] {
    proxy.forward();
    for (auto& mutex : busy) mutex.unlock();
    for (auto& waiter : waiters) waiter.join();
  });
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&cut_off, lock_name = name("busy" + std::to_string(i))] {
      auto mutex = cut_off.mutex(lock_name);
      try {
        if (mutex.try_lock_for(60s)) mutex.unlock();
      } catch (const turnstile::Error&) {
        // Failing is allowed once the link is cut; blocking the loss report is not.
      }
    });
  }
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(wait_for_waiters(name("busy" + std::to_string(i)), 1)) << "waiter " << i << " never queued";

  const auto cut = proxy.blackhole_when_quiet(kQuiet);
  const auto bound = cut + kShortTtl - loss_margin(kShortTtl);
  ASSERT_TRUE(eventually([&] { return lost.reported(); }, kShortTtl + 10s))
      << "the cut-off hold was never reported lost";
  EXPECT_LE(lost.at(), bound) << "reported lost " << ms(lost.at() - cut) << " ms after the cut; the bound is "
                              << ms(bound - cut) << " ms (TTL - max(TTL/10, 50 ms))";
  EXPECT_EQ(held.hold_state(), turnstile::HoldState::lost);

  const auto start = Clock::now();
  held.unlock();
  EXPECT_LT(Clock::now() - start, 2s) << "unlock() of a lost hold waited for the cut link";
}

// Issue 10.2b: a holder cut off from the server is told before the server can let another
// contender in. The server cannot expire the hold before (send time of the last renewal it
// confirmed) + TTL; the holder is told at that send time + TTL - TTL/10 at the latest, so its
// lead over the contender's admission is at least TTL/10 less the report's scheduling delay.
// TTL/20 is demanded: half the margin is left for scheduling, and a backend that tells the
// holder only when the server expires it (no margin) or later fails. A third client looks at
// the name every 20 ms (a try-once acquire): a server that frees a lapsed hold only when a
// script runs (Redis) then admits the contender within 20 ms of its expiry, so the lead
// measured is the holder's margin, not the contender's re-check interval (which let a margin
// of 0 pass).
TEST_P(Conformance, CutOffHolderIsToldBeforeAnotherContenderIsAdmitted) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(kShortTtl));
  const auto lock_name = name("m");
  auto held = cut_off.mutex(lock_name);
  held.lock();
  LossTime lost(held.lost_token());

  auto other = connect();
  std::atomic<Clock::rep> admitted{0};
  std::thread contender([&] {
    auto mutex = other.mutex(lock_name);
    if (mutex.try_lock_for(kShortTtl + 15s)) {
      admitted = Clock::now().time_since_epoch().count();
      mutex.unlock();
    }
  });
  auto looker = connect();
  std::atomic<bool> looking{true};
  std::thread prober([&] {
    auto mutex = looker.mutex(lock_name);
    while (looking && admitted.load() == 0) {
      try {
        if (mutex.try_lock()) mutex.unlock();
      } catch (const turnstile::Error&) {
      }
      std::this_thread::sleep_for(20ms);
    }
  });
  OnExit join([&] {
    proxy.forward();
    contender.join();
    looking = false;
    prober.join();
  });
  ASSERT_TRUE(wait_for_waiters(lock_name, 1)) << "the contender never queued";
  const auto cut = proxy.blackhole_when_quiet(kQuiet);
  ASSERT_TRUE(eventually([&] { return admitted.load() != 0; }, kShortTtl + 16s))
      << "the server never freed the cut-off hold";
  const auto admitted_at = Clock::time_point(Clock::duration(admitted.load()));
  ASSERT_TRUE(lost.reported()) << "another contender was admitted " << ms(admitted_at - cut)
                               << " ms after the cut while the cut-off holder was never told";
  EXPECT_LE(lost.at() + kShortTtl / 20, admitted_at)
      << "holder told " << ms(lost.at() - cut) << " ms after the cut, the contender admitted " << ms(admitted_at - cut)
      << " ms after it: less than TTL/20 = " << (kShortTtl / 20).count() << " ms of lead (negative: two holders)";
  held.unlock();
}

namespace {

// How long the reply of one renewal is held back: well past any scheduling noise, and shorter
// than the time every backend waits for a renewal's answer before giving it up (Consul: TTL/4,
// Redis: min(TTL/3, 1 s)), so the late answer is read and confirms the renewal.
constexpr auto kReplyHeldFor = 500ms;
// Room for the loss report's own scheduling beyond the documented bound on 2 busy cores (a
// renewal confirmed at its reply's receipt is told kReplyHeldFor late).
constexpr auto kReportAllowance = 200ms;

// Right after a request passed, at a moment when none has passed for `quiet`: replies are held
// from then on (requests flow). A backend that renews on a period has just renewed, so the next
// renewal is a period away.
void hold_replies_after_a_request(TcpProxy& proxy, std::chrono::milliseconds quiet) {
  const auto seen = proxy.last_request_at();
  if (!Conformance::eventually([&] { return proxy.last_request_at() != seen; }, 5s))
    throw std::runtime_error("no request passed");
  for (const auto until = Clock::now() + 5s; Clock::now() < until; std::this_thread::sleep_for(5ms)) {
    const auto last = proxy.last_request_at();
    if (Clock::now() - last < quiet) continue;
    proxy.hold_replies();
    if (proxy.last_request_at() == last) return;
    proxy.forward();  // a request slipped in: its reply would be held too
  }
  throw std::runtime_error("no quiet moment after a request");
}

struct LateRenewal {
  Clock::time_point sent;  // the renewal (the client sent it no later)
  // The last request the server got whose answer the client may have had: every renewal the
  // client may count was sent no later.
  Clock::time_point last_answerable;
};

// Holds replies from the next request on (the renewal, or `renew` makes one), delivers the first
// reply kReplyHeldFor after it was sent, and cuts the link at once (requests sent after the
// reply came get no answer).
LateRenewal deliver_a_renewal_late_then_cut(TcpProxy& proxy, const std::function<void()>& renew,
                                            std::chrono::milliseconds ttl) {
  hold_replies_after_a_request(proxy, kQuiet);
  const auto held_from = proxy.last_request_at();
  renew();
  if (!Conformance::eventually([&] { return proxy.last_request_at() != held_from; }, ttl)) {
    throw std::runtime_error("no renewal was sent");
  }
  const auto sent = proxy.last_request_at();
  std::this_thread::sleep_until(sent + kReplyHeldFor);
  const auto before_reply = proxy.last_request_at();
  // 2 s, not 500 ms: beside two other test runs, the ZooKeeper case failed once 2.5 s in, where
  // only this wait is that short (2026-11-27). A later reply still tests the same thing.
  if (!proxy.pass_one_reply(2s)) throw std::runtime_error("the renewal's reply never came from the server");
  proxy.blackhole();
  return {sent, before_reply};
}

// etcd: a renewal round is a LeaseKeepAlive on its stream, then a linearizable read of the
// hold's key (`read_pattern`) sent once the answer came, which the keep-alive counts only with.
// HTTP/2 control frames flow besides, and the keep-alive's bytes name only the lease: it is
// found by time. Replies are held from right after one round's read for a keep-alive period
// (TTL/3) plus kReplyHeldFor, which holds the next round's keep-alive answer at least
// kReplyHeldFor; then passed one by one until that round's read is sent, answered, and the
// link cut. A read renews nothing: the keep-alive was sent before the first reply was passed.
LateRenewal deliver_a_keep_alive_late_then_cut(TcpProxy& proxy, const std::string& read_pattern) {
  if (!proxy.duplicate_request(read_pattern)->wait_seen(kShortTtl)) throw std::runtime_error("no keep-alive round");
  hold_replies_after_a_request(proxy, kQuiet);
  const auto next_read = proxy.duplicate_request(read_pattern);
  std::this_thread::sleep_for(kShortTtl / 3 + kReplyHeldFor);
  const auto before_reply = proxy.last_request_at();
  for (const auto until = Clock::now() + 2s; !next_read->wait_seen(5ms); proxy.pass_one_reply(20ms)) {
    if (Clock::now() > until) throw std::runtime_error("no keep-alive round while replies were held");
  }
  proxy.forward();
  proxy.blackhole_when_quiet(kQuiet);
  return {before_reply, before_reply};
}

// A contender on its own client (not behind the proxy) that tries the mutex every 20 ms, so it
// is admitted within 20 ms of the server freeing it (also where a lapsed hold is freed only
// when a script runs, as on Redis).
class TryingContender {
 public:
  TryingContender(turnstile::Client client, std::string lock_name)
      : client_(std::move(client)), thread_([this, lock_name = std::move(lock_name)] { run(lock_name); }) {}
  ~TryingContender() { stop(); }
  TryingContender(const TryingContender&) = delete;
  TryingContender& operator=(const TryingContender&) = delete;

  void stop() {
    trying_ = false;
    if (thread_.joinable()) thread_.join();
  }
  bool refused() const { return refused_.load() > 0; }
  bool admitted() const { return admitted_.load() != 0; }
  Clock::time_point admitted_at() const { return Clock::time_point(Clock::duration(admitted_.load())); }

 private:
  void run(const std::string& lock_name) {
    auto mutex = client_.mutex(lock_name);
    while (trying_ && !admitted()) {
      try {
        if (mutex.try_lock()) {
          admitted_ = Clock::now().time_since_epoch().count();
          mutex.unlock();
        } else {
          ++refused_;
        }
      } catch (const turnstile::Error&) {
      }
      std::this_thread::sleep_for(20ms);
    }
  }

  turnstile::Client client_;
  std::atomic<bool> trying_{true};
  std::atomic<int> refused_{0};
  std::atomic<Clock::rep> admitted_{0};
  std::thread thread_;  // last: it uses the members above
};

}  // namespace

// Issue 22.19: a renewal is confirmed from the time its request was SENT, never from when its
// answer came: the server extended the entry from the request's arrival, so a late answer says
// nothing about later. The renewal's reply is held back kReplyHeldFor, then delivered, and the
// link is cut: the holder must be told by (the renewal's send time + TTL - margin, with
// kReportAllowance for scheduling) and before a contender that tries every 20 ms directly is
// admitted. The renewal is the first request after a quiet moment right after one (Redis: the
// renew script; etcd: a LeaseKeepAlive; Consul: PUT /v1/session/renew); on ZooKeeper every
// answered call renews the session (the keeper's pings and the holder's own calls): the
// holder's client makes one (an inspect), as a holder doing other work would.
TEST_P(Conformance, HolderIsToldByItsRenewalsSendTimeNotItsLateReply) {
  SKIP_WITHOUT_SERVER();
  const bool zookeeper = url().rfind("zk:", 0) == 0 || url().rfind("zookeeper:", 0) == 0;
  const bool etcd = url().rfind("etcd", 0) == 0;
  // Twice the short TTL but on etcd (whose keep-alive timing the etcd helper is built on): with
  // 3 s, a renewal round that slipped under load let the hold be told lost before the held
  // reply came (nothing tested; seen in loaded make test runs on redis).
  const std::chrono::milliseconds ttl = etcd ? kShortTtl : 2 * kShortTtl;
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(ttl));
  const auto lock_name = name("m");
  auto held = cut_off.mutex(lock_name);
  held.lock();
  LossTime lost(held.lost_token());

  TryingContender contender(connect(), lock_name);
  std::thread call;
  OnExit join([&] {
    proxy.forward();
    contender.stop();
    if (call.joinable()) call.join();
  });
  ASSERT_TRUE(eventually([&] { return contender.refused(); }, 5s)) << "the contender never tried";

  // On ZooKeeper every answered call renews the session: the holder's client makes one.
  const auto renew = [&] {
    if (!zookeeper) return;
    call = std::thread([&] {
      try {
        static_cast<void>(cut_off.inspect(lock_name));
      } catch (const turnstile::Error&) {
      }
    });
  };
  const auto renewal =
      etcd ? deliver_a_keep_alive_late_then_cut(proxy, lock_name) : deliver_a_renewal_late_then_cut(proxy, renew, ttl);
  const auto renewal_sent = renewal.sent;
  const auto last_sent = renewal.last_answerable;
  ASSERT_FALSE(lost.reported()) << "the hold was lost before its renewal's reply came: nothing tested";

  const auto bound = last_sent + ttl - loss_margin(ttl);
  // Told, or (a backend that believes too long) overtaken by the contender: nothing to wait for
  // after the holder was told, as the contender cannot be admitted earlier than it already was.
  ASSERT_TRUE(eventually([&] { return lost.reported() || contender.admitted(); }, ttl + 10s))
      << "the holder was never told and the server never freed its hold";
  if (contender.admitted()) {
    const auto admitted_at = contender.admitted_at();
    EXPECT_TRUE(lost.reported() && lost.at() < admitted_at)
        << "the contender was admitted " << ms(admitted_at - renewal_sent)
        << " ms after the renewal was sent, before the holder was told (two holders)";
  }
  ASSERT_TRUE(eventually([&] { return lost.reported(); }, ttl + 5s)) << "the cut-off holder was never told";
  std::cout << "renewal sent at 0 ms, its reply held " << ms(kReplyHeldFor) << "+ ms, last request answerable "
            << ms(last_sent - renewal_sent) << " ms, holder told " << ms(lost.at() - renewal_sent) << " ms, bound "
            << ms(bound - renewal_sent) << " ms\n";
  EXPECT_LE(lost.at(), bound + kReportAllowance)
      << "told " << ms(lost.at() - renewal_sent) << " ms after the renewal was sent (its reply came "
      << ms(kReplyHeldFor) << " ms later, the last request answerable " << ms(last_sent - renewal_sent)
      << " ms later); the bound is that last request + " << ms(ttl - loss_margin(ttl))
      << " ms: the renewal confirmed from its reply's receipt?";
  held.unlock();
}

// Issue 10.16 / 16.11: a release whose reply was lost is not a lost hold: it must not report
// HoldLost, and its entry must be gone (removed by it or by its background retry) well within
// the TTL.
// A nested acquire counts on the hold its thread already has: once that hold may have been lost,
// it must say so (HoldLost) rather than report a lock held with nothing on the server. The red
// team saw a read lock taken "at once" on a write hold whose Consul session was destroyed.
TEST_P(Conformance, NestedAcquireOnALostHoldThrowsHoldLost) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(kShortTtl));
  auto writer = cut_off.shared_mutex(name("rw"));
  auto recursive = cut_off.recursive_mutex(name("rec"));
  writer.lock();
  recursive.lock();
  OnExit heal([&] { proxy.forward(); });
  // Before the loss, both nest as they should.
  ASSERT_TRUE(writer.try_lock_shared_for(100ms));
  writer.unlock_shared();
  ASSERT_TRUE(recursive.try_lock_for(100ms));
  recursive.unlock();

  proxy.blackhole_when_quiet(kQuiet);
  ASSERT_TRUE(eventually(
      [&] {
        return writer.hold_state() == turnstile::HoldState::lost &&
               recursive.hold_state() == turnstile::HoldState::lost;
      },
      kShortTtl + 10s))
      << "the cut-off holds were never reported lost";
  EXPECT_THROW(writer.try_lock_shared_for(100ms), turnstile::HoldLost);
  EXPECT_FALSE(writer.owns_shared());
  EXPECT_THROW(recursive.try_lock_for(100ms), turnstile::HoldLost);
  try {
    writer.unlock();
  } catch (const turnstile::Error&) {
    // A lost hold's release may report the loss again; what matters is above.
  }
  try {
    recursive.unlock();
  } catch (const turnstile::Error&) {
  }
}

TEST_P(Conformance, ReleaseWhoseReplyIsLostIsNotReportedLost) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  std::atomic<int> losses{0};
  auto through = connect_through(proxy, url(), counting_losses(kLongTtl, losses));
  const auto lock_name = name("m");
  auto held = through.mutex(lock_name);
  held.lock();
  const auto lost = held.lost_token();

  proxy.drop_replies();
  std::thread heal([&] {
    std::this_thread::sleep_for(1500ms);
    proxy.forward();
  });
  OnExit join([&] { heal.join(); });
  const auto dropped_before = proxy.dropped_bytes();
  try {
    held.release();
  } catch (const turnstile::HoldLost& error) {
    ADD_FAILURE() << "a release whose reply was lost reported HoldLost: " << error.what();
  } catch (const turnstile::BackendUnavailable&) {
    // Allowed: the release goes on in the background.
  }
  EXPECT_TRUE(eventually([&] { return proxy.dropped_bytes() > dropped_before; }, 3s))
      << "no reply was lost: nothing tested";
  EXPECT_TRUE(eventually([&] { return holder_count(lock_name) == 0; }, 5s))
      << "the released entry is still there (it would stay for the " << kLongTtl.count() << " ms TTL)";
  auto after = client().mutex(lock_name);
  EXPECT_TRUE(after.try_lock_for(1s));
  if (after.owns_lock()) after.unlock();
  std::this_thread::sleep_for(500ms);  // a background retry's verdict, if any
  EXPECT_EQ(losses.load(), 0) << "the release was reported as a lost hold";
  EXPECT_FALSE(lost.stop_requested());
}

namespace {

// A timed acquire through `proxy` whose request creating its entry is applied but whose reply
// is lost: replies are held and passed one by one (a join may take several round trips) until
// the server shows the entry (`queued`, seen from a direct client); from then on every reply is
// dropped, so the caller can never learn the outcome. The call must give nothing and honour its
// deadline, and the entry it made must go well within the TTL once replies flow again (found by
// its request id, uuid or owner and removed).
bool lost_join_round(TcpProxy& proxy, const std::function<bool()>& try_join, const std::function<bool()>& queued,
                     const std::function<bool()>& gone, bool last) {
  proxy.hold_replies();
  std::atomic<bool> returned{false};
  std::atomic<bool> got{false};
  std::string error;
  const auto start = Clock::now();
  std::thread joiner([&] {
    try {
      got = try_join();
    } catch (const turnstile::Error& failure) {
      error = failure.what();
    }
    returned = true;
  });
  int passed = 0;
  // A reply is let through only if it is there within 2 ms of a look that found no entry: the
  // longer that wait, the likelier the join is applied during it and its own reply let through
  // (then the client is rightly admitted: "admitted without a reply" once failed so on redis in
  // a loaded run with a 20 ms wait). A race the proxy cannot close; this narrows it.
  const bool seen =
      Conformance::eventually([&] { return queued() || (passed += proxy.pass_one_reply(2ms) ? 1 : 0, false); }, 5s);
  const bool returned_before_seen = returned.load();
  proxy.drop_replies();
  const bool ended = Conformance::eventually([&] { return returned.load(); }, 20s);
  const auto took = Clock::now() - start;
  proxy.forward();
  joiner.join();
  // Admitted through its own reply (let through in the 2 ms window above) and released before
  // a look saw it: a round that tested nothing, played again.
  if (!seen && returned_before_seen && got && !last) return false;
  EXPECT_TRUE(seen) << "the request never reached the server: nothing tested (" << passed << " replies passed; "
                    << (returned_before_seen
                            ? "the call had returned " + std::string(got ? "admitted" : "not admitted: ") + error
                            : std::string("still waiting"))
                    << ", " << proxy.open_connections() << " connections)";
  if (!seen) return true;
  EXPECT_TRUE(ended);
  EXPECT_FALSE(got) << "admitted without a reply from the server";
  EXPECT_LT(took, 2s + 3s) << "a 2 s acquire took " << ms(took) << " ms (" << error << ")";
  EXPECT_TRUE(Conformance::eventually(gone, 4s))
      << "the entry of a join whose reply was lost stayed after the call returned ("
      << (error.empty() ? "timed out" : error) << "): it would lock others out for the " << kLongTtl.count()
      << " ms TTL";
  return true;
}

void expect_lost_join_leaves_nothing(TcpProxy& proxy, const std::function<bool()>& try_join,
                                     const std::function<bool()>& queued, const std::function<bool()>& gone) {
  for (int round = 1;; ++round) {
    if (lost_join_round(proxy, try_join, queued, gone, /*last=*/round == 5)) return;
  }
}

}  // namespace

// Issue 15.5 / 15.6: a waiter's join applied on the server but whose reply was lost.
TEST_P(Conformance, JoinWhoseReplyIsLostLeavesNoWaiterBehind) {
  SKIP_WITHOUT_SERVER();
  const auto lock_name = name("m");
  auto holder = client().mutex(lock_name);
  holder.lock();
  TcpProxy proxy(url());
  auto through = connect_through(proxy, url(), with_ttl(kLongTtl));
  auto mutex = through.mutex(lock_name);
  expect_lost_join_leaves_nothing(
      proxy, [&] { return mutex.try_lock_for(2s); }, [&] { return waiter_count(lock_name) == 1; },
      [&] { return waiter_count(lock_name) == 0; });
  holder.unlock();
  auto third = connect().mutex(lock_name);
  EXPECT_TRUE(third.try_lock_for(4s)) << "a third contender waits for the orphaned entry";
  if (third.owns_lock()) third.unlock();
}

// Issue 15.5 / 15.6 / 16.11: an uncontended Semaphore acquire admitted on the server but whose
// reply was lost: the lease nobody knows of must not keep its permit.
TEST_P(Conformance, AdmittedJoinWhoseReplyIsLostLeavesNoLeaseBehind) {
  SKIP_WITHOUT_SERVER();
  const auto semaphore_name = name("s");
  TcpProxy proxy(url());
  auto through = connect_through(proxy, url(), with_ttl(kLongTtl));
  auto semaphore = through.semaphore(semaphore_name, 1);
  expect_lost_join_leaves_nothing(
      proxy, [&] { return semaphore.try_acquire_for(2s).has_value(); },
      [&] { return holder_count(semaphore_name) == 1; },
      [&] { return holder_count(semaphore_name) == 0 && waiter_count(semaphore_name) == 0; });
  EXPECT_TRUE(connect().semaphore(semaphore_name, 1).try_acquire_for(4s)) << "the orphaned lease keeps the only permit";
}

// Red team (rt3.1): holds of one client lose their server lease together; a slow callback of
// one (a stop_callback winding its work down) must not delay the other's report.
TEST_P(Conformance, ASlowLossCallbackOfOneHoldDoesNotDelayAnothersReport) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(kShortTtl));
  auto first = cut_off.mutex(name("one"));
  auto second = cut_off.mutex(name("two"));
  std::atomic<bool> release_slow{false};
  std::thread second_holder;
  std::optional<LossTime> second_lost;
  std::promise<std::stop_token> second_token;
  first.lock();
  // The second hold belongs to another thread (holds are per thread).
  std::promise<void> done;
  second_holder = std::thread([&] {
    second.lock();
    second_token.set_value(second.lost_token());
    done.get_future().wait();
    second.unlock();
  });
  OnExit cleanup([&] {
    release_slow = true;
    proxy.forward();
    done.set_value();
    second_holder.join();
  });
  second_lost.emplace(second_token.get_future().get());
  std::atomic<Clock::rep> first_told{0};
  auto slow = [&] {
    first_told = Clock::now().time_since_epoch().count();
    const auto until = Clock::now() + 4s;
    while (!release_slow && Clock::now() < until) std::this_thread::sleep_for(10ms);
  };
  std::stop_callback slow_callback(first.lost_token(), slow);
  const auto cut = proxy.blackhole_when_quiet(kQuiet);
  const auto bound = cut + kShortTtl - loss_margin(kShortTtl);
  ASSERT_TRUE(eventually([&] { return second_lost->reported() && first_told.load() != 0; }, kShortTtl + 10s))
      << "a cut-off hold was never reported lost";
  EXPECT_LE(second_lost->at(), bound + 200ms) << "the second hold was told " << ms(second_lost->at() - cut)
                                              << " ms after the cut: held up by the first's callback";
  release_slow = true;
  first.unlock();
}

// Issue 15.4 and red team rt3.4: a downgrade that fails inside unlock() (the link is cut) must
// neither deadlock a loss callback that looks at the lock nor leave the write entry behind for
// the client's life: the hold is released whole (in the background once the link is back) and
// the remaining read is told it is lost.
TEST_P(Conformance, AFailedDowngradeReleasesTheHoldWholeWithoutDeadlock) {
  SKIP_WITHOUT_SERVER();
  TcpProxy proxy(url());
  auto cut_off = connect_through(proxy, url(), with_ttl(kLongTtl));
  cut_off.set_error_handler([](const turnstile::Error&) {});
  const auto lock_name = name("rw");
  auto rw = cut_off.shared_mutex(lock_name);
  rw.lock();
  rw.lock_shared();
  std::atomic<int> looked{0};
  std::stop_callback look(rw.lost_token(), [&] {
    static_cast<void>(rw.owns_shared());  // takes the lock's own mutex: must not deadlock
    ++looked;
  });
  proxy.blackhole();
  OnExit heal([&] { proxy.forward(); });
  // On this thread (holds are per thread); a deadlock shows as the test's own timeout.
  const auto start = Clock::now();
  rw.unlock();
  EXPECT_LT(Clock::now() - start, 15s) << "unlock() of a writer holding a read took too long";
  proxy.forward();
  ASSERT_EQ(rw.hold_state(), turnstile::HoldState::lost) << "a downgrade over a cut link did not fail";
  // The downgrade failed: the whole hold was released (retried in the background) and told.
  EXPECT_TRUE(eventually([&] { return looked.load() == 1; }, 2s));
  auto writer = connect().shared_mutex(lock_name);
  EXPECT_TRUE(writer.try_lock_for(8s)) << "the write entry of a failed downgrade stayed behind";
  if (writer.owns_lock()) writer.unlock();
  rw.unlock_shared();
}

}  // namespace conformance
