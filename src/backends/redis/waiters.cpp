// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/waiters.hpp"

#include <sstream>

namespace turnstile::detail::redis {
namespace {

// Takes `waiter` out of `index` under `key` (other waiters may share it).
template <typename Index, typename Key>
void unindex(Index& index, const Key& key, Waiters::Waiter& waiter) {
  const auto [from, to] = index.equal_range(key);
  for (auto it = from; it != to; ++it) {
    if (it->second == &waiter) {
      index.erase(it);
      return;
    }
  }
}

}  // namespace

void Waiters::add(Line line, const std::string& channel, Waiter& waiter) {
  std::lock_guard lock(mutex_);
  table(line)[channel].unknown.insert(&waiter);
}

void Waiters::remove(Line line, const std::string& channel, Waiter& waiter) {
  std::lock_guard lock(mutex_);
  if (std::exchange(waiter.queued, false)) --queued_;
  if (std::exchange(waiter.rechecked, false)) --rechecked_;
  auto& waiters = table(line);
  const auto found = waiters.find(channel);
  if (found == waiters.end()) return;
  auto& known = found->second;
  known.unknown.erase(&waiter);
  unindex(known.by_seq, waiter.seq, waiter);
  unindex(known.by_place, waiter.place, waiter);
  if (known.unknown.empty() && known.by_seq.empty() && known.by_place.empty()) waiters.erase(found);
}

void Waiters::set_seq(const std::string& channel, Waiter& waiter, std::string seq) {
  std::lock_guard lock(mutex_);
  auto& known = queue_[channel];
  known.unknown.erase(&waiter);
  unindex(known.by_seq, waiter.seq, waiter);
  waiter.seq = std::move(seq);
  if (waiter.seq.empty()) known.unknown.insert(&waiter);
  else known.by_seq.emplace(waiter.seq, &waiter);
}

void Waiters::set_place(const std::string& channel, Waiter& waiter, std::uint64_t place) {
  std::lock_guard lock(mutex_);
  auto& known = counter_[channel];
  known.unknown.erase(&waiter);
  unindex(known.by_place, waiter.place, waiter);
  waiter.place = place;
  if (place == 0) known.unknown.insert(&waiter);
  else known.by_place.emplace(place, &waiter);
}

Waiters::Waiter* Waiters::find_entry(const std::string& channel, const std::string& seq) {
  const auto queue = queue_.find(channel);
  if (queue == queue_.end()) return nullptr;
  const auto found = queue->second.by_seq.find(seq);
  return found == queue->second.by_seq.end() ? nullptr : found->second;
}

void Waiters::on_message(const std::string& channel, const std::string& payload) {
  Fired fired;
  std::unique_lock lock(mutex_);
  if (const auto queue = queue_.find(channel); queue != queue_.end()) {
    std::istringstream seqs(payload);
    for (std::string seq; seqs >> seq;) {
      const auto [from, to] = queue->second.by_seq.equal_range(seq);
      for (auto it = from; it != to; ++it) {
        it->second->named = true;
        poke(*it->second, fired);
      }
    }
    for (auto* waiter : queue->second.unknown) poke(*waiter, fired);
  }
  if (const auto counter = counter_.find(channel); counter != counter_.end()) {
    for (auto* waiter : counter->second.unknown) poke(*waiter, fired);
    if (!counter->second.by_place.empty()) poke(*counter->second.by_place.begin()->second, fired);
  }
  lock.unlock();
  run(fired);
}

bool Waiters::poke_counter_head(const std::string& channel, std::uint64_t head) {
  std::lock_guard lock(mutex_);
  Fired fired;
  if (const auto counter = counter_.find(channel); counter != counter_.end()) {
    const auto [from, to] = counter->second.by_place.equal_range(head);
    for (auto it = from; it != to; ++it) poke(*it->second, fired);
  }
  due_.insert(due_.end(), fired.begin(), fired.end());
  return !fired.empty();
}

bool Waiters::set_queued(Waiter& waiter, bool queued) {
  std::lock_guard lock(mutex_);
  if (waiter.queued == queued) return false;
  waiter.queued = queued;
  queued_ += queued ? 1 : -1;
  return queued && queued_ == 1;
}

std::vector<Waiters::Queued> Waiters::queued() {
  std::lock_guard lock(mutex_);
  std::vector<Queued> entries;
  for (const auto& [channel, known] : queue_) {
    for (const auto& [seq, waiter] : known.by_seq) {
      if (waiter->queued) entries.push_back({channel, waiter->name, seq, waiter->request});
    }
  }
  return entries;
}

void Waiters::poke_entry(const std::string& channel, const std::string& seq) {
  Fired fired;
  std::unique_lock lock(mutex_);
  if (auto* waiter = find_entry(channel, seq)) poke(*waiter, fired);
  lock.unlock();
  run(fired);
}

void Waiters::renewed(const std::string& channel, const std::string& seq, SteadyClock::time_point sent_at) {
  std::lock_guard lock(mutex_);
  if (auto* waiter = find_entry(channel, seq)) waiter->renewed_at = std::max(waiter->renewed_at, sent_at);
}

void Waiters::poke_all() {
  Fired fired;
  std::unique_lock lock(mutex_);
  for (auto* line : {&queue_, &counter_}) {
    for (const auto& [channel, known] : *line) known.each([&](Waiter& waiter) { poke(waiter, fired); });
  }
  lock.unlock();
  run(fired);
}

void Waiters::poke_channel(const std::string& channel) {
  Fired fired;
  std::unique_lock lock(mutex_);
  for (auto* line : {&queue_, &counter_}) {
    if (const auto found = line->find(channel); found != line->end()) {
      found->second.each([&](Waiter& waiter) { poke(waiter, fired); });
    }
  }
  lock.unlock();
  run(fired);
}

void Waiters::poke_rechecks(milliseconds due_after) {
  Fired fired;
  std::unique_lock lock(mutex_);
  const auto due = SteadyClock::now() - due_after;
  for (const auto& [channel, known] : counter_) {
    known.each([&](Waiter& waiter) {
      if (waiter.rechecked && waiter.looked_at <= due) poke(waiter, fired);
    });
  }
  lock.unlock();
  run(fired);
}

bool Waiters::recheck(Waiter& waiter) {
  std::lock_guard lock(mutex_);
  if (std::exchange(waiter.rechecked, true)) return false;
  return ++rechecked_ == 1;
}

std::shared_ptr<Waiters::Armed> Waiters::arm(Waiter& waiter, Wake wake, bool now, bool& due) {
  auto armed = std::make_shared<Armed>();
  armed->wake = std::move(wake);
  std::lock_guard lock(mutex_);
  waiter.armed = armed;
  due = now || waiter.poked;
  if (due) due_.push_back(armed);
  return armed;
}

void Waiters::disarm(const std::shared_ptr<Armed>& armed) {
  Wake spent;  // destroyed after the lock is released: it may own what its caller holds
  std::unique_lock lock(mutex_);
  ran_.wait(lock, [&] { return armed->state != Armed::State::running; });
  if (armed->state == Armed::State::armed) {
    armed->state = Armed::State::done;
    spent = std::move(armed->wake);
  }
}

void Waiters::run_due() {
  Fired fired;
  {
    std::lock_guard lock(mutex_);
    fired.swap(due_);
  }
  run(fired);
}

void Waiters::run(const Fired& fired) {
  for (const auto& armed : fired) {
    {
      std::lock_guard lock(mutex_);
      if (armed->state != Armed::State::armed) continue;
      armed->state = Armed::State::running;
    }
    try {
      armed->wake();
    } catch (...) {
      // A wake only posts a look; one that fails leaves the acquire to its deadline.
    }
    Wake spent;  // destroyed last, after `done`: it may own the acquire that would disarm it
    {
      std::lock_guard lock(mutex_);
      spent = std::move(armed->wake);
      armed->state = Armed::State::done;
    }
    ran_.notify_all();
  }
}

}  // namespace turnstile::detail::redis
