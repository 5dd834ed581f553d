// SPDX-License-Identifier: Apache-2.0
// A PermitCounter acquire's line: its waiter key, its take (guarded by a request marker), its leave.
#include "backends/etcd/etcd_backend.hpp"

#include <algorithm>

namespace turnstile::detail::etcd {
namespace {

// --- PermitCounter: one key changed by Txn on its mod revision ---------------------------
// Waiters line up as keys under the waiter prefix (on the lease, so a dead waiter leaves the
// line); only the first may take permits, and it watches the counter key, the others the
// waiter just ahead. A take is guarded by its request's marker (request_markers.hpp) and puts
// it, reading "taken": when its reply is lost, leave() reads the marker and, if the take was
// not applied, retires it in the same Txn, so the take cannot apply later (a stalled request
// delivered late) and the acquire knows for sure whether it took the permits. Every call ends
// on the caller's stop and by its deadline: a take whose outcome a stopped or timed caller
// cannot wait for is settled in the background (a take found applied is given back), and the
// acquire reports false; only an untimed caller without a stop waits up to the call cap.

class EtcdCounterLine final : public CounterLine {
 public:
  EtcdCounterLine(EtcdBackend& backend, const std::string& name, std::int64_t permits, const std::stop_token& stop)
      : backend_(backend), counter_key_(kCounterPrefix + name), line_prefix_(kCounterWaiterPrefix + name + "/"),
        permits_(permits), stop_(stop) {}
  ~EtcdCounterLine() override {
    if (take_lease_) resolved();  // the core leaves first; this only guards misuse
  }

  CounterStanding look(bool last_try, Deadline deadline) override;
  bool take(const CounterStanding& seen, Deadline deadline) override;
  void join(Deadline deadline) override;
  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<WakeArm> arm(CounterWait wait, Deadline deadline, Wake wake) override;
  bool leave() noexcept override;

 private:
  // From the last look's revision on: the waiter just ahead leaving, or the counter changing.
  pb::WatchCreateRequest watch_for(CounterWait wait) const;
  enum class TakeOutcome { taken, not_taken, unknown };
  bool take_reply_lost(Deadline deadline);
  // A take whose reply was lost: tells it by its marker within `first_try` (its deadline or
  // stop), then leaves it to the background, which gives back a take it finds applied.
  TakeOutcome settle_take(const CallBudget& first_try, milliseconds attempt_cap = kAttemptCap);
  // The take's outcome is known (or no longer matters): its marker is nobody's concern now.
  void resolved();
  // What the background tries for a take that leave() could not settle in time.
  std::function<void(const CallBudget&)> undo_take(const std::shared_ptr<ClientLease>& lease, std::uint64_t request,
                                                   pb::TxnRequest settle) const;

