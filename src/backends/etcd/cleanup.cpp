// SPDX-License-Identifier: Apache-2.0
// Clean-ups: leaves and settles tried once in the caller's thread, then handed to the core's
// GuaranteedRemoval, which retries them with its backoff until done or moot.
#include "backends/etcd/etcd_backend.hpp"

namespace turnstile::detail::etcd {

void EtcdBackend::schedule(std::string what, Cleanup cleanup) {
  auto item = std::make_shared<Cleanup>(std::move(cleanup));
  // One bounded attempt; a BackendUnavailable tells the service to try again after its pause.
  // The attempt ends by kBackgroundTry, or sooner when the service says so (a client's end).
  removal_.add(std::move(what), [this, item](const CallBudget& budget) {
    try {
      attempt_cleanup(*item, budget.until(SteadyClock::now() + kBackgroundTry));
      return Removal::done;
    } catch (const BackendUnavailable&) {
      // The turn guards the one key per (lease, name); a lost lease is never used again, so
      // the next entry (on a new lease) need not wait for this clean-up.
      if (lease_lost(*item->lease)) item->turn.reset();
      throw;
    }
  });
}

void EtcdBackend::attempt_cleanup(Cleanup& cleanup, const CallBudget& budget) {
  if (!lease_gone(*cleanup.lease)) {  // otherwise its keys went with the lease
    try {
      cleanup.attempt(budget);
    } catch (const LeaseGone&) {
      lose_lease(cleanup.lease, "etcd no longer knows the client's lease", true);
    }
  }
  if (cleanup.finished) std::exchange(cleanup.finished, {})();
  cleanup.turn.reset();  // leaves the local turn
}

std::optional<pb::TxnResponse> EtcdBackend::run_cleanup(const std::shared_ptr<ClientLease>& lease, pb::TxnRequest txn,
                                                        CleanupOptions options) {
  auto answer = std::make_shared<std::optional<pb::TxnResponse>>();
  const auto shared_txn = std::make_shared<const pb::TxnRequest>(std::move(txn));
  Cleanup cleanup{lease, {}, nullptr, std::move(options.finished)};
  if (!options.first_try.passed()) {
    cleanup.attempt = [this, shared_txn, answer, cap = options.attempt_cap](const CallBudget& budget) {
      *answer = connection_.txn(*shared_txn, budget, Resend::allowed, cap);
    };
    try {
      attempt_cleanup(cleanup, options.first_try.for_call(kEtcdTimes.call));
      return *answer;
    } catch (...) {
      // Not answered (or refused) in time: the background takes it over (callers are noexcept).
    }
  }
  if (options.turn && options.turn->in_line && !lease_lost(*lease)) {
    cleanup.turn = std::make_unique<LocalTurn>(this, options.turn->name, options.turn->ticket, true);
    options.turn->in_line = false;
  }
  cleanup.attempt = options.later ? std::move(options.later) : [this, shared_txn](const CallBudget& budget) {
    connection_.txn(*shared_txn, budget, Resend::allowed);
  };
  schedule("an etcd clean-up on lease " + lease->hex, std::move(cleanup));  // its later answers are nobody's
  return std::nullopt;
}

void EtcdBackend::leave_unconfirmed(const std::shared_ptr<ClientLease>& lease, const std::string& key,
                                    std::uint64_t request, const std::string& value, LocalTurn* turn,
                                    const std::string& side_key) {
  pb::TxnRequest txn;
  add_value_compare(txn, key, value);
  add_delete(txn.mutable_success(), key);
  if (!side_key.empty()) add_delete(txn.mutable_success(), side_key);
  lease->markers->retire(txn.mutable_success(), request);
  lease->markers->retire(txn.mutable_failure(), request);
  run_cleanup(lease, std::move(txn),
              {.turn = turn, .finished = [lease, request] { lease->markers->resolved(request); }});
}

}  // namespace turnstile::detail::etcd
