// Lines (a queue, a PermitCounter's waiters): putting an entry at the back, waiting for a change.
#include "backends/etcd/etcd_backend.hpp"

namespace turnstile::detail::etcd {

// --- lines: joining and waiting ----------------------------------------------------------

void EtcdBackend::wait_for_change(ClientLease& lease, const pb::WatchCreateRequest& request, const CallBudget& budget,
                                  const std::function<bool()>& changed_already) {
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
  bool already = false;
  if (changed_already && !budget.stopped()) {
    try {
      already = changed_already();
    } catch (const BackendUnavailable&) {
      // Could not look: the watch tells.
    }
  }
  pb::WatchResponse response;
  const bool changed = already || watch.next(response);
  // A stream that ended at once (etcd restarting, a fork): do not spin.
  if (!changed && SteadyClock::now() - started < kWatchEndedAtOnce && !budget.passed() && !lease_lost(lease)) {
    std::this_thread::sleep_for(kWatchRetryPause);
  }
}

EtcdBackend::Joined EtcdBackend::join_line(const std::string& prefix, const EntryMaker& entry, const CallBudget& budget,
                                           LocalTurn* turn) {
  for (int attempt = 0;; ++attempt) {
    auto lease = client_lease(budget.for_call(kEtcdTimes.one_shot));
    const auto number = next_request();
    auto [key, value] = entry(*lease, number);
    try {
      return put_entry(lease, std::move(key), number, std::move(value), prefix, budget, turn);
    } catch (const LeaseGone&) {
      // The lease ended unnoticed; the join was not applied. Once more on a new lease.
      lose_lease(lease, "etcd no longer knows the client's lease", true);
      if (attempt > 0) throw;
    }
  }
}

EtcdBackend::Joined EtcdBackend::put_entry(const std::shared_ptr<ClientLease>& lease, std::string key,
                                           std::uint64_t request, std::string value, const std::string& prefix,
                                           const CallBudget& budget, LocalTurn* turn) {
  // Guarded by the request's marker, which every copy of this Txn that etcd runs puts, in
  // either branch: once we have an answer (or the clean-up is done), a copy still on its way
  // (resent by gRPC to another endpoint, or held up in a paused member) changes nothing, even
  // after the entry was released or left.
  auto& markers = *lease->markers;
  markers.begin(request);
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  markers.guard(txn, request);
  add_put(txn.mutable_success(), key, value, lease->id);
  add_range(txn.mutable_success(), queue_range(prefix));
  markers.retire(txn.mutable_success(), request);
  const auto floor = markers.add_sweep(txn.mutable_success());
  add_range(txn.mutable_failure(), key_range(key));
  add_range(txn.mutable_failure(), queue_range(prefix));
  markers.retire(txn.mutable_failure(), request);
  pb::TxnResponse answer;
  try {
    answer = connection_.txn(txn, budget.for_call(kEtcdTimes.one_shot), Resend::allowed);
  } catch (const LeaseGone&) {
    markers.resolved(request);
    throw;  // not applied
  } catch (const BackendUnavailable&) {
    // Applied or not, the entry leaves (in the background if need be) before we report.
    leave_unconfirmed(lease, key, request, value, turn);
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
  Joined joined{lease, std::move(key), std::move(value), answer.header().revision(), {}, answer.header().revision()};
  // Both branches read the queue second (success: put, range; failure: own key, range).
  joined.range = std::move(*answer.mutable_responses(1)->mutable_response_range());
  if (answer.succeeded()) {
    markers.swept(floor);
    return joined;
  }
  // Our own key from an earlier copy whose answer was lost (the same value), or somebody else's.
  const auto& own = answer.responses(0).response_range();
  if (own.kvs_size() > 0 && own.kvs(0).value() != joined.value) {
    throw BackendUnavailable("the etcd key '" + joined.key + "' exists but is not this client's entry");
  }
  // An earlier copy put our entry and it was deleted since (by hand): join again.
  if (own.kvs_size() == 0) throw QueueEntryGone();
  joined.created = own.kvs(0).create_revision();
  return joined;
}

}  // namespace turnstile::detail::etcd
