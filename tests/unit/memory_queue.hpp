// SPDX-License-Identifier: Apache-2.0
// A queue of entries in memory for the core's loop and async driver tests (queue_loop_test.cpp,
// async_acquire_test.cpp): a plain queue in this process, not a model of any server, with
// counters of what the loop asked for and faults to inject. Its waits are the blocking wait()
// (a sleep until something changes) or, with `event_arms`, an arm() whose wake runs from the
// thread that changed the queue (as a backend's event thread would), costing no thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/queue_store.hpp"
#include "turnstile/error.hpp"

namespace turnstile::testing {

using namespace std::chrono_literals;
using namespace turnstile::detail;

// A queue of entries in memory, with counters of what the loop asked for and faults to inject.
class MemoryQueue : public Backend {
 public:
  struct Item {
    std::uint64_t id;
    EntryKind kind;
    std::int64_t permits;
  };

  // Faults, each used once.
  std::atomic<int> vanish_on_look{0};        // the next looks throw QueueEntryGone
  std::atomic<int> vanish_on_wait{0};        // the next waits throw QueueEntryGone
  std::atomic<int> fail_on_look{0};          // the next looks throw BackendUnavailable
  std::atomic<int> hold_excludes_nobody{0};  // the next holds leave and return nullptr
  std::atomic<int> hold_finds_change{0};     // the next holds throw QueueChanged (entry kept)
  QueueMode foreign_mode = QueueMode::none;  // what the others set the queue to
  std::int64_t foreign_limit = 0;

  std::atomic<int> joins{0}, looks{0}, waits{0}, leaves{0}, holds{0};

  std::uint64_t add(EntryKind kind, std::int64_t permits = 1) {
    std::lock_guard lock(mutex_);
    items_.push_back({++next_id_, kind, permits});
    changed();
    return next_id_;
  }
  void remove(std::uint64_t id) {
    std::lock_guard lock(mutex_);
    std::erase_if(items_, [&](const Item& item) { return item.id == id; });
    changed();
  }
  void set_value(std::int64_t permits) {
    std::lock_guard lock(mutex_);
    value = permits;
    changed();
  }
  // Sleeps until something changes, at most until `deadline` and never more than 100 ms (a
  // change between the loop's look and this wait is then seen late, not missed).
  void sleep(turnstile::Deadline deadline, const std::stop_token& stop) {
    ++sleeping_;
    std::unique_lock lock(mutex_);
    auto until = turnstile::SteadyClock::now() + 100ms;
    if (deadline) until = std::min(until, *deadline);
    const auto seen = version_;
    changed_.wait_until(lock, stop, until, [&] { return version_ != seen; });
    --sleeping_;
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return items_.size();
  }
  // How many threads are inside wait() right now: proof that a waiter really waits.
  int sleeping() { return sleeping_.load(); }

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool, turnstile::Deadline, Standing& first) override;
  bool tries_locally() const override { return local_tries; }
  bool local_tries = false;  // as the embedded backend: an async acquire on a pool thread tries first
  turnstile::Inspection inspect(const std::string&, turnstile::Deadline) override { return {}; }
  bool counter_try_set(const std::string&, std::int64_t) override { return false; }
  std::int64_t counter_add(const std::string&, std::int64_t delta) override {
    std::lock_guard lock(mutex_);
    value = value.value_or(0) + delta;
    changed();
    return *value;
  }
  std::optional<std::int64_t> counter_get(const std::string&) override {
    std::lock_guard lock(mutex_);
    return value;
  }
  std::int64_t counter_drain(const std::string&) override { return 0; }

  // arm() without a thread per waiter: the wakes armed now run on the next change, from the
  // changing thread, and every 50 ms from one ticker thread (a change between a look and its
  // arm is then seen late, not missed, as a backend's renewal round pokes its waiters). They
  // run under the mutex, so a disarm, which takes it, never finds one running.
  void use_event_arms() {
    event_arms = true;
    ticker_ = std::jthread([this](std::stop_token stop) {
      std::unique_lock lock(mutex_);
      while (!changed_.wait_for(lock, stop, 50ms, [&] { return stop.stop_requested(); })) fire_wakes_locked();
    });
  }
  bool event_arms = false;
  std::atomic<int> arms{0};
  std::size_t armed() {
    std::lock_guard lock(mutex_);
    return wakes_.size();
  }
  class EventArm : public WakeArm {
   public:
    EventArm(MemoryQueue& queue, Wake wake) : queue_(queue) {
      std::lock_guard lock(queue_.mutex_);
      at_ = queue_.wakes_.insert(queue_.wakes_.end(), std::move(wake));
    }
    ~EventArm() override {
      std::lock_guard lock(queue_.mutex_);
      if (at_ != queue_.wakes_.end()) queue_.wakes_.erase(at_);
    }
    MemoryQueue& queue_;
    std::list<Wake>::iterator at_;
  };
  std::unique_ptr<WakeArm> event_arm(Wake wake) {
    ++arms;
    return std::make_unique<EventArm>(*this, std::move(wake));
  }
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;

  // PermitCounter state.
  std::optional<std::int64_t> value;
  std::atomic<int> lose_take_reply{0};    // the next take applies but "loses its reply"
  std::atomic<int> take_finds_change{0};  // the next takes find the value changed (nothing taken)
  std::atomic<int> takes{0};

 private:
  friend class MemoryPlace;
  friend class MemoryLine;
  Standing standing_of(std::uint64_t id) {
    std::lock_guard lock(mutex_);
    Standing standing;
    standing.mode = foreign_mode;
    standing.limit = foreign_limit;
    for (const auto& item : items_) {
      standing.entries.push_back({item.kind, item.permits});
      if (item.id == id) return standing;
    }
    throw QueueEntryGone{};
  }

