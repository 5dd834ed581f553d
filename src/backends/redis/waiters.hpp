// This process's waiters and how a message or the watchdog wakes them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "backends/redis/subscriber.hpp"
#include "backends/redis/timeouts.hpp"
#include "core/call_budget.hpp"

namespace turnstile::detail::redis {

// This process's waiters, by channel. A message only wakes a waiter: it then asks the server.
// Each sleeps on a condition variable of its own, notified only when it is poked, so a message
// that names one waiter runs one thread.
class Waiters {
 public:
  enum class Line { queue, counter };
  struct Waiter {
    std::string seq;          // queue waiters: our entry, "" until known (every message wakes us)
    std::uint64_t place = 0;  // counter waiters: our place in line, 0 until known (likewise)
    bool poked = false;
    // Queue waiters: the name and the entry's request id, and whether its entry waits in the
    // queue (the watchdog renews it then, and wakes it when the server says admitted or gone).
    std::string name, request;
    bool queued = false;
    std::condition_variable_any wake;  // notified (under the table's mutex) when poked
  };
  // A queued entry the watchdog renews.
  struct Queued {
    std::string channel, name, seq, request;
  };

  void add(Line line, const std::string& channel, Waiter& waiter) {
    std::lock_guard lock(mutex_);
    table(line)[channel].insert(&waiter);
  }
  void remove(Line line, const std::string& channel, Waiter& waiter) {
    std::lock_guard lock(mutex_);
    if (std::exchange(waiter.queued, false)) --queued_;
    auto& waiters = table(line)[channel];
    waiters.erase(&waiter);
    if (waiters.empty()) table(line).erase(channel);
  }
  // Changes what the waiter answers to, or clears its poke before it looks.
  template <typename Change>
  void update(Waiter& waiter, Change change) {
    std::lock_guard lock(mutex_);
    change(waiter);
  }
  // A queue message names the seqs it admitted; a counter message wakes the first in line.
  void on_message(const std::string& channel, const std::string& payload) {
    std::lock_guard lock(mutex_);
    if (const auto queue = queue_.find(channel); queue != queue_.end()) {
      std::set<std::string> named;
      std::istringstream seqs(payload);
      for (std::string seq; seqs >> seq;) named.insert(seq);
      for (auto* waiter : queue->second) {
        if (waiter->seq.empty() || named.count(waiter->seq)) poke(*waiter);
      }
    }
    if (const auto counter = counter_.find(channel); counter != counter_.end()) {
      Waiter* first = nullptr;
      for (auto* waiter : counter->second) {
        if (waiter->place == 0) poke(*waiter);
        else if (!first || waiter->place < first->place) first = waiter;
      }
      if (first) poke(*first);
    }
  }
  // The local counter waiter first in line (place `head`) looks again.
  void poke_counter_head(const std::string& channel, std::uint64_t head) {
    std::lock_guard lock(mutex_);
    if (const auto counter = counter_.find(channel); counter != counter_.end()) {
      for (auto* waiter : counter->second) {
        if (waiter->place == head) poke(*waiter);
      }
    }
  }
  // Marks a queue waiter's entry queued (or no longer): true when it is this client's first.
  bool set_queued(Waiter& waiter, bool queued) {
    std::lock_guard lock(mutex_);
    if (waiter.queued == queued) return false;
    waiter.queued = queued;
    queued_ += queued ? 1 : -1;
    return queued && queued_ == 1;
  }
  bool any_queued() {
    std::lock_guard lock(mutex_);
    return queued_ > 0;
  }
  std::vector<Queued> queued() {
    std::lock_guard lock(mutex_);
    std::vector<Queued> entries;
    for (const auto& [channel, waiters] : queue_) {
      for (const auto* waiter : waiters) {
        if (waiter->queued && !waiter->seq.empty())
          entries.push_back({channel, waiter->name, waiter->seq, waiter->request});
      }
    }
    return entries;
  }
  // The queue waiter of entry `seq` on `channel` looks again (the watchdog found it admitted or gone).
  void poke_entry(const std::string& channel, const std::string& seq) {
    std::lock_guard lock(mutex_);
    if (const auto queue = queue_.find(channel); queue != queue_.end()) {
      for (auto* waiter : queue->second) {
        if (waiter->seq == seq) poke(*waiter);
      }
    }
  }
  void poke_all() {
    std::lock_guard lock(mutex_);
    for (auto* line : {&queue_, &counter_}) {
      for (auto& [channel, waiters] : *line) {
        for (auto* waiter : waiters) poke(*waiter);
      }
    }
  }
  // Sleeps until the waiter is poked, `until`, or a stop.
  void sleep(Waiter& waiter, SteadyClock::time_point until, const std::stop_token& stop) {
    std::unique_lock lock(mutex_);
    waiter.wake.wait_until(lock, stop, until, [&] { return waiter.poked; });
  }

 private:
  std::map<std::string, std::set<Waiter*>>& table(Line line) { return line == Line::queue ? queue_ : counter_; }
  static void poke(Waiter& waiter) {
    waiter.poked = true;
    waiter.wake.notify_all();
  }

  std::mutex mutex_;
  std::map<std::string, std::set<Waiter*>> queue_;    // channel -> waiters
  std::map<std::string, std::set<Waiter*>> counter_;  // channel -> waiters
  std::size_t queued_ = 0;                            // queue waiters whose entries wait (Waiter::queued)
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
  // Before a look: a message from now on wakes the next sleep.
  void unpoke() {
    waiters_.update(waiter, [](Waiters::Waiter& w) { w.poked = false; });
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
