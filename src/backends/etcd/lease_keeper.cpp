// SPDX-License-Identifier: Apache-2.0
// The client's etcd lease: granted, kept alive every TTL/3 (with the term check), lost.
#include "backends/etcd/etcd_backend.hpp"

#include <algorithm>

namespace turnstile::detail::etcd {
namespace {

// A keep-alive round every TTL/3, as etcd's own client does.
milliseconds keep_alive_period(milliseconds ttl) {
  return std::max(kKeepAliveShortestPeriod, std::chrono::duration_cast<milliseconds>(ttl / 3));
}

}  // namespace

std::shared_ptr<ClientLease> EtcdBackend::client_lease(const CallBudget& call) {
  {
    std::lock_guard lock(mutex_);
    if (lease_ && !lease_->lost) return lease_;
  }
  // The call's own end, as its caller set it (connect_timeout may exceed the usual cap).
  const auto end = call.deadline().value_or(call.call_end(kEtcdTimes.call));
  std::unique_lock grant(grant_mutex_, std::defer_lock);
  if (!grant.try_lock_until(end)) throw BackendUnavailable("no etcd lease was granted before the deadline");
  {
    std::lock_guard lock(mutex_);
    if (lease_ && !lease_->lost) return lease_;
  }
  auto fresh = grant_lease(CallBudget(end, call.stop()));
  {
    std::lock_guard lock(mutex_);
    lease_ = fresh;
  }
  keeper_cv_.notify_all();
  return fresh;
}

std::shared_ptr<ClientLease> EtcdBackend::grant_lease(const CallBudget& call) {
  const auto ttl_seconds = std::max<std::int64_t>(1, (connection_.settings().ttl.count() + 999) / 1000);
  const auto sent_at = SteadyClock::now();
  const auto granted = connection_.lease_grant(ttl_seconds, call);
  auto fresh = std::make_shared<ClientLease>();
  fresh->id = granted.id();
  fresh->hex = lease_hex(granted.id());
  fresh->markers = std::make_unique<RequestMarkers>(fresh->id, fresh->hex);
  // The TTL etcd granted (it raises requests below its minimum), counted from the request.
  fresh->ttl = seconds(std::max<std::int64_t>(1, granted.ttl()));
  fresh->next_round = sent_at + keep_alive_period(fresh->ttl);
  fresh->server_lease = clock_.watch(fresh->ttl, sent_at);
  std::weak_ptr<ClientLease> weak = fresh;
  // Not a hold: no telemetry counts its changes.
  auto tell_backend =
      std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{.on_lost =
                                                                              [this, weak](const Error&) {
                                                                                if (auto lost = weak.lock())
                                                                                  give_up(lost);
                                                                              },
                                                                          .on_state = {},
                                                                          .telemetry = nullptr});
  fresh->watcher = std::make_shared<LossSignal>("etcd lease " + fresh->hex, std::move(tell_backend));
  fresh->server_lease->attach(fresh->watcher);
  return fresh;
}

void EtcdBackend::lose_lease(const std::shared_ptr<ClientLease>& lease, const std::string& reason, bool gone) {
  if (gone) {
    std::lock_guard lock(mutex_);
    lease->gone = true;
  }
  lease->server_lease->lose(reason, LossCause::session_expired);  // tells every hold (user callbacks: no lock held)
  give_up(lease);
}

void EtcdBackend::give_up(const std::shared_ptr<ClientLease>& lease) {
  bool revoke = false;
  {
    std::lock_guard lock(mutex_);
    if (lease->lost) return;
    lease->lost = true;
    revoke = !lease->gone;
    // Waiters stop at once (etcd-io/etcd#19597) and join again on a new lease.
    for (auto* wait : lease->waits) wait->cancel();
  }
  key_watcher_.wake_lease(lease->id);  // so do the async ones (arm_watch checks `lost` after arming)
  keeper_cv_.notify_all();
  // Keys that etcd might still keep (its answers were lost; it revives leases after a
  // restart) go now, or as soon as etcd answers.
  if (revoke) {
    const auto id = lease->id;
    Cleanup cleanup{lease, {}, nullptr, {}};
    cleanup.attempt = [this, id, pending = lease.get()](const CallBudget& budget) {
      {
        std::lock_guard lock(mutex_);
        if (pending->unresolved_takes > 0)
          throw BackendUnavailable("a take's receipt on the lease is still to be read");
      }
      connection_.lease_revoke(id, budget);
    };
    schedule("the revoke of etcd lease " + lease->hex, std::move(cleanup));
  }
}

