// SPDX-License-Identifier: Apache-2.0
// The PermitCounter's line in Consul's KV store: its waiters, and the takes that leave it.
#include <algorithm>
#include <exception>

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/given_up.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// Waiters are keys under turnstile/cq/<name>/ on our session, by CreateIndex; the value is a
// CounterValue (layout.hpp), changed by CAS on its ModifyIndex.
class ConsulCounterLine final : public CounterLine {
 public:
  ConsulCounterLine(ConsulBackend& backend, std::string name, std::int64_t permits, std::stop_token stop)
      : backend_(backend), name_(std::move(name)), permits_(permits), counter_(counter_key(name_)),
        prefix_(line_prefix(name_)), stop_(std::move(stop)) {}
  ~ConsulCounterLine() override { leave(); }

  // Reads are resent while no server answers (a restart), until the deadline or a stop: then
  // the acquire ends not taken (shown as a wait for permits, which ends at once). Every call of
  // the line ends on the acquire's stop; what it may have written is settled or retired after.
  CounterStanding look(bool, Deadline deadline) override {
    // An armed wait's query got an answer nobody expects: thrown here, as wait() throws it.
    if (auto error = std::exchange(wait_error_, nullptr)) std::rethrow_exception(error);
    CounterStanding not_taken;
    not_taken.in_line = true;
    const CallBudget budget(deadline, stop_);
    return backend_.look_resending(
        budget, [&] { return look_once(budget); }, not_taken);
  }

  CounterStanding look_once(const CallBudget& budget) {
    const auto timeout = budget.call_timeout(kConsulTimes.one_shot);
    std::uint64_t index = 0;
    const auto counter = backend_.read(counter_, false, timeout, &index, stop_);
    const auto line = children(backend_.read(prefix_, true, timeout, nullptr, stop_), prefix_);
    CounterStanding standing;
    counter_target_ = {counter_, counter.empty() ? std::max<std::uint64_t>(index, 1) : counter.front().modify_index};
    seen_ = {};
    if (!counter.empty()) seen_ = {counter_value_of(counter.front().value), counter.front().modify_index};
    if (seen_.value) standing.value = seen_.value->n;
    standing.in_line = !entry_key_.empty();
    const auto mine = std::find_if(line.begin(), line.end(), [&](const KvEntry& e) { return e.key == entry_key_; });
    if (standing.in_line && mine == line.end()) {
      entry_key_.clear();
      throw QueueEntryGone();
    }
    standing.ahead = static_cast<std::size_t>(mine - line.begin());
    if (standing.ahead > 0) predecessor_ = {std::prev(mine)->key, std::prev(mine)->modify_index};
    return standing;
  }

  // The permits and our place in line go in one transaction with its request marker (a lost
  // reply or a resend is told from someone else's change: never taken twice). A stop cuts the
  // call; the take is then settled at once: found applied (taken), or its marker written "void"
  // so that a copy still on its way never applies.
  bool take(const CounterStanding&, Deadline deadline) override {
    if (stop_.stop_requested()) return false;  // nothing sent: the core ends the acquire
    const auto timeout = CallBudget(deadline).call_timeout(kConsulTimes.one_shot);
    take_marker_ = backend_.new_marker(timeout);
    nlohmann::json extra = nlohmann::json::array();
    if (!entry_key_.empty()) extra.push_back(kv_op("delete", entry_key_));
    // Its join's marker too, so that a late copy of the join adds no waiter after the take
    // (retired_joins.hpp); not when our waiter's session was lost (a copy then fails its lock).
    if (!entry_key_.empty() && take_marker_->session == session_) {
      extra.push_back(retire_op(entry_key_, session_->id));
    }
    bool taken = false;
    try {
      taken = backend_.change_counter(counter_, seen_, seen_.value.value_or(CounterValue{}).n - permits_, extra,
                                      *take_marker_, timeout, "taking permits of '" + name_ + "'", stop_);
    } catch (const BackendUnavailable&) {
      // Settling after a stop found no server: a stopped caller is not kept for a second try.
      if (stop_.stop_requested()) take_marker_.reset();
      throw;
    }
    take_marker_.reset();  // told: leave() need not ask
    if (taken) retired(std::exchange(entry_key_, std::string()));
    return taken;
  }