  std::mutex mutex_;
  std::condition_variable_any changed_;
  std::vector<Item> items_;
  std::uint64_t next_id_ = 0;
  std::uint64_t version_ = 0;
  std::atomic<int> sleeping_{0};
  void changed() {
    ++version_;
    changed_.notify_all();
    fire_wakes_locked();
  }
  void fire_wakes_locked() {
    for (auto& wake : wakes_) {
      if (wake) std::exchange(wake, nullptr)();  // at most once
    }
  }
  std::list<Wake> wakes_;
  std::jthread ticker_;              // last: stopped before the wakes go
  std::vector<std::uint64_t> line_;  // counter waiters
};

class MemoryHold : public BackendHold {
 public:
  MemoryHold(MemoryQueue& queue, std::uint64_t id) : queue_(queue), id_(id) {}
  std::uint64_t fencing_token() const override { return id_; }
  void downgrade() override {}
  void release() override { queue_.remove(id_); }

 private:
  MemoryQueue& queue_;
  std::uint64_t id_;
};

class MemoryPlace : public QueuePlace {
 public:
  MemoryPlace(MemoryQueue& queue, std::uint64_t id) : queue_(queue), id_(id) {}
  Standing look(turnstile::Deadline) override {
    ++queue_.looks;
    if (queue_.vanish_on_look.fetch_sub(1) > 0) {
      queue_.remove(id_);
      throw QueueEntryGone{};
    }
    if (queue_.fail_on_look.fetch_sub(1) > 0) throw turnstile::BackendUnavailable("no answer (injected)");
    return queue_.standing_of(id_);
  }
  void wait(const Verdict&, turnstile::Deadline deadline, const std::stop_token& stop) override {
    ++queue_.waits;
    if (queue_.vanish_on_wait.fetch_sub(1) > 0) {
      queue_.remove(id_);
      throw QueueEntryGone{};
    }
    queue_.sleep(deadline, stop);
  }
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, turnstile::Deadline deadline, Wake wake) override {
    if (queue_.event_arms) return queue_.event_arm(std::move(wake));
    return QueuePlace::arm(verdict, deadline, std::move(wake));
  }
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal>) override {
    ++queue_.holds;
    if (queue_.hold_finds_change.fetch_sub(1) > 0) throw QueueChanged{};
    if (queue_.hold_excludes_nobody.fetch_sub(1) > 0) {
      leave();
      return nullptr;
    }
    return std::make_unique<MemoryHold>(queue_, id_);
  }
  void leave() noexcept override {
    ++queue_.leaves;
    queue_.remove(id_);
  }

 private:
  MemoryQueue& queue_;
  std::uint64_t id_;
};

inline std::unique_ptr<QueuePlace> MemoryQueue::join(const QueueRequest& request, bool, turnstile::Deadline,
                                                     Standing& first) {
  ++joins;
  const auto id = add(request.kind, request.permits);
  first = standing_of(id);
  return std::make_unique<MemoryPlace>(*this, id);
}

class MemoryLine : public CounterLine {
 public:
  MemoryLine(MemoryQueue& queue, std::int64_t permits) : queue_(queue), permits_(permits) {}
  CounterStanding look(bool, turnstile::Deadline) override {
    ++queue_.looks;
    std::lock_guard lock(queue_.mutex_);
    CounterStanding standing;
    standing.value = queue_.value;
    standing.in_line = id_ != 0;
    const auto& line = queue_.line_;
    if (!standing.in_line) {
      standing.ahead = line.size();
    } else {
      const auto at = std::find(line.begin(), line.end(), id_);
      if (at == line.end()) throw QueueEntryGone{};
      standing.ahead = static_cast<std::size_t>(at - line.begin());
    }
    return standing;
  }
  bool take(const CounterStanding& seen, turnstile::Deadline) override {
    ++queue_.takes;
    if (queue_.take_finds_change.fetch_sub(1) > 0) return false;
    {
      std::lock_guard lock(queue_.mutex_);
      if (queue_.value != seen.value) return false;
      *queue_.value -= permits_;
      std::erase(queue_.line_, id_);
      taken_ = true;
      queue_.changed();
    }
    if (queue_.lose_take_reply.fetch_sub(1) > 0) throw turnstile::BackendUnavailable("reply lost (injected)");
    return true;
  }
  void join(turnstile::Deadline) override {
    std::lock_guard lock(queue_.mutex_);
    id_ = ++queue_.next_id_;
    queue_.line_.push_back(id_);
  }
  void wait(CounterWait, turnstile::Deadline deadline, const std::stop_token& stop) override {
    ++queue_.waits;
    queue_.sleep(deadline, stop);
  }
  std::unique_ptr<WakeArm> arm(CounterWait what, turnstile::Deadline deadline, Wake wake) override {
    if (queue_.event_arms) return queue_.event_arm(std::move(wake));
    return CounterLine::arm(what, deadline, std::move(wake));
  }
  bool leave() noexcept override {
    ++queue_.leaves;
    std::lock_guard lock(queue_.mutex_);
    std::erase(queue_.line_, id_);
    queue_.changed();
    return taken_;
  }

 private:
  MemoryQueue& queue_;
  std::int64_t permits_;
  std::uint64_t id_ = 0;
  bool taken_ = false;
};

inline std::unique_ptr<CounterLine> MemoryQueue::counter_line(const std::string&, std::int64_t permits,
                                                              const std::stop_token&) {
  return std::make_unique<MemoryLine>(*this, permits);
}

}  // namespace turnstile::testing
