// SPDX-License-Identifier: Apache-2.0
#include "core/guaranteed_removal.hpp"

#include <algorithm>

#include "core/fork_generation.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

GuaranteedRemoval::GuaranteedRemoval(Backoff backoff, Report report, Driver driver)
    : backoff_(backoff), report_(std::move(report)), driver_(driver), generation_(fork_generation()) {}

GuaranteedRemoval::~GuaranteedRemoval() {
  std::lock_guard lock(mutex_);
  forget_parent_locked();  // in a child, the thread object is the parent's: never join it
  thread_.request_stop();
  wake_.notify_all();
}

void GuaranteedRemoval::forget_parent_locked() {
  const auto generation = fork_generation();
  if (generation == generation_) return;
  // The thread does not exist in this process: joining it would wait forever. Its object is
  // leaked on purpose, like the parent's items (they hold the parent's connections).
  if (thread_.joinable()) static_cast<void>(new std::jthread(std::move(thread_)));
  for (auto& item : items_) static_cast<void>(new BudgetedAttempt(std::move(item.attempt)));
  items_.clear();
  in_flight_ = 0;  // the parent's attempts in flight are not this process's
  generation_ = generation;
}

void GuaranteedRemoval::add(std::string what, Attempt attempt) {
  add(std::move(what), BudgetedAttempt([attempt = std::move(attempt)](const CallBudget&) { return attempt(); }));
}

void GuaranteedRemoval::add(std::string what, BudgetedAttempt attempt) {
  add_item(std::nullopt, std::move(what), std::move(attempt));
}

void GuaranteedRemoval::add_at(SteadyClock::time_point first_try, std::string what, BudgetedAttempt attempt) {
  add_item(first_try, std::move(what), std::move(attempt));
}

void GuaranteedRemoval::add_item(std::optional<SteadyClock::time_point> at, std::string what, BudgetedAttempt attempt) {
  std::lock_guard lock(mutex_);
  forget_parent_locked();
  if (closed_) return;  // `attempt` is dropped (after the mutex is released: declared first)
  const auto now = SteadyClock::now();
  const auto first_try = at.value_or(now + backoff_.first_try.value_or(backoff_.first_pause));
  // The bound counts from the hand-over, or from the time asked for (a removal not due before).
  const auto from = at ? std::max(now, *at) : now;
  const auto give_up = backoff_.give_up ? from + *backoff_.give_up : SteadyClock::time_point::max();
  items_.push_back({std::move(what), std::move(attempt), backoff_.first_pause, first_try, give_up, {}});
  ++added_;
  if (driver_ == Driver::own_thread && !thread_.joinable()) {
    thread_ = std::jthread([this](std::stop_token stop) { run(std::move(stop)); });
  }
  wake_.notify_all();
}

std::size_t GuaranteedRemoval::pending() const {
  std::lock_guard lock(mutex_);
  if (generation_ != fork_generation()) return 0;  // a forked child: the items are the parent's
  return items_.size() + in_flight_;
}

void GuaranteedRemoval::report_given_up(const Item& item) {
  if (!report_) return;
  const auto why = item.last_error.empty() ? std::string() : ": " + item.last_error;
  report_(item.what,
          std::make_exception_ptr(BackendUnavailable("gave up removing " + item.what + " in the background" + why)));
}

std::optional<SteadyClock::time_point> GuaranteedRemoval::next_due() const {
  std::lock_guard lock(mutex_);
  if (generation_ != fork_generation()) return std::nullopt;  // a forked child: the items are the parent's
  return earliest_due_locked();
}

std::optional<SteadyClock::time_point> GuaranteedRemoval::earliest_due_locked() const {
  std::optional<SteadyClock::time_point> due;
  for (const auto& item : items_) due = due ? std::min(*due, item.next_try) : item.next_try;
  return due;
}