  // A transaction that adds our waiter only while its id was not retired (leave() retires the
  // id of a join whose answer never came): a copy delivered late creates nothing.
  void join(Deadline deadline) override {
    const auto timeout = CallBudget(deadline).call_timeout(kConsulTimes.one_shot);
    auto session = backend_.sessions().main(timeout);
    const auto id = backend_.next_id(session->id);
    QueueRequest request;
    request.permits = permits_;
    nlohmann::json ops = nlohmann::json::array();
    ops.push_back(kv_op("check-not-exists", marker_key(id)));
    ops.push_back(kv_lock(prefix_ + id, to_json(backend_.new_value(request)), 0, session->id));
    entry_key_ = prefix_ + id;  // left (removed) on any failure from here
    entry_id_ = id;
    session_ = session;
    const auto context = "joining the line of '" + name_ + "'";
    Refused refused;
    std::optional<std::vector<KvEntry>> results;
    try {
      results = backend_.txn(ops, timeout, context, &refused, stop_);
    } catch (const BackendUnavailable&) {
      join_unknown_ = true;
      // Cut by the stop: the acquire ends not taken; leave() retires the join (it may still land).
      if (stop_.stop_requested()) throw QueueEntryGone();
      throw;
    }
    if (results) return;
    entry_key_.clear();
    if (lose_refused_session(refused, *session)) throw QueueEntryGone();
    throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
  }

  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override {
    backend_.block(wait == CounterWait::predecessor ? predecessor_ : counter_target_, CallBudget(deadline, stop));
  }

  // The same query on the client's I/O thread: no thread waits.
  std::unique_ptr<WakeArm> arm(CounterWait wait, Deadline deadline, Wake wake) override {
    return backend_.arm_block({wait == CounterWait::predecessor ? predecessor_ : counter_target_}, deadline,
                              [this, wake = std::move(wake)](std::exception_ptr error, std::uint64_t) {
                                wait_error_ = std::move(error);  // the next look throws it
                                wake();
                              });
  }

  bool leave() noexcept override {
    // A take whose outcome is still unknown took the permits (and our entry) if its marker says so.
    if (auto marker = std::exchange(take_marker_, std::nullopt)) {
      try {
        if (backend_.counter_change_applied(counter_, seen_, *marker,
                                            SteadyClock::now() + kConsulTimes.one_shot.floor)) {
          retired(std::exchange(entry_key_, std::string()));
          return true;
        }
      } catch (...) {
      }
    }
    if (entry_key_.empty()) return false;
    const auto key = std::exchange(entry_key_, std::string());
    if (std::exchange(join_unknown_, false)) {
      // Our join may still arrive: its id is retired first, then the entry removed if it came.
      // The marker is tried here first (bounded, as the removal below: a stopped acquire also
      // leaves the line before it returns), so no copy delivered after the return can land.
      try {
        nlohmann::json undo = nlohmann::json::array({kv_op("delete", key)});
        retire_join(backend_, session_, entry_id_, std::move(undo), kConsulTimes.one_shot.floor);
      } catch (...) {
        // No memory for the job: the entry goes with the session.
      }
      return false;
    }
    leave_queue(backend_, session_, "", key, kConsulTimes.one_shot.floor);  // with its join's marker
    return false;
  }

 private:
  // A take removed our waiter, and wrote its join's marker: kept for a while (retired_joins.hpp).
  void retired(const std::string& entry_key) {
    if (!entry_key.empty()) backend_.retired_joins().add(backend_, retired_marker_of(entry_key));
  }

  ConsulBackend& backend_;
  std::string name_;
  std::int64_t permits_;
  std::string counter_;
  std::string prefix_;
  std::string entry_key_;             // empty: not in line
  std::string entry_id_;              // its id (its marker's name)
  std::shared_ptr<Session> session_;  // the session it is on
  bool join_unknown_ = false;         // its join's answer never came
  ConsulBackend::CounterSeen seen_;   // the counter as the last look saw it
  WaitTarget counter_target_;
  WaitTarget predecessor_;
  std::optional<ChangeMarker> take_marker_;  // a take whose outcome is unknown (its reply never came)
  std::stop_token stop_;                     // the acquire's
  std::exception_ptr wait_error_;            // from an armed wait, for the next look
};

}  // namespace

std::unique_ptr<CounterLine> make_counter_line(ConsulBackend& backend, const std::string& name, std::int64_t permits,
                                               const std::stop_token& stop) {
  return std::make_unique<ConsulCounterLine>(backend, name, permits, stop);
}

}  // namespace turnstile::detail::consul
