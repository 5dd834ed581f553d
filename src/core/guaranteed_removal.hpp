// SPDX-License-Identifier: Apache-2.0
// Removals that must happen even when the caller could not wait for them (Curator's
// `guaranteed()` delete): a release or a leave whose reply did not come in time, an entry a
// given-up join may have created, a marker to void. Every backend hands them here instead of
// keeping a janitor of its own.
//
// A backend gives a bounded, idempotent, one-attempt function; the service owns the retries,
// the backoff between them (no hot loop, whatever the attempt answers), the bound after which
// it gives up, and what is reported. Attempts run on one background thread, started on the
// first removal, or — for a backend that batches them into a round of its own (Redis's
// renewal round) — from that round through run_due().
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>

#include "core/time_policy.hpp"

namespace turnstile::detail {

// What one attempt found.
enum class Removal {
  done,       // removed, or found already gone: nothing left to do
  again,      // no answer, or not now: try again after the next pause
  abandoned,  // can never be done (the entry belongs to someone else now): stop, report nothing
};

class GuaranteedRemoval {
 public:
  // One attempt: bounded by its own call limits, safe to repeat. A BackendUnavailable it throws
  // counts as `again`; another turnstile::Error ends the item and is reported.
  using Attempt = std::function<Removal()>;
  // The same, told the budget it must end by: no deadline in the background (the attempt's own
  // limits apply) but the thread's stop, which stop_thread() requests; the drain's end during
  // drain(), so that a client's end is not held past it.
  using BudgetedAttempt = std::function<Removal(const CallBudget& budget)>;
  // Told of an item that ended in an error or was given up (`what` names it; no credentials).
  using Report = std::function<void(const std::string& what, std::exception_ptr error)>;
  enum class Driver { own_thread, caller };

  explicit GuaranteedRemoval(Backoff backoff, Report report = {}, Driver driver = Driver::own_thread);
  ~GuaranteedRemoval();  // stops the thread; call drain() first to try what is pending
  GuaranteedRemoval(const GuaranteedRemoval&) = delete;
  GuaranteedRemoval& operator=(const GuaranteedRemoval&) = delete;

  // Hands over a removal; its first attempt comes after Backoff::first_try (default: the first
  // pause). Never blocks on the network. In a forked child, what the parent handed over is dropped (it is the
  // parent's).
  void add(std::string what, Attempt attempt);
  void add(std::string what, BudgetedAttempt attempt);
  // The same, first tried at `first_try` (a removal that is not due yet: the service's thread
  // is its timer); its give-up bound counts from then.
  void add_at(SteadyClock::time_point first_try, std::string what, BudgetedAttempt attempt);
  // Runs the attempts that are due, in the calling thread (Driver::caller); returns how many
  // items remain.
  std::size_t run_due();
  // Stops the service's thread, then tries every pending item now, and again with the usual
  // pauses, until all are done or `within` has passed (a client's end); what remains is
  // reported as given up and dropped.
  void drain(milliseconds within);
  // Ends the background thread now (joined: an attempt in flight finishes first) and drops
  // what is pending; what is handed over later is dropped too. For a client whose end must
  // leave no thread behind before its connections go (an exit handler).
  void close();
  std::size_t pending() const;
  // When the earliest pending item is due (nullopt when none): a caller-driven service's round
  // (Driver::caller) comes by then.
  std::optional<SteadyClock::time_point> next_due() const;

 private:
  struct Item {
    std::string what;
    BudgetedAttempt attempt;
    milliseconds pause;
    SteadyClock::time_point next_try;
    SteadyClock::time_point give_up;
    std::string last_error;  // the last attempt's BackendUnavailable: said when it is given up
  };
  // add() (`at` nullopt: after the usual first wait) and add_at().
  void add_item(std::optional<SteadyClock::time_point> at, std::string what, BudgetedAttempt attempt);
  void run(std::stop_token stop);
  // Runs `item` once: true when it is finished (done, abandoned, reported, given up).
  bool attempt(Item& item, const CallBudget& budget);
  std::size_t run_due(const CallBudget& budget);
  // Takes the due items out (under the mutex); they count as in flight until put back.
  std::deque<Item> take_due(SteadyClock::time_point now);
  // Puts back those to try again; `taken` items are no longer in flight.
  void put_back(std::deque<Item>& items, std::size_t taken);
  // Drops items and thread inherited from the parent, in a forked child (mutex held).
  void forget_parent_locked();
  // When the earliest pending item is due; nullopt when none (mutex held).
  std::optional<SteadyClock::time_point> earliest_due_locked() const;
  void stop_thread();
  // Reports that `item` was not done within its bound.
  void report_given_up(const Item& item);

  Backoff backoff_;
  Report report_;
  Driver driver_;
  mutable std::mutex mutex_;
  std::condition_variable_any wake_;
  std::deque<Item> items_;
  // Items taken out for an attempt and not yet put back: still pending (an item being tried is
  // not done), so pending() never reads 0 while an attempt is in flight.
  std::size_t in_flight_ = 0;
  std::uint64_t generation_;
  std::uint64_t added_ = 0;  // items ever added: a change wakes the thread to take the earliest again
  bool closed_ = false;
  std::jthread thread_;  // last member: stopped and joined first
};

}  // namespace turnstile::detail
