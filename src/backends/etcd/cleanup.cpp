// Clean-ups: leaves and settles tried once in the caller's thread, then in the background.
#include "backends/etcd/etcd_backend.hpp"

namespace turnstile::detail::etcd {

// --- clean-up ----------------------------------------------------------------------------

void EtcdBackend::schedule(Cleanup cleanup) {
  cleanup.next_try = SteadyClock::now();
  {
    std::lock_guard lock(janitor_mutex_);
    cleanups_.push_back(std::move(cleanup));
  }
  janitor_cv_.notify_all();
}

bool EtcdBackend::try_cleanup(Cleanup& cleanup, SteadyClock::time_point deadline) noexcept {
  bool done = lease_gone(*cleanup.lease);  // its keys went with the lease
  if (!done) {
    try {
      cleanup.attempt(deadline);
      done = true;
    } catch (const LeaseGone&) {
      lose_lease(cleanup.lease, "etcd no longer knows the client's lease", true);
      done = true;
    } catch (...) {
      // Not answered (or refused): tried again later.
    }
  }
  if (done && cleanup.finished) std::exchange(cleanup.finished, {})();
  // The turn guards the one key per (lease, name); a lost lease is never used again, so the
  // next entry (on a new lease) need not wait for this clean-up.
  if ((done || lease_lost(*cleanup.lease)) && !cleanup.turn.empty()) {
    leave_local_turn(cleanup.turn);
    cleanup.turn.clear();
  }
  return done;
}

std::optional<pb::TxnResponse> EtcdBackend::run_cleanup(const std::shared_ptr<ClientLease>& lease, pb::TxnRequest txn,
                                                        LocalTurn* turn, milliseconds first_try,
                                                        std::function<void()> finished,
                                                        std::function<void(SteadyClock::time_point)> later,
                                                        const std::stop_token& stop, milliseconds attempt_cap) {
  auto answer = std::make_shared<std::optional<pb::TxnResponse>>();
  const auto shared_txn = std::make_shared<const pb::TxnRequest>(std::move(txn));
  Cleanup cleanup;
  cleanup.lease = lease;
  cleanup.finished = std::move(finished);
  cleanup.attempt = [this, shared_txn, answer, stop, attempt_cap](SteadyClock::time_point deadline) {
    *answer = connection_.txn(*shared_txn, deadline, true, stop, attempt_cap);
  };
  const bool may_try = first_try > milliseconds::zero() && !stop.stop_requested();
  if (may_try && try_cleanup(cleanup, SteadyClock::now() + first_try)) return *answer;
  if (turn && turn->held && !lease_lost(*lease)) {
    cleanup.turn = turn->name;
    turn->held = false;
  }
  cleanup.attempt = later ? std::move(later) : [this, shared_txn](SteadyClock::time_point deadline) {
    connection_.txn(*shared_txn, deadline, true);
  };
  schedule(std::move(cleanup));  // its later answers are nobody's
  return std::nullopt;
}

void EtcdBackend::leave_unconfirmed(const std::shared_ptr<ClientLease>& lease, const std::string& key,
                                    std::uint64_t request, const std::string& value, LocalTurn* turn) {
  pb::TxnRequest txn;
  add_value_compare(txn, key, value);
  add_delete(txn.mutable_success(), key);
  lease->markers->retire(txn.mutable_success(), request);
  lease->markers->retire(txn.mutable_failure(), request);
  run_cleanup(lease, std::move(txn), turn, kLeaveTry, [lease, request] { lease->markers->resolved(request); });
}

void EtcdBackend::janitor_loop(std::stop_token stop) {
  std::unique_lock lock(janitor_mutex_);
  while (!stop.stop_requested()) {
    if (cleanups_.empty()) {
      janitor_cv_.wait(lock, stop, [&] { return !cleanups_.empty(); });
      continue;
    }
    auto due = cleanups_.front().next_try;
    for (const auto& cleanup : cleanups_) due = std::min(due, cleanup.next_try);
    if (janitor_cv_.wait_until(lock, stop, due, [&] { return false; }); stop.stop_requested()) break;
    std::list<Cleanup> now_due;
    const auto now = SteadyClock::now();
    for (auto it = cleanups_.begin(); it != cleanups_.end();) {
      auto next = std::next(it);
      if (it->next_try <= now) now_due.splice(now_due.end(), cleanups_, it);
      it = next;
    }
    lock.unlock();
    for (auto it = now_due.begin(); it != now_due.end();) {
      if (try_cleanup(*it, SteadyClock::now() + kBackgroundTry)) {
        it = now_due.erase(it);
      } else {
        it->pause = std::min(it->pause * 2, kCleanupLastPause);
        it->next_try = SteadyClock::now() + it->pause;
        ++it;
      }
    }
    lock.lock();
    cleanups_.splice(cleanups_.end(), now_due);
  }
}

}  // namespace turnstile::detail::etcd
