// SPDX-License-Identifier: Apache-2.0
// This process's waiters and how a message or the watchdog wakes them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "backends/redis/subscriber.hpp"
#include "backends/redis/timeouts.hpp"
#include "core/call_budget.hpp"
#include "core/queue_store.hpp"

namespace turnstile::detail::redis {

// This process's waiters, by channel. A message only wakes a waiter: it then asks the server.
// A blocking waiter sleeps on a condition variable of its own, notified only when it is poked,
// so a message that names one waiter runs one thread. An async waiter (QueuePlace::arm,
// CounterLine::arm) has no thread: its poke runs its armed wake once, outside the table's lock,
// on the thread that poked it (the subscriber's or the watchdog's), or on the subscriber's next
// turn when the poke came from a caller's thread or the wake is due as it is armed.
class Waiters {
 public:
  enum class Line { queue, counter };
  // One arming of an async waiter. Its state and wake are guarded by the table's mutex, except
  // while running: then only the thread running it touches the wake.
  struct Armed {
    enum class State { armed, running, done } state = State::armed;
    Wake wake;
  };
  using Fired = std::vector<std::shared_ptr<Armed>>;
  struct Waiter {
    // Set only through set_seq / set_place (the table finds a waiter by them).
    std::string seq;          // queue waiters: our entry, "" until known (every message wakes us)
    std::uint64_t place = 0;  // counter waiters: our place in line, 0 until known (likewise)
    bool poked = false;
    // Queue waiters: the name and the entry's request id, and whether its entry waits in the
    // queue (the watchdog renews it then, and wakes it when the server says admitted or gone).
    std::string name, request;
    bool queued = false;
    // Queue waiters: a message named the entry since the last look (its script admitted it),
    // and the send time of the latest call that found the entry there and renewed it.
    bool named = false;
    SteadyClock::time_point renewed_at{};
    std::condition_variable_any wake;  // notified (under the table's mutex) when poked
    std::shared_ptr<Armed> armed;      // an async waiter's latest arming (run when poked)
    // Counter waiters: the start of the latest look, and whether the watchdog's rounds re-check
    // it (an async waiter has no thread to time its re-checks).
    SteadyClock::time_point looked_at{};
    bool rechecked = false;
  };
  // A queued entry the watchdog renews.
  struct Queued {
    std::string channel, name, seq, request;
  };

  void add(Line line, const std::string& channel, Waiter& waiter);
  void remove(Line line, const std::string& channel, Waiter& waiter);
  // Changes the waiter's other fields, or clears its poke before it looks.
  template <typename Change>
  void update(Waiter& waiter, Change change) {
    std::lock_guard lock(mutex_);
    change(waiter);
  }
  // What the waiter answers to, once its script told: a queue entry's seq, a place in line.
  void set_seq(const std::string& channel, Waiter& waiter, std::string seq);
  void set_place(const std::string& channel, Waiter& waiter, std::uint64_t place);
  // A queue message names the seqs it admitted; a counter message wakes the first in line.
  void on_message(const std::string& channel, const std::string& payload);
  // The local counter waiter first in line (place `head`) looks again. Called from a look, on
  // a caller's thread: an async waiter's wake waits for the subscriber's turn (true: ask for it).
  bool poke_counter_head(const std::string& channel, std::uint64_t head);
  // Marks a queue waiter's entry queued (or no longer): true when it is this client's first.
  bool set_queued(Waiter& waiter, bool queued);
  bool any_queued() {
    std::lock_guard lock(mutex_);
    return queued_ > 0;
  }
  std::vector<Queued> queued();
  // The queue waiter of entry `seq` on `channel` looks again (the watchdog found it admitted or gone).
  void poke_entry(const std::string& channel, const std::string& seq);
  // The watchdog's call sent at `sent_at` found entry `seq` on `channel` there and renewed it.
  void renewed(const std::string& channel, const std::string& seq, SteadyClock::time_point sent_at);
  // Every waiter looks again (the subscriber reconnected: messages may have been missed).
  void poke_all();
  // The server confirmed a new subscription to `channel`: its waiters look again, as a message
  // published before it took was missed (only a blocking waiter's first sleep, or an async
  // waiter armed before the confirmation, is still waiting for it).
  void poke_channel(const std::string& channel);
  // The watchdog's round: async counter waiters whose last look began `due_after` ago or more
  // look again (their place in line lives by their looks, and a message may have been lost),
  // as a blocking counter waiter's re-check does.
  void poke_rechecks(milliseconds due_after);
  // The watchdog re-checks this counter waiter from now on: true when it is the first.
  bool recheck(Waiter& waiter);
  bool any_rechecked() {
    std::lock_guard lock(mutex_);
    return rechecked_ > 0;
  }

  // Arms the waiter's wake. It is due at once (true in `due`: the caller asks the subscriber for
  // a turn, which runs it) when `now`, or when a poke came since the waiter's last look.
  std::shared_ptr<Armed> arm(Waiter& waiter, Wake wake, bool now, bool& due);
  // Once this returns, the wake is neither running nor will it run.
  void disarm(const std::shared_ptr<Armed>& armed);
  // The subscriber's turn: runs the wakes that are due.
  void run_due();
  // Sleeps until the waiter is poked, `until`, or a stop.
  void sleep(Waiter& waiter, SteadyClock::time_point until, const std::stop_token& stop) {
    std::unique_lock lock(mutex_);
    waiter.wake.wait_until(lock, stop, until, [&] { return waiter.poked; });
  }