// Every TTL/3, one keep-alive round on a stream of its own (no lock is held during it, and no
// other call waits for it or it for them). Each round etcd answers moves the loss deadline
// (ServerLease, from the round's send time); one that gets no answer within min(TTL/3, 1 s)
// suspends the holds and is tried again 100 ms later. The LossClock reports the loss itself.
void EtcdBackend::keep_alive_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    const auto current = lease_;
    if (!current || current->lost) {
      keeper_cv_.wait(lock, stop, [&] { return lease_ && !lease_->lost; });
      continue;
    }
    const auto patience = std::min(keep_alive_period(current->ttl), kKeepAlivePatience);
    keeper_cv_.wait_until(lock, stop, current->next_round,
                          [&] { return lease_ != current || current->lost || current->check_now; });
    if (stop.stop_requested() || lease_ != current || current->lost) continue;
    current->check_now = false;
    lock.unlock();
    const auto sent_at = SteadyClock::now();
    const auto ttl = keep_alive_round(current, sent_at, patience);
    lock.lock();
    if (ttl) current->ttl = *ttl;
    current->next_round = ttl ? sent_at + keep_alive_period(*ttl) : SteadyClock::now() + kKeepAliveRetryPause;
  }
}

std::optional<milliseconds> EtcdBackend::keep_alive_round(const std::shared_ptr<ClientLease>& lease,
                                                          SteadyClock::time_point sent_at, milliseconds patience) {
  std::optional<etcd::Connection::KeepAliveAnswer> answer;
  try {
    answer = connection_.keep_alive(lease->id, sent_at + patience);
  } catch (const LeaseGone&) {
    answer.emplace();
  } catch (const Error&) {
  }
  auto* reports = connection_.settings().reports;
  if (!answer) {
    lease->server_lease->unconfirmed("the lease keep-alive got no answer from etcd; the lease may still be alive");
    if (reports) reports->renewal_failed("the lease keep-alive got no answer from etcd");
    keep_alive_unanswered_ = true;
    return std::nullopt;
  }
  // The first answer after unanswered ones: gRPC's channel reached the server again.
  if (std::exchange(keep_alive_unanswered_, false) && reports) reports->connected(true);
  if (answer->ttl <= 0) {
    if (reports) reports->renewal_failed("etcd no longer knows the client's lease");
    lose_lease(lease, "etcd no longer knows the client's lease (it expired)", true);
    return std::nullopt;
  }
  // A leader resumed after a pause answers keep-alives of leases the new leader may already have
  // revoked (etcd 3.4, etcd-io/etcd#15247): two holders at once. Only a linearizable read served
  // in the keep-alive's own term proves that its answerer still led, with a quorum, after it
  // answered; otherwise this round confirms nothing (the next one, 100 ms later, may). The read
  // is of one of our own keys, which any etcd role that lets us lock lets us read. (Before the
  // lease has an entry, nothing rides on it to be protected.)
  std::string readable_key;
  {
    std::lock_guard lock(mutex_);
    readable_key = lease->readable_key;
  }
  if (!readable_key.empty()) {
    std::optional<std::uint64_t> term;
    try {
      term = connection_.linearizable_term(readable_key, CallBudget(sent_at + patience));
    } catch (const Error&) {
    }
    if (!term || *term != answer->raft_term) {
      lease->server_lease->unconfirmed("the etcd server that renewed the lease may no longer lead the cluster",
                                       SuspendCause::leader_changed);
      if (reports) reports->renewal_failed("the etcd server that renewed the lease may no longer lead the cluster");
      return std::nullopt;
    }
  }
  const milliseconds ttl = seconds(answer->ttl);
  lease->server_lease->set_ttl(ttl);
  lease->server_lease->confirmed(sent_at);
  if (reports) reports->renewed(SteadyClock::now() - sent_at);
  return ttl;
}

void EtcdBackend::check_lease_now() {
  {
    std::lock_guard lock(mutex_);
    if (!lease_ || lease_->lost) return;
    lease_->check_now = true;
  }
  keeper_cv_.notify_all();
}

}  // namespace turnstile::detail::etcd
