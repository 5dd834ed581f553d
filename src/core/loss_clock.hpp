// SPDX-License-Identifier: Apache-2.0
// The one loss rule for holds that live on a server-side lease: a Redis entry's TTL, an etcd
// lease, a ZooKeeper session (and later a Consul session).
//
// The server cannot expire a lease earlier than TTL after the moment the last renewal it
// confirmed was *sent* (the renewal reached it later than that). So a hold is reported lost at
//     loss deadline = send time of the last confirmed renewal + TTL - margin,
// margin = max(TTL/10, 50 ms) for clock-rate drift and scheduling, by the LossClock's own thread,
// whatever the backend's network calls are doing: no blocking call can delay it.
//
// Backends feed it: confirmed(sent_at) after every renewal the server answered "still yours"
// (resumes suspended holds and moves the deadline, never backwards), unconfirmed(reason) when a
// renewal went unanswered or failed (suspends), lose(reason) when the server said the lease or
// entry is gone (final).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/loss_signal.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

class LossClock;

class ServerLease {
 public:
  // Use LossClock::watch.
  ServerLease(LossClock& clock, std::chrono::milliseconds ttl, SteadyClock::time_point confirmed_sent_at);

  // Holds riding on this lease. Attaching to a lost lease loses the hold at once.
  void attach(std::shared_ptr<LossSignal> hold);
  void detach(const LossSignal* hold);

  // The server confirmed a renewal sent at `sent_at`: suspended holds are held again, and the
  // deadline moves to sent_at + TTL - margin unless it is already later.
  void confirmed(SteadyClock::time_point sent_at);
  // A renewal went unanswered or failed, but the lease may be alive: holds are suspended.
  void unconfirmed(const std::string& reason, SuspendCause cause = SuspendCause::renewal_unanswered);
  // The lease (or the entry) is gone on the server, or may be: final.
  void lose(const std::string& reason, LossCause cause = LossCause::other);

  // The lease's TTL as the server applies it (ZooKeeper: the negotiated session timeout).
  void set_ttl(std::chrono::milliseconds ttl);
  std::chrono::milliseconds ttl() const;
  std::chrono::milliseconds margin() const;
  SteadyClock::time_point loss_deadline() const;
  bool lost() const;

  static std::chrono::milliseconds margin_for(std::chrono::milliseconds ttl);

 private:
  friend class LossClock;
  // Called by the clock's thread: loses the lease if its deadline has passed.
  bool expire_if_due(SteadyClock::time_point now);
  void lose_with_margin(const std::string& reason, std::chrono::milliseconds margin, LossCause cause);
  // Tells every hold the loss deadline (LossSignal::observed_state reads it). Under mutex_.
  void publish_deadline_locked();
  // The loss deadline: send time of the last confirmed renewal + TTL - margin. Under mutex_.
  SteadyClock::time_point deadline_locked() const;

  LossClock& clock_;
  mutable std::mutex mutex_;
  std::chrono::milliseconds ttl_;
  SteadyClock::time_point confirmed_sent_at_;
  bool lost_ = false;
  std::string lost_reason_;
  LossCause lost_cause_ = LossCause::other;
  bool suspended_ = false;
  std::vector<std::shared_ptr<LossSignal>> holds_;
};

// One thread per backend instance that reports leases lost at their deadlines.
class LossClock {
 public:
  LossClock();
  ~LossClock();
  LossClock(const LossClock&) = delete;
  LossClock& operator=(const LossClock&) = delete;

  // A lease whose last confirmed renewal was sent at `confirmed_sent_at` (for a fresh hold: the
  // send time of the request that created it). Lives while the caller keeps it.
  std::shared_ptr<ServerLease> watch(std::chrono::milliseconds ttl, SteadyClock::time_point confirmed_sent_at);

 private:
  friend class ServerLease;
  void deadline_changed();
  void run(std::stop_token stop);

  std::mutex mutex_;
  std::condition_variable_any cv_;
  std::vector<std::weak_ptr<ServerLease>> leases_;
  bool changed_ = false;
  std::jthread thread_;  // last: stopped and joined first
};

}  // namespace turnstile::detail