 private:
  // A channel's waiters: by what they answer to, once known (so that a message, a renewal's
  // answer or a poke finds its waiter without a walk of thousands), and the others.
  struct Channel {
    std::set<Waiter*> unknown;                       // no seq or place yet: every message wakes them
    std::multimap<std::string, Waiter*> by_seq;      // queue waiters
    std::multimap<std::uint64_t, Waiter*> by_place;  // counter waiters, first in line first
    template <typename Each>
    void each(Each each) const {
      for (auto* waiter : unknown) each(*waiter);
      for (const auto& [seq, waiter] : by_seq) each(*waiter);
      for (const auto& [place, waiter] : by_place) each(*waiter);
    }
  };
  std::map<std::string, Channel>& table(Line line) { return line == Line::queue ? queue_ : counter_; }
  // The queue waiter of entry `seq` on `channel`, or nullptr (under the table's mutex).
  Waiter* find_entry(const std::string& channel, const std::string& seq);
  // Under the table's mutex: a blocking waiter is notified, an armed async one goes to `fired`.
  static void poke(Waiter& waiter, Fired& fired) {
    waiter.poked = true;
    waiter.wake.notify_all();
    if (waiter.armed && waiter.armed->state == Armed::State::armed) fired.push_back(waiter.armed);
  }
  // Outside the table's mutex: each wake still armed runs once.
  void run(const Fired& fired);

  std::mutex mutex_;
  std::condition_variable ran_;             // an armed wake finished running (disarm waits for it)
  Fired due_;                               // wakes to run at the subscriber's next turn
  std::map<std::string, Channel> queue_;    // by channel
  std::map<std::string, Channel> counter_;  // by channel
  std::size_t queued_ = 0;                  // queue waiters whose entries wait (Waiter::queued)
  std::size_t rechecked_ = 0;               // counter waiters the watchdog re-checks
};

// An armed wake; destroying it disarms (waiting for the wake if it is running).
class ArmedWake final : public WakeArm {
 public:
  ArmedWake(Waiters& waiters, std::shared_ptr<Waiters::Armed> armed) : waiters_(waiters), armed_(std::move(armed)) {}
  ~ArmedWake() override { waiters_.disarm(armed_); }

 private:
  Waiters& waiters_;
  std::shared_ptr<Waiters::Armed> armed_;
};

// One acquire's waiter: registered before its first script runs, so that a message published
// between that script's reply and our reading it still wakes it (to look: it proves nothing by
// itself); subscribed once it has to wait.
class Listener {
 public:
  Listener(Waiters& waiters, Subscriber& subscriber, Waiters::Line line, std::string channel)
      : waiters_(waiters), subscriber_(subscriber), line_(line), channel_(std::move(channel)),
        was_listening_(subscriber.listening(channel_)) {
    waiters_.add(line_, channel_, waiter);
  }
  ~Listener() {
    waiters_.remove(line_, channel_, waiter);
    if (subscribed_) subscriber_.unsubscribe(channel_);
  }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Subscribes the first time. True when the waiter should look now rather than sleep: the
  // subscription is new, so a message published before it took was missed (when the channel
  // was listened to before our first script ran, every message since reached us).
  bool subscribe(const CallBudget& budget) {
    if (subscribed_) return false;
    const auto confirm = budget.until(SteadyClock::now() + kSubscribeConfirm);
    subscriber_.subscribe(channel_, *confirm.deadline(), confirm.stop());
    subscribed_ = true;
    return !was_listening_;
  }
  // Without a thread: arms `wake` to run when a message names us, the subscriber reconnects or
  // the watchdog pokes us (as sleep() would return). The first arming subscribes without
  // waiting for the server's confirmation: when the channel was not listened to before our
  // first script ran, a message may have been missed, so the wake is due once the subscription
  // is confirmed (at once when it is already; else the confirmation pokes the channel, before
  // `listening` says so: a poke between our check and our arming leaves `poked` set).
  std::unique_ptr<WakeArm> arm(Wake wake) {
    const bool first = !std::exchange(subscribed_, true);
    if (first) subscriber_.want(channel_);
    const bool missed = first && !was_listening_ && subscriber_.listening(channel_);
    bool due = false;
    auto armed = waiters_.arm(waiter, std::move(wake), missed, due);
    if (due) subscriber_.request_turn();
    return std::make_unique<ArmedWake>(waiters_, std::move(armed));
  }
  // Before a look: a message from now on wakes the next sleep (or arming).
  void unpoke() {
    waiters_.update(waiter, [](Waiters::Waiter& w) {
      w.poked = false;
      w.looked_at = SteadyClock::now();
    });
  }
  // Until a message names us (or the watchdog pokes us), the re-check interval passes (none:
  // never), the deadline, or a stop.
  void sleep(std::optional<milliseconds> recheck, const CallBudget& budget) {
    const auto until = budget.until(SteadyClock::now() + recheck.value_or(std::chrono::hours(24)));
    waiters_.sleep(waiter, *until.deadline(), until.stop());
  }

  Waiters::Waiter waiter;

 private:
  Waiters& waiters_;
  Subscriber& subscriber_;
  Waiters::Line line_;
  std::string channel_;
  bool was_listening_;
  bool subscribed_ = false;
};
}  // namespace turnstile::detail::redis
