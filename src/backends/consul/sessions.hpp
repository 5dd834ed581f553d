// SPDX-License-Identifier: Apache-2.0
// Consul sessions (sessions.cpp): the client's main session, which holds its queue entries and
// api.Lock keys, and spare sessions, one per Semaphore permit held (api.Semaphore counts one
// holder per session). All are renewed every TTL/2 by one thread on connections of its own, so
// a renewal never queues behind other calls, and all at once (up to kParallel in flight), so a
// round takes about one reply's time however many sessions there are; each is a ServerLease of
// the core's LossClock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/consul/http.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::consul {

struct SessionSettings {
  std::chrono::milliseconds ttl{15000};
  std::chrono::milliseconds lock_delay{15000};
  std::string name;  // "turnstile <host> <pid>", shown by inspect
};

struct Session {
  std::string id;
  std::shared_ptr<ServerLease> lease;
};

class Sessions {
 public:
  Sessions(const Endpoint& endpoint, Http& calls, SessionSettings settings);
  ~Sessions();  // destroys every session (bounded), so their keys go at once

  // The main session; a new one when there is none or it was lost.
  std::shared_ptr<Session> main(std::chrono::milliseconds timeout);
  // A session for one Semaphore permit, from the spares or new.
  std::shared_ptr<Session> spare(std::chrono::milliseconds timeout);
  // A permit's session back to the spares (it holds nothing any more).
  void give_back(std::shared_ptr<Session> session);

  const SessionSettings& settings() const { return settings_; }

  // A session nobody renews, for an entry kept after its release (release_after): TTL `ttl`
  // (10 s, Consul's default minimum, when the server refuses a shorter one), no lock-delay, its
  // end deletes what it holds. Consul ends a TTL session up to 2 x TTL after its last renewal.
  // `applied`: the TTL the server took.
  std::string create_unrenewed(std::chrono::milliseconds ttl, std::chrono::milliseconds timeout,
                               std::chrono::milliseconds& applied);

 private:
  std::shared_ptr<Session> create(std::chrono::milliseconds timeout);
  // PUT /v1/session/create; the new session's id. Throws InvalidArgument when the server refuses
  // the TTL.
  std::string create_id(std::chrono::milliseconds ttl, std::chrono::milliseconds lock_delay,
                        std::chrono::milliseconds timeout);
  // One round: every session of `due` at once; true when all were confirmed (a lost one too:
  // it needs no retry). A stop ends it at once.
  bool renew(const std::vector<std::shared_ptr<Session>>& due, const std::stop_token& stop);
  // All at once, within kDestroyTimeout in all.
  void destroy(const std::vector<std::string>& ids, const std::stop_token& stop) noexcept;
  void run(std::stop_token stop);

  Http& calls_;
  Http renewals_;  // the renewing thread's own connection
  SessionSettings settings_;
  LossClock clock_;
  std::mutex mutex_;
  std::condition_variable_any wake_;
  std::shared_ptr<Session> main_;
  std::vector<std::shared_ptr<Session>> all_;     // renewed
  std::vector<std::shared_ptr<Session>> spares_;  // idle permit sessions
  std::vector<std::string> to_destroy_;           // lost ones, destroyed by the renewing thread
  std::jthread thread_;                           // last: stopped first
};

}  // namespace turnstile::detail::consul
