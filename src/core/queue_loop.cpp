// SPDX-License-Identifier: Apache-2.0
// The one queue algorithm's step machines (queue_machine.hpp) over any backend's storage
// (queue_store.hpp), and the blocking acquires as a thread that drives them.
#include "core/call_budget.hpp"
#include "core/queue_machine.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

QueueStep next_queue_step(const QueueRequest& request, const Standing& standing, bool may_wait) {
  check_queue_mode(request, standing.mode, standing.limit);
  const Verdict verdict = standing.decided
                              ? *standing.decided
                              : evaluate_queue(standing.entries, standing.entries.size() - 1, request.limit);
  if (verdict.admitted()) return {QueueStep::Action::hold, verdict};
  if (!may_wait) return {QueueStep::Action::give_up, verdict};
  return {QueueStep::Action::wait, verdict};
}

QueueMachine::QueueMachine(QueueStore& store, QueueRequest request, Deadline deadline, std::shared_ptr<LossSignal> loss)
    : store_(store), request_(std::move(request)), deadline_(deadline), loss_(std::move(loss)),
      try_once_(passed(deadline)), races_({deadline_, request_.stop}, try_once_) {}

void QueueMachine::abandon(std::optional<Deadline> deadline) noexcept {
  if (place_) deadline ? place_->leave_by(*deadline) : place_->leave();
  place_.reset();
  phase_ = Phase::done;
}

MachineStep QueueMachine::finish() noexcept {
  abandon();
  return {};
}

MachineStep QueueMachine::retry(Phase after) {
  const auto at = races_.retry_at();
  if (!at) return finish();  // leaves
  phase_ = after;
  pausing_ = true;
  return {MachineStep::Kind::pause, *at};
}

// Each round joins at the back; a round ends when our entry vanished without our leaving
// (nothing was held: join again, as Curator does) or the admission excluded nobody.
MachineStep QueueMachine::step() {
  for (;;) {
    try {
      wait_error_.rethrow();
      if (std::exchange(pausing_, false) && !races_.retry_after_pause()) return finish();
      switch (phase_) {
        case Phase::join:
          if (request_.stop.stop_requested()) return finish();
          place_ = store_.join(request_, try_once_, deadline_, standing_);
          if (!place_) return finish();
          phase_ = Phase::decide;
          break;
        case Phase::look_after_wait:
          // A deadline or stop that ended the wait ends the acquire: no look past the deadline.
          if (!may_wait()) return finish();
          [[fallthrough]];
        case Phase::look:
          standing_ = place_->look(deadline_);
          phase_ = Phase::decide;
          break;
        case Phase::decide:
          if (auto next = decide()) return *next;
          break;
        case Phase::done: return {};
      }
    } catch (const QueueEntryGone&) {
      abandon();
      if (try_once_ || passed(deadline_)) return finish();
      return retry(Phase::join);
    } catch (...) {
      abandon();
      throw;
    }
  }
}

std::optional<MachineStep> QueueMachine::decide() {
  const auto next = next_queue_step(request_, standing_, may_wait());
  if (next.action == QueueStep::Action::give_up) return finish();
  if (next.action == QueueStep::Action::wait) {
    // The entries are not kept while we wait: a waiter's memory stays constant however long
    // the queue ahead (the next look reads them again).
    std::vector<QueueEntryView>().swap(standing_.entries);
    verdict_ = next.verdict;
    phase_ = Phase::look_after_wait;
    return MachineStep{MachineStep::Kind::wait};
  }
  try {
    hold_ = place_->hold(loss_);
  } catch (const QueueChanged&) {
    return retry(Phase::look);  // still in line: look and decide again
  }
  if (hold_) {
    place_.reset();  // the hold owns the entry now
    phase_ = Phase::done;
    return MachineStep{};
  }
  abandon();  // the entry has left: join again
  phase_ = Phase::join;
  return std::nullopt;
}

void QueueMachine::wait() {
  wait_error_.wait([&] { place_->wait(verdict_, deadline_, request_.stop); });
}

