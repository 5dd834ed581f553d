// SPDX-License-Identifier: Apache-2.0
// Markers of ended joins: written by each ending, removed after kRetiredKeep (retired_joins.hpp).
#include "backends/consul/retired_joins.hpp"

#include <algorithm>
#include <cstdlib>

#include "backends/consul/consul_backend.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

std::chrono::milliseconds keep_from_environment() {
  const char* text = std::getenv("TURNSTILE_TEST_CONSUL_MARKER_KEEP_MS");
  if (text == nullptr || *text == '\0') return kRetiredKeep;
  char* end = nullptr;
  const auto ms = std::strtoll(text, &end, 10);
  return *end == '\0' && ms >= 0 ? std::chrono::milliseconds(ms) : kRetiredKeep;
}

}  // namespace

std::string retired_marker_of(const std::string& entry_key) {
  return marker_key(entry_key.substr(entry_key.rfind('/') + 1));
}

nlohmann::json retire_op(const std::string& entry_key, const std::string& session_id) {
  return kv_lock(retired_marker_of(entry_key), "", 0, session_id);
}

MarkerHandOver::~MarkerHandOver() {
  try {
    backend_.retired_joins().add(backend_, std::move(marker_));
  } catch (...) {
    // No memory: the marker goes with the session.
  }
}

RetiredJoins::RetiredJoins() : keep_(keep_from_environment()) {}

void RetiredJoins::add(ConsulBackend& backend, std::string marker) {
  Turn turn;
  {
    std::lock_guard lock(mutex_);
    retired_.push_back({std::move(marker), SteadyClock::now()});
    turn = plan_locked(false);
  }
  schedule(backend, turn);
}

void RetiredJoins::sweep_due(ConsulBackend& backend) {
  Turn turn;
  {
    std::lock_guard lock(mutex_);
    turn = plan_locked(false);
  }
  schedule(backend, turn);
}

RetiredJoins::Turn RetiredJoins::plan_locked(bool after_turn) {
  if (scheduled_ && !after_turn) return {};
  ++turn_;  // a turn that ends, or one given up, no longer clears the flag of the next
  scheduled_ = !retired_.empty();
  if (!scheduled_) return {};
  const auto soonest = SteadyClock::now() + (after_turn ? kRetiredTurnPause : std::chrono::milliseconds(0));
  return {.id = turn_, .at = std::max(retired_.front().at + keep_, soonest)};
}

// Outside the mutex: a job the service drops (closed) clears the flag under it.
void RetiredJoins::schedule(ConsulBackend& backend, Turn turn) {
  if (turn.id == 0) return;
  try {
    // Whenever the job goes (done, given up, dropped) without having scheduled the next turn,
    // the flag is cleared: the next ending or join schedules one.
    const auto ticket = std::shared_ptr<RetiredJoins>(this, [id = turn.id](RetiredJoins* self) {
      std::lock_guard relock(self->mutex_);
      if (self->turn_ == id) self->scheduled_ = false;
    });
    backend.removals().add_at(
        turn.at, "the markers of ended joins",
        [this, &backend, ticket](const CallBudget& budget) { return sweep_turn(backend, budget); });
  } catch (...) {
    // No memory for the job (`ticket` cleared the flag): the markers wait for the next hand-over.
  }
}

Removal RetiredJoins::sweep_turn(ConsulBackend& backend, const CallBudget& budget) {
  // A client's end (its drain has a deadline): the markers go with its session, destroyed next.
  if (budget.deadline()) return Removal::done;
  for (std::size_t batch = 0; batch < kRetiredBatchesPerTurn && !budget.stopped(); ++batch) {
    auto markers = take_due_batch();
    if (markers.empty()) break;
    nlohmann::json deletes = nlohmann::json::array();
    for (const auto& marker : markers) deletes.push_back(kv_op("delete", marker));
    try {
      // Refused (deletes are not, but by a policy): those markers go with the session.
      backend.txn(deletes, kConsulTimes.one_shot.floor, "removing the markers of ended joins");
    } catch (...) {
      put_back(std::move(markers));
      throw;  // no answer: again after the service's pause; another error is reported
    }
  }
  Turn next;
  {
    std::lock_guard lock(mutex_);
    next = plan_locked(true);
  }
  schedule(backend, next);
  return Removal::done;
}

std::vector<std::string> RetiredJoins::take_due_batch() {
  std::lock_guard lock(mutex_);
  const auto due = SteadyClock::now() - keep_;
  std::vector<std::string> markers;
  while (!retired_.empty() && retired_.front().at <= due && markers.size() < kRetiredBatch) {
    markers.push_back(std::move(retired_.front().marker));
    retired_.pop_front();
  }
  return markers;
}

// Back at the front, due as they were.
void RetiredJoins::put_back(std::vector<std::string> markers) {
  std::lock_guard lock(mutex_);
  const auto at = SteadyClock::now() - keep_;
  for (auto it = markers.rbegin(); it != markers.rend(); ++it) retired_.push_front({std::move(*it), at});
}

}  // namespace turnstile::detail::consul
