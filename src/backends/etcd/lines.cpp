// SPDX-License-Identifier: Apache-2.0
// Lines (a queue, a PermitCounter's waiters): putting an entry at the back, waiting for a change.
#include "backends/etcd/etcd_backend.hpp"

namespace turnstile::detail::etcd {

// --- lines: joining and waiting ----------------------------------------------------------

void EtcdBackend::wait_for_change(ClientLease& lease, const pb::WatchCreateRequest& request, const CallBudget& budget,
                                  const WakeAfter& after, const std::function<std::int64_t()>& changed_already) {
  const auto started = SteadyClock::now();
  // A bounded watch: a healthy stream is renewed now and then, so no wait depends on one
  // connection forever.
  WatchStream watch(connection_, *budget.until(started + kWaitWatchLife).deadline());
  {
    std::lock_guard lock(mutex_);
    if (lease.lost) return;
    lease.waits.insert(&watch);
  }
  struct Registered {
    EtcdBackend& backend;
    ClientLease& lease;
    WatchStream& watch;
    ~Registered() {
      std::lock_guard lock(backend.mutex_);
      lease.waits.erase(&watch);
    }
  } registered{*this, lease, watch};
  std::stop_callback on_stop(budget.stop(), [&watch] { watch.cancel(); });
  watch.start(request);
  std::int64_t seen = 0;  // events that may make it, counted from the watch's start
  if (changed_already && !budget.stopped()) {
    try {
      seen = changed_already();
    } catch (const BackendUnavailable&) {
      // Could not look: the watch tells.
    }
  }
  pb::WatchResponse response;
  bool changed = seen >= after.events;
  // As the key watcher counts an armed waiter's events (WakeAfter).
  while (!changed && watch.next(response)) {
    for (const auto& event : response.events()) {
      if (++seen >= after.events || (!after.own_key.empty() && event.kv().key() == after.own_key)) changed = true;
    }
  }
  // A stream that ended at once (etcd restarting, a fork): do not spin.
  if (!changed && SteadyClock::now() - started < kWatchEndedAtOnce && !budget.passed() && !lease_lost(lease)) {
    std::this_thread::sleep_for(kWatchRetryPause);
  }
}

std::unique_ptr<WakeArm> EtcdBackend::arm_watch(ClientLease& lease, const pb::WatchCreateRequest& watch, Wake wake,
                                                WakeAfter after) {
  auto armed = key_watcher_.arm(watch, lease.id, std::move(wake), std::move(after));
  // Armed first: a loss after this check wakes it (give_up), one before it is seen here.
  if (lease_lost(lease)) key_watcher_.fire(armed);
  return std::make_unique<ArmedWake>(key_watcher_, std::move(armed));
}

EtcdBackend::Joined EtcdBackend::join_line(const std::string& prefix, const EntryMaker& entry, const CallBudget& budget,
                                           LocalTurn* turn, const SideKeys& side) {
  for (int attempt = 0;; ++attempt) {
    auto lease = client_lease(budget.for_call(kEtcdTimes.one_shot));
    const auto number = next_request();
    auto [key, value] = entry(*lease, number);
    try {
      return put_entry(lease, std::move(key), number, std::move(value), prefix, budget, turn, side);
    } catch (const LeaseGone&) {
      // The lease ended unnoticed; the join was not applied. Once more on a new lease.
      lose_lease(lease, "etcd no longer knows the client's lease", true);
      if (attempt > 0) throw;
    }
  }
}

namespace {
// The join's Txn. Both branches read the queue second and the side keys third (success: put,
// range, side range; failure: own key, range, side range). A candidate's side key is put by
// the same Txn as its entry: the same create revision, and never one without the other.
pb::TxnRequest join_txn(const ClientLease& lease, const std::string& key, std::uint64_t request,
                        const std::string& value, const std::string& prefix, const SideKeys& side) {
  // Guarded by the request's marker, which every copy of this Txn that etcd runs puts, in
  // either branch: once we have an answer (or the clean-up is done), a copy still on its way
  // (resent by gRPC to another endpoint, or held up in a paused member) changes nothing, even
  // after the entry was released or left.
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  lease.markers->guard(txn, request);
  add_put(txn.mutable_success(), key, value, lease.id);
  add_range(txn.mutable_success(), queue_range(prefix));
  add_range(txn.mutable_failure(), key_range(key));
  add_range(txn.mutable_failure(), queue_range(prefix));
  if (side.read || side.put) {
    add_range(txn.mutable_success(), queue_range(candidate_key(prefix)));
    add_range(txn.mutable_failure(), queue_range(candidate_key(prefix)));
  }
  if (side.put) add_put(txn.mutable_success(), candidate_key(prefix, lease.hex, request), *side.put, lease.id);
  lease.markers->retire(txn.mutable_success(), request);
  lease.markers->retire(txn.mutable_failure(), request);
  return txn;
}
}  // namespace

EtcdBackend::Joined EtcdBackend::put_entry(const std::shared_ptr<ClientLease>& lease, std::string key,
                                           std::uint64_t request, std::string value, const std::string& prefix,
                                           const CallBudget& budget, LocalTurn* turn, const SideKeys& side) {
  auto& markers = *lease->markers;
  markers.begin(request);
  auto txn = join_txn(*lease, key, request, value, prefix, side);
  const auto floor = markers.add_sweep(txn.mutable_success());
  pb::TxnResponse answer;
  try {
    answer = connection_.txn(txn, budget.for_call(kEtcdTimes.one_shot), Resend::allowed);
  } catch (const LeaseGone&) {
    markers.resolved(request);
    throw;  // not applied
  } catch (const BackendUnavailable&) {
    // Applied or not, the entry leaves (in the background if need be) before we report.
    leave_unconfirmed(lease, key, request, value, turn, side.put ? candidate_key(prefix, lease->hex, request) : "");
    throw;
  } catch (const Error&) {
    markers.resolved(request);  // refused (AccessDenied): not applied, nor will a copy be
    throw;
  }
  markers.resolved(request);
  {
    std::lock_guard lock(mutex_);
    if (lease->readable_key.empty()) lease->readable_key = key;
  }
  Joined joined{lease, std::move(key), std::move(value), answer.header().revision(), {}, answer.header().revision(),
                {},    request};
  // Both branches read the queue second (success: put, range; failure: own key, range).
  joined.range = std::move(*answer.mutable_responses(1)->mutable_response_range());
  if (side.read || side.put) joined.candidates = std::move(*answer.mutable_responses(2)->mutable_response_range());
  if (answer.succeeded()) {
    markers.swept(floor);
    return joined;
  }
  // Our own key from an earlier copy whose answer was lost (the same value), or somebody else's.
  const auto& own = answer.responses(0).response_range();
  if (own.kvs_size() > 0 && parse_entry(own.kvs(0)).kept_until_ms != 0) {
    // Our exclusive key, kept after its release: the name is ours again only once etcd ends it.
    throw BackendUnavailable("the etcd key '" + joined.key + "' is this client's, kept after its release " +
                             "(release_after) until its own lease ends; this client cannot queue for it before then");
  }
  if (own.kvs_size() > 0 && own.kvs(0).value() != joined.value) {
    throw BackendUnavailable("the etcd key '" + joined.key + "' exists but is not this client's entry");
  }
  // An earlier copy put our entry and it was deleted since (by hand): join again.
  if (own.kvs_size() == 0) throw QueueEntryGone();
  joined.created = own.kvs(0).create_revision();
  return joined;
}

}  // namespace turnstile::detail::etcd