std::unique_ptr<WakeArm> QueueMachine::arm(Wake wake) {
  return wait_error_.arm([&] { return place_->arm(verdict_, deadline_, std::move(wake)); });
}

std::unique_ptr<BackendHold> acquire_in_queue(QueueStore& store, const QueueRequest& request, Deadline deadline,
                                              std::shared_ptr<LossSignal> loss) {
  QueueMachine machine(store, request, deadline, std::move(loss));
  run_blocking(machine, request.stop);
  return machine.take_hold();
}

CounterMachine::CounterMachine(CounterStore& store, std::string name, std::int64_t permits, Deadline deadline,
                               std::stop_token stop)
    : store_(store), name_(std::move(name)), permits_(permits), deadline_(deadline), stop_(std::move(stop)),
      try_once_(passed(deadline)), races_({deadline_, stop_}, try_once_) {}

void CounterMachine::abandon(std::optional<Deadline>) noexcept {
  if (line_ && line_->leave()) taken_ = true;  // a take whose reply was lost
  line_.reset();
  phase_ = Phase::done;
}

MachineStep CounterMachine::finish(bool taken) noexcept {
  if (taken) line_.reset();  // kept: the take left the line in the same step
  abandon();
  taken_ = taken_ || taken;
  return {};
}

MachineStep CounterMachine::retry(Phase after) {
  const auto at = races_.retry_at();
  if (!at) return finish(false);  // leaves the line
  phase_ = after;
  pausing_ = true;
  return {MachineStep::Kind::pause, *at};
}

MachineStep CounterMachine::step() {
  for (;;) {
    try {
      wait_error_.rethrow();
      if (std::exchange(pausing_, false) && !races_.retry_after_pause()) return finish(false);
      switch (phase_) {
        case Phase::new_line:
          line_ = store_.counter_line(name_, permits_, stop_);
          phase_ = Phase::look;
          break;
        case Phase::look_after_wait:
          // A deadline or stop that ended the wait ends the acquire: no look past the deadline
          // (a look to a server that does not answer would hold the stop up).
          if (passed(deadline_) || stop_.stop_requested()) return finish(false);
          phase_ = Phase::look;
          [[fallthrough]];
        case Phase::look:
          if (auto next = look()) return *next;
          break;
        case Phase::done: return {};
      }
    } catch (const QueueEntryGone&) {
      abandon();
      if (last_try()) return finish(false);
      return retry(Phase::new_line);
    } catch (const BackendUnavailable&) {
      abandon();  // a lost reply may have taken the permits: the storage says so when we leave
      if (taken_) return {};
      throw;
    } catch (...) {
      abandon();
      throw;
    }
  }
}

std::optional<MachineStep> CounterMachine::look() {
  const bool last = last_try();
  const auto standing = line_->look(last, deadline_);
  if (standing.taken) return finish(true);
  const auto wait = evaluate_counter_line(standing.ahead, standing.value, permits_);
  if (wait == CounterWait::nothing) {
    if (line_->take(standing, deadline_)) return finish(true);
    return retry(Phase::look);  // changed meanwhile: look again
  }
  if (last) return finish(false);
  if (!standing.in_line) {
    line_->join(deadline_);
    return std::nullopt;  // look again from our place
  }
  waiting_for_ = wait;
  phase_ = Phase::look_after_wait;
  return MachineStep{MachineStep::Kind::wait};
}

void CounterMachine::wait() {
  wait_error_.wait([&] { line_->wait(waiting_for_, deadline_, stop_); });
}

std::unique_ptr<WakeArm> CounterMachine::arm(Wake wake) {
  return wait_error_.arm([&] { return line_->arm(waiting_for_, deadline_, std::move(wake)); });
}

bool acquire_from_counter(CounterStore& store, const std::string& name, std::int64_t permits, Deadline deadline,
                          const std::stop_token& stop) {
  CounterMachine machine(store, name, permits, deadline, stop);
  run_blocking(machine, stop);
  return machine.taken();
}

}  // namespace turnstile::detail