bool GuaranteedRemoval::attempt(Item& item, const CallBudget& budget) {
  std::exception_ptr error;
  try {
    if (item.attempt(budget) != Removal::again) return true;
  } catch (const BackendUnavailable& unavailable) {
    item.last_error = unavailable.what();  // no answer: like `again`, and the reason is kept
  } catch (...) {
    error = std::current_exception();
  }
  const auto now = SteadyClock::now();
  if (!error && now < item.give_up) {
    // The handing over waited first_pause; each retry after it waits twice the pause before,
    // measured from the attempt's end: never a hot loop.
    item.pause = std::min(item.pause * 2, backoff_.last_pause);
    item.next_try = now + item.pause;
    return false;
  }
  if (!error) {
    report_given_up(item);
  } else if (report_) {
    report_(item.what, error);
  }
  return true;
}

std::deque<GuaranteedRemoval::Item> GuaranteedRemoval::take_due(SteadyClock::time_point now) {
  std::lock_guard lock(mutex_);
  forget_parent_locked();
  std::deque<Item> due;
  for (auto it = items_.begin(); it != items_.end();) {
    if (it->next_try <= now) {
      due.push_back(std::move(*it));
      it = items_.erase(it);
    } else {
      ++it;
    }
  }
  in_flight_ += due.size();
  return due;
}

void GuaranteedRemoval::put_back(std::deque<Item>& items, std::size_t taken) {
  std::unique_lock lock(mutex_);
  in_flight_ -= std::min(in_flight_, taken);
  if (closed_) {
    lock.unlock();
    items.clear();
    return;
  }
  for (auto& item : items) items_.push_back(std::move(item));
  items.clear();
}

std::size_t GuaranteedRemoval::run_due() { return run_due(CallBudget()); }

std::size_t GuaranteedRemoval::run_due(const CallBudget& budget) {
  // Attempts run without the mutex: a removal handed over meanwhile never waits on the network.
  auto due = take_due(SteadyClock::now());
  std::deque<Item> again;
  for (auto& item : due) {
    if (!attempt(item, budget)) again.push_back(std::move(item));
  }
  put_back(again, due.size());
  return pending();
}

void GuaranteedRemoval::run(std::stop_token stop) {
  while (!stop.stop_requested()) {
    {
      std::unique_lock lock(mutex_);
      if (items_.empty()) {
        wake_.wait(lock, stop, [&] { return !items_.empty(); });
        continue;
      }
      const auto due = *earliest_due_locked();
      // A new item may be due before `due`: it ends the wait, and the earliest is taken again.
      const auto added = added_;
      if (wake_.wait_until(lock, stop, due, [&] { return added_ != added; }); stop.stop_requested()) return;
    }
    run_due(CallBudget(std::nullopt, stop));  // stop_thread() ends an attempt that honours it
  }
}

void GuaranteedRemoval::stop_thread() {
  std::jthread thread;
  {
    std::lock_guard lock(mutex_);
    forget_parent_locked();  // a parent's thread is not joined (it does not exist here)
    thread = std::move(thread_);
  }
  if (!thread.joinable()) return;
  thread.request_stop();
  wake_.notify_all();
  thread.join();  // its attempt in flight ends by its own bound
}

void GuaranteedRemoval::close() {
  std::deque<Item> dropped;  // destroyed after the thread is joined, without the mutex
  {
    std::lock_guard lock(mutex_);
    forget_parent_locked();
    closed_ = true;
    dropped.swap(items_);
  }
  stop_thread();
}

void GuaranteedRemoval::drain(milliseconds within) {
  // The thread stops first (its attempt in flight is asked to stop and finished): no attempt of
  // it is still in flight when what is left is given up. The drain's own attempts are told its
  // end, so a client's end is not held past it by an attempt's own longer limit.
  const auto end = SteadyClock::now() + within;
  stop_thread();
  {
    std::lock_guard lock(mutex_);
    for (auto& item : items_) {
      item.next_try = SteadyClock::now();
      item.give_up = std::min(item.give_up, end);
    }
  }
  while (run_due(CallBudget(end)) > 0 && SteadyClock::now() < end) {
    std::unique_lock lock(mutex_);
    if (items_.empty()) break;
    const auto due = *earliest_due_locked();
    lock.unlock();
    std::this_thread::sleep_until(std::min(due, end));
  }
  std::deque<Item> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(items_);
  }
  for (const auto& item : left) report_given_up(item);  // not done by the end: said, not dropped silently
}

}  // namespace turnstile::detail