  EtcdBackend& backend_;
  const std::string counter_key_;
  const std::string line_prefix_;
  const std::int64_t permits_;
  const std::stop_token stop_;
  std::shared_ptr<ClientLease> lease_;
  std::string place_;  // our waiter key, once in line
  std::int64_t place_revision_ = 0;
  bool left_ = false;
  // A stop or the deadline ended the acquire while its take was being settled: nothing more
  // is read (the next look finds nothing, so the core ends the acquire with false).
  bool ended_ = false;
  // A take whose outcome is unknown (its reply was lost): its request number and lease.
  std::uint64_t take_request_ = 0;
  std::shared_ptr<ClientLease> take_lease_;
  // From the last look, read at one revision:
  std::int64_t read_revision_ = 0;
  std::int64_t counter_revision_ = 0;  // the counter key's mod revision (0: no key)
  std::string ahead_;                  // the waiter just ahead of ours
};

CounterStanding EtcdCounterLine::look(bool, Deadline deadline) {
  if (ended_) return {};
  pb::TxnRequest read;  // the counter and the line ahead of us, at one revision
  add_range(read.mutable_success(), key_range(counter_key_));
  add_range(read.mutable_success(), queue_range(line_prefix_, place_revision_));
  pb::TxnResponse state;
  try {
    state = backend_.connection().txn(read, CallBudget(deadline, stop_).for_call(kEtcdTimes.one_shot), Resend::allowed);
  } catch (const CallStopped&) {
    // Nothing read: no permits seen, so the core ends the acquire on the stop (and leaves).
    CounterStanding stopped;
    stopped.in_line = !place_.empty();
    return stopped;
  }
  const auto counter = counter_value(state.responses(0).response_range());
  const auto line = children(state.responses(1).response_range(), line_prefix_);
  read_revision_ = state.header().revision();
  counter_revision_ = counter.mod_revision;
  CounterStanding standing;
  standing.value = counter.value;
  standing.ahead = line.size();
  standing.in_line = !place_.empty();
  if (!standing.in_line) return standing;
  const auto mine = std::find_if(line.begin(), line.end(), [&](const auto* kv) { return kv->key() == place_; });
  // Our key went with our lease: the core lines up again, on a new lease.
  if (mine == line.end() || backend_.lease_lost(*lease_)) throw QueueEntryGone();
  standing.ahead = static_cast<std::size_t>(mine - line.begin());
  ahead_ = standing.ahead > 0 ? (*(mine - 1))->key() : "";
  return standing;
}

bool EtcdCounterLine::take(const CounterStanding& seen, Deadline deadline) {
  const auto lease =
      seen.in_line ? lease_ : backend_.client_lease(CallBudget(deadline, stop_).for_call(kEtcdTimes.one_shot));
  const auto request = backend_.next_request();
  auto& markers = *lease->markers;
  markers.begin(request);
  const auto garbage = backend_.receipts_to_delete();
  pb::TxnRequest take;
  add_compare(take, counter_key_, pb::Compare::MOD, counter_revision_);
  markers.guard(take, request);  // never resent: this guards its one copy against leave()
  if (seen.in_line) {
    add_compare(take, place_, pb::Compare::CREATE, place_revision_);
  } else {
    // Still nobody in line: no key under the line's prefix was created since our read (keys of
    // nested names' lines, made before it, do not count; an empty range holds).
    auto* empty = take.add_compare();
    empty->set_key(line_prefix_);
    empty->set_range_end(prefix_end(line_prefix_));
    empty->set_result(pb::Compare::LESS);
    empty->set_target(pb::Compare::CREATE);
    empty->set_create_revision(read_revision_ + 1);
  }
  add_put(take.mutable_success(), counter_key_, std::to_string(*seen.value - permits_), 0);
  if (seen.in_line) add_delete(take.mutable_success(), place_);
  markers.retire(take.mutable_success(), request, kTaken);
  const auto floor = markers.add_sweep(take.mutable_success());
  for (const auto& old : garbage) add_delete(take.mutable_success(), old);
  // Kept while the outcome is unknown: a BackendUnavailable leaves the marker to leave().
  take_request_ = request;
  take_lease_ = lease;
  backend_.count_unresolved_take(*lease, +1);
  pb::TxnResponse answer;
  try {
    answer = backend_.connection().txn(take, CallBudget(deadline, stop_).for_call(kEtcdTimes.one_shot), Resend::never);
  } catch (const CallStopped&) {
    resolved();  // not sent: the core ends the acquire on the stop
    return false;
  } catch (const LeaseGone&) {
    // Not applied. In line, our key went with the lease (the next look joins again).
    resolved();
    backend_.lose_lease(lease, "etcd no longer knows the client's lease", true);
    return false;
  } catch (const BackendUnavailable&) {
    return take_reply_lost(deadline);  // rethrows unless the acquire ends here
  }
  resolved();
  if (!answer.succeeded()) return false;
  markers.swept(floor);
  backend_.receipts_deleted(garbage);
  left_ = true;  // our waiter key went with the take
  return true;
}

// The take's reply was lost (or the stop cut it); called in take()'s handler. A caller with a
// deadline waits for the outcome within its budget (at least one_shot's floor, as any call past
// its deadline), a stopped one within that floor, trying each endpoint briefly; untimed ones as long
// as leave() does (the error is rethrown, and the core leaves).
bool EtcdCounterLine::take_reply_lost(Deadline deadline) {
  if (!deadline && !stop_.stop_possible()) throw;
  const auto outcome = stop_.stop_requested() ? settle_take(CallBudget(SteadyClock::now() + kEtcdTimes.one_shot.floor),
                                                            kStoppedSettleAttempt)
                                              : settle_take(CallBudget(deadline, stop_).for_call(kEtcdTimes.one_shot));
  left_ = true;  // taken: our key went with the take; otherwise the settle deletes it
  if (outcome == TakeOutcome::taken) return true;
  // Not taken, or not known yet: the background makes sure nothing stays taken.
  if (!CallBudget(deadline, stop_).passed()) throw;
  ended_ = true;
  return false;
}

void EtcdCounterLine::join(Deadline deadline) {
  EtcdBackend::Joined joined;
  try {
    joined = backend_.join_line(
        line_prefix_,
        [&](const ClientLease& lease, std::uint64_t number) {
          return std::pair{line_prefix_ + lease.hex + "_" + std::to_string(number),
                           std::to_string(permits_) + " " + backend_.identity() + " " + std::to_string(now_ms()) + " " +
                               std::to_string(number) + backend_.label_suffix()};
        },
        CallBudget(deadline, stop_), nullptr);
  } catch (const BackendUnavailable&) {
    // Stopped: not in line (a join that may have been applied is left by join_line); the core
    // ends the acquire on the stop.
    if (stop_.stop_requested()) return;
    throw;
  }
  lease_ = std::move(joined.lease);
  place_ = std::move(joined.key);
  place_revision_ = joined.created;
}

void EtcdCounterLine::wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) {
  if (stop.stop_requested()) return;
  backend_.wait_for_change(*lease_, watch_for(wait), CallBudget(deadline, stop));
}

std::unique_ptr<WakeArm> EtcdCounterLine::arm(CounterWait wait, Deadline, Wake wake) {
  return backend_.arm_watch(*lease_, watch_for(wait), std::move(wake));
}

pb::WatchCreateRequest EtcdCounterLine::watch_for(CounterWait wait) const {
  pb::WatchCreateRequest watch;
  watch.set_start_revision(read_revision_ + 1);
  if (wait == CounterWait::predecessor) {
    watch.set_key(ahead_);  // the waiter just ahead leaving
    watch.add_filters(pb::WatchCreateRequest::NOPUT);
  } else {
    watch.set_key(counter_key_);  // the counter changing
  }
  return watch;
}

bool EtcdCounterLine::leave() noexcept {
  if (left_) return false;
  left_ = true;
  if (!take_lease_) {
    if (!place_.empty()) backend_.run_cleanup(lease_, delete_entry_txn(place_, place_revision_));
    return false;
  }
  // As long as any call may take (the call cap), or the stop.
  return settle_take(CallBudget(SteadyClock::now() + kEtcdTimes.call.cap, stop_)) == TakeOutcome::taken;
}

EtcdCounterLine::TakeOutcome EtcdCounterLine::settle_take(const CallBudget& first_try, milliseconds attempt_cap) {
  // Its marker reads "taken" exactly when the take was applied (then it also deleted our
  // waiter key). Otherwise this Txn retires the marker, so the take can no longer apply when
  // it arrives late, and our key goes. Resent, it answers the same.
  const auto lease = std::exchange(take_lease_, nullptr);
  const auto request = std::exchange(take_request_, 0);
  pb::TxnRequest resolve;
  add_value_compare(resolve, lease->markers->marker(request), kTaken);
  add_range(resolve.mutable_success(), key_range(counter_key_));
  lease->markers->retire(resolve.mutable_failure(), request, kRefused);
  if (!place_.empty()) add_delete(resolve.mutable_failure(), place_);  // keys of one line are never reused
  auto later = undo_take(lease, request, resolve);
  const auto answer = backend_.run_cleanup(lease, std::move(resolve),
                                           {.first_try = first_try,
                                            .attempt_cap = attempt_cap,
                                            .finished =
                                                [&backend = backend_, lease, request] {
                                                  lease->markers->resolved(request);
                                                  backend.count_unresolved_take(*lease, -1);
                                                },
                                            .later = std::move(later)});
  if (!answer) return TakeOutcome::unknown;
  return answer->succeeded() ? TakeOutcome::taken : TakeOutcome::not_taken;
}

// Not settled in time, the acquire reported the take not applied: the background settles it,
// and a take found applied is undone (its permits given back, its marker set to "returned",
// in one Txn on the counter's mod revision), so an acquire that did not succeed holds nothing.
std::function<void(const CallBudget&)> EtcdCounterLine::undo_take(const std::shared_ptr<ClientLease>& lease,
                                                                  std::uint64_t request, pb::TxnRequest settle) const {
  return [&connection = backend_.connection(), lease, request, settle = std::move(settle), counter_key = counter_key_,
          permits = permits_](const CallBudget& budget) {
    const auto settled = connection.txn(settle, budget, Resend::allowed);
    if (!settled.succeeded()) return;  // not applied, and now it never will be
    const auto counter = counter_value(settled.responses(0).response_range());
    pb::TxnRequest give_back;
    add_value_compare(give_back, lease->markers->marker(request), kTaken);
    add_compare(give_back, counter_key, pb::Compare::MOD, counter.mod_revision);
    add_put(give_back.mutable_success(), counter_key, std::to_string(counter.value.value_or(0) + permits), 0);
    lease->markers->retire(give_back.mutable_success(), request, kReturned);
    if (!connection.txn(give_back, budget, Resend::allowed).succeeded()) {
      throw BackendUnavailable("the PermitCounter changed while a take was given back: tried again");
    }
  };
}

void EtcdCounterLine::resolved() {
  take_lease_->markers->resolved(take_request_);
  backend_.count_unresolved_take(*take_lease_, -1);
  take_request_ = 0;
  take_lease_.reset();
}

}  // namespace

std::unique_ptr<CounterLine> EtcdBackend::counter_line(const std::string& name, std::int64_t permits,
                                                       const std::stop_token& stop) {
  return std::make_unique<EtcdCounterLine>(*this, name, permits, stop);
}
}  // namespace turnstile::detail::etcd
