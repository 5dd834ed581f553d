// SPDX-License-Identifier: Apache-2.0
// The one loss rule for holds on a server-side lease (see loss_clock.hpp).
#include "core/loss_clock.hpp"

#include <algorithm>

namespace turnstile::detail {

using std::chrono::milliseconds;

milliseconds ServerLease::margin_for(milliseconds ttl) { return std::max(ttl / 10, milliseconds(50)); }

ServerLease::ServerLease(LossClock& clock, milliseconds ttl, SteadyClock::time_point confirmed_sent_at)
    : clock_(clock), ttl_(ttl), confirmed_sent_at_(confirmed_sent_at) {}

void ServerLease::attach(std::shared_ptr<LossSignal> hold) {
  bool lost = false;
  bool suspended = false;
  std::string reason;
  LossCause cause = LossCause::other;
  {
    std::lock_guard lock(mutex_);
    lost = lost_;
    suspended = suspended_;
    reason = lost_reason_;
    cause = lost_cause_;
    if (!lost) {
      hold->set_due(deadline_locked());
      holds_.push_back(hold);
    }
  }
  // A hold joining a lease that is lost or unconfirmed is no better off than the lease.
  if (lost) hold->lose(reason, cause);
  else if (suspended) hold->suspend("renewals of its server lease are not getting through");
}

void ServerLease::detach(const LossSignal* hold) {
  std::lock_guard lock(mutex_);
  std::erase_if(holds_, [hold](const auto& held) { return held.get() == hold; });
}

void ServerLease::confirmed(SteadyClock::time_point sent_at) {
  // Past the deadline the holds are lost, whatever comes back later (their holders may have
  // seen so already, LossSignal::observed_state): the clock's thread was merely late to say it.
  if (expire_if_due(SteadyClock::now())) return;
  std::vector<std::shared_ptr<LossSignal>> resumed;
  bool moved = false;
  {
    std::lock_guard lock(mutex_);
    if (lost_) return;
    if (sent_at > confirmed_sent_at_) {
      confirmed_sent_at_ = sent_at;
      moved = true;
      publish_deadline_locked();
    }
    if (suspended_) {
      suspended_ = false;
      resumed = holds_;
    }
  }
  for (auto& hold : resumed) hold->resume();
  if (moved) clock_.deadline_changed();
}

void ServerLease::unconfirmed(const std::string& reason, SuspendCause cause) {
  std::vector<std::shared_ptr<LossSignal>> suspended;
  {
    std::lock_guard lock(mutex_);
    if (lost_ || suspended_) return;
    suspended_ = true;
    suspended = holds_;
  }
  for (auto& hold : suspended) hold->suspend(reason, cause);
}

void ServerLease::lose(const std::string& reason, LossCause cause) { lose_with_margin(reason, milliseconds(0), cause); }

void ServerLease::lose_with_margin(const std::string& reason, milliseconds margin, LossCause cause) {
  std::vector<std::shared_ptr<LossSignal>> lost;
  {
    std::lock_guard lock(mutex_);
    if (lost_) return;
    lost_ = true;
    lost_reason_ = reason;
    lost_cause_ = cause;
    lost.swap(holds_);
  }
  // Every hold is lost before any is told, and each is told on a thread of its own: a holder's
  // slow callback (a stop_callback that winds its work down) must not delay another's report.
  std::erase_if(lost, [&](const auto& hold) { return !hold->mark_lost(reason, margin, cause); });
  for (auto& hold : lost) {
    try {
      std::thread([hold] { hold->tell_lost(); }).detach();
    } catch (...) {
      hold->tell_lost();  // no thread to be had: tell it here
    }
  }
}

void ServerLease::set_ttl(milliseconds ttl) {
  {
    std::lock_guard lock(mutex_);
    if (ttl == ttl_) return;
    ttl_ = ttl;
    publish_deadline_locked();
  }
  clock_.deadline_changed();
}

void ServerLease::publish_deadline_locked() {
  const auto due = deadline_locked();
  for (const auto& hold : holds_) hold->set_due(due);
}

SteadyClock::time_point ServerLease::deadline_locked() const { return confirmed_sent_at_ + ttl_ - margin_for(ttl_); }

milliseconds ServerLease::ttl() const {
  std::lock_guard lock(mutex_);
  return ttl_;
}

milliseconds ServerLease::margin() const { return margin_for(ttl()); }

SteadyClock::time_point ServerLease::loss_deadline() const {
  std::lock_guard lock(mutex_);
  return deadline_locked();
}

bool ServerLease::lost() const {
  std::lock_guard lock(mutex_);
  return lost_;
}

bool ServerLease::expire_if_due(SteadyClock::time_point now) {
  milliseconds ttl;
  SteadyClock::time_point server_expiry;
  {
    std::lock_guard lock(mutex_);
    if (lost_) return true;
    ttl = ttl_;
    server_expiry = confirmed_sent_at_ + ttl_;
    if (deadline_locked() > now) return false;
  }
  const auto left = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(server_expiry - now));
  lose_with_margin("no renewal was confirmed in time: the server may expire it in " + std::to_string(left.count()) +
                       " ms (TTL " + std::to_string(ttl.count()) + " ms)",
                   left, LossCause::renewal_timeout);
  return true;
}

LossClock::LossClock() {
  thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
}

LossClock::~LossClock() {
  thread_.request_stop();
  cv_.notify_all();
}

std::shared_ptr<ServerLease> LossClock::watch(milliseconds ttl, SteadyClock::time_point confirmed_sent_at) {
  auto lease = std::make_shared<ServerLease>(*this, ttl, confirmed_sent_at);
  {
    std::lock_guard lock(mutex_);
    std::erase_if(leases_, [](const auto& weak) { return weak.expired(); });
    leases_.push_back(lease);
    changed_ = true;
  }
  cv_.notify_all();
  return lease;
}

void LossClock::deadline_changed() {
  {
    std::lock_guard lock(mutex_);
    changed_ = true;
  }
  cv_.notify_all();
}

// Sleeps until the earliest deadline of a live lease, then reports every lease that is due.
// Losses are told outside the clock's mutex: a hold's callbacks may release it, and a release
// may make a new lease.
void LossClock::run(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    std::vector<std::shared_ptr<ServerLease>> live;
    live.reserve(leases_.size());
    for (const auto& weak : leases_) {
      if (auto lease = weak.lock()) live.push_back(std::move(lease));
    }
    changed_ = false;
    lock.unlock();
    const auto now = SteadyClock::now();
    std::optional<SteadyClock::time_point> next;
    for (auto& lease : live) {
      if (lease->expire_if_due(now)) continue;
      const auto deadline = lease->loss_deadline();
      if (!next || deadline < *next) next = deadline;
    }
    live.clear();  // a lease dropped by its owner meanwhile is not kept alive by the clock
    lock.lock();
    std::erase_if(leases_, [](const auto& weak) { return weak.expired(); });
    if (changed_) continue;
    if (next) {
      cv_.wait_until(lock, stop, *next, [this] { return changed_; });
    } else {
      cv_.wait(lock, stop, [this] { return changed_; });
    }
  }
}

}  // namespace turnstile::detail
