// SPDX-License-Identifier: Apache-2.0
// The one queue algorithm (queue_store.hpp) as a step machine, so that one copy of its policy
// serves two drivers: a blocked thread (acquire_in_queue, acquire_from_counter: step, wait,
// step) and events (async_acquire.cpp: step on a pool thread, arm a wake-up, step again when it
// comes). A step makes the blocking storage calls (join, look, hold, take, leave: one round trip
// each, bounded by the deadline) up to the point where the acquire must wait for an event or
// pause before a retry, or has ended.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>

#include "core/backend.hpp"
#include "core/queue_store.hpp"
#include "core/race_pacer.hpp"

namespace turnstile::detail {

// What the driver does next.
struct MachineStep {
  enum class Kind {
    done,   // ended: the result is ready (a hold, or nothing)
    wait,   // wait for the event the machine names (wait() or arm()), then step again
    pause,  // a lost race: step again at `until` (or sooner on the stop, which ends it)
  } kind = Kind::done;
  SteadyClock::time_point until{};
};

// What a machine's wait or arm threw, kept for its next step: a wait never throws to its
// driver (QueueMachine's and CounterMachine's alike); the next step rethrows it and handles it
// as it would from a look (QueueEntryGone: join again).
class DeferredWaitError {
 public:
  template <class Wait>
  void wait(Wait&& call) noexcept {
    try {
      call();
    } catch (...) {
      error_ = std::current_exception();
    }
  }
  // nullptr when the arm threw: the driver steps again at once.
  template <class Arm>
  std::unique_ptr<WakeArm> arm(Arm&& call) noexcept {
    try {
      return call();
    } catch (...) {
      error_ = std::current_exception();
      return nullptr;
    }
  }
  // At the start of a step: what the last wait or arm threw, if anything.
  void rethrow() {
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  std::exception_ptr error_;
};

// One acquire in a name's queue. Its entry leaves on every way out but a hold: an error (after
// leaving, rethrown by step()), a deadline, a stop, abandon() or destruction.
class QueueMachine {
 public:
  QueueMachine(QueueStore& store, QueueRequest request, Deadline deadline, std::shared_ptr<LossSignal> loss);
  ~QueueMachine() { abandon(); }
  QueueMachine(const QueueMachine&) = delete;
  QueueMachine& operator=(const QueueMachine&) = delete;

  MachineStep step();
  // The wait a `wait` step asked for, on the calling thread / without one (QueuePlace::arm).
  // Neither throws: what the storage threw there is the next step's (QueueEntryGone joins
  // again, as from a look); arm() then returns nullptr: step again at once.
  void wait();
  std::unique_ptr<WakeArm> arm(Wake wake);
  // The hold once done (nullptr: not admitted); taken once.
  std::unique_ptr<BackendHold> take_hold() { return std::move(hold_); }
  // Ends the acquire where it stands: leaves the queue (nothing held afterwards), waiting for
  // the server no later than `deadline` when given (QueuePlace::leave_by).
  void abandon(std::optional<Deadline> deadline = std::nullopt) noexcept;
  const QueueRequest& request() const { return request_; }
  const Deadline& deadline() const { return deadline_; }
  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

 private:
  enum class Phase { join, decide, look, look_after_wait, done };
  bool may_wait() const { return !try_once_ && !passed(deadline_) && !request_.stop.stop_requested(); }
  MachineStep finish() noexcept;
  // A lost race: a pause, then `after` (or the end: not admitted, left).
  MachineStep retry(Phase after);
  std::optional<MachineStep> decide();

  QueueStore& store_;
  QueueRequest request_;
  Deadline deadline_;
  std::shared_ptr<LossSignal> loss_;
  bool try_once_;
  RacePacer races_;
  Phase phase_ = Phase::join;
  bool pausing_ = false;  // a retry's pause ended: the pacer says whether to retry
  DeferredWaitError wait_error_;
  std::unique_ptr<QueuePlace> place_;
  Standing standing_;
  Verdict verdict_;
  std::unique_ptr<BackendHold> hold_;
};

// One PermitCounter acquire: outside the line, then in it once it must wait.
class CounterMachine {
 public:
  CounterMachine(CounterStore& store, std::string name, std::int64_t permits, Deadline deadline, std::stop_token stop);
  ~CounterMachine() { abandon(); }
  CounterMachine(const CounterMachine&) = delete;
  CounterMachine& operator=(const CounterMachine&) = delete;

  MachineStep step();
  void wait();
  std::unique_ptr<WakeArm> arm(Wake wake);
  bool taken() const { return taken_; }
  // Leaves the line; a take whose reply was lost counts (taken() then says so). A counter's
  // leave must learn whether a take was applied: it is not hurried by a deadline.
  void abandon(std::optional<Deadline> deadline = std::nullopt) noexcept;
  const Deadline& deadline() const { return deadline_; }

 private:
  enum class Phase { new_line, look, look_after_wait, done };
  bool last_try() const { return try_once_ || passed(deadline_) || stop_.stop_requested(); }
  MachineStep finish(bool taken) noexcept;
  MachineStep retry(Phase after);
  std::optional<MachineStep> look();

  CounterStore& store_;
  std::string name_;
  std::int64_t permits_;
  Deadline deadline_;
  std::stop_token stop_;
  bool try_once_;
  RacePacer races_;
  Phase phase_ = Phase::new_line;
  bool pausing_ = false;
  DeferredWaitError wait_error_;
  std::unique_ptr<CounterLine> line_;
  CounterWait waiting_for_ = CounterWait::nothing;
  bool taken_ = false;
};

// The blocked-thread driver: steps, waits on this thread, pauses on it.
template <class Machine>
void run_blocking(Machine& machine, const std::stop_token& stop) {
  for (;;) {
    const auto next = machine.step();
    if (next.kind == MachineStep::Kind::done) return;
    if (next.kind == MachineStep::Kind::wait) {
      machine.wait();
    } else {
      pause_within(CallBudget(std::nullopt, stop), std::chrono::ceil<milliseconds>(next.until - SteadyClock::now()));
    }
  }
}

}  // namespace turnstile::detail
