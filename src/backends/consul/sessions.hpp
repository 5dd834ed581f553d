// Consul sessions (sessions.cpp): the client's main session, which holds its queue entries and
// api.Lock keys, and spare sessions, one per Semaphore permit held (api.Semaphore counts one
// holder per session). All are renewed every TTL/2 by one thread on a connection of its own,
// so a renewal never queues behind other calls; each is a ServerLease of the core's LossClock.
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

 private:
  std::shared_ptr<Session> create(std::chrono::milliseconds timeout);
  bool renew(Session& session);  // true when confirmed
  void destroy(const std::string& id, std::chrono::milliseconds timeout) noexcept;
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
