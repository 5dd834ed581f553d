// SPDX-License-Identifier: Apache-2.0
// The etcd backend: its life (made, ended, ended at exit) and this client's local turns.
#include "backends/etcd/etcd_backend.hpp"

#include "core/host_name.hpp"

namespace turnstile::detail::etcd {

// --- process exit ----------------------------------------------------------------------------
// libgrpc's own statics (the poll poller's list of pollers, among others) are made when this
// module is loaded, so they are destroyed at exit before a Client made earlier in static
// storage (a global std::optional<Client> emplaced in main): destroying its channels after
// them crashed (PollPoller::Shutdown on a destroyed list). An exit handler, registered after a
// client's first call (so also after the statics gRPC makes lazily), therefore ends every live
// backend while gRPC still works: its threads stopped, its lease revoked (its keys go, which
// releases its holds), later calls refused. Its gRPC objects are then left to the process's end.
struct LiveBackends {
  std::mutex mutex;
  std::set<EtcdBackend*> backends;
};
LiveBackends& live_backends() {
  static auto* live = new LiveBackends;  // never destroyed: used by exit handlers
  return *live;
}
void end_backends_at_exit();

EtcdBackend::EtcdBackend(Settings settings)
    : owned_connection_(std::make_unique<Connection>(std::move(settings))), connection_(*owned_connection_),
      identity_(std::to_string(getpid()) + " " + host_name()),
      label_suffix_(connection_.settings().holder_label.empty() ? "" : " " + connection_.settings().holder_label) {
  // The lease now: connecting checks that etcd answers, a client's first entry needs one round
  // trip rather than two, and no acquire depends on a grant's reply.
  client_lease(CallBudget(connection_.connect_by()));
  keeper_ = std::jthread([this](std::stop_token stop) { keep_alive_loop(stop); });
  {
    auto& live = live_backends();
    std::lock_guard lock(live.mutex);
    live.backends.insert(this);
  }
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(end_backends_at_exit); });
}

EtcdBackend::~EtcdBackend() {
  bool ended = false;
  {
    auto& live = live_backends();
    std::lock_guard lock(live.mutex);
    live.backends.erase(this);
    ended = ended_at_exit_;
  }
  if (!ended) {
    shut_down();
  } else {
    (void)owned_connection_.release();  // gRPC's globals may be gone: see end_backends_at_exit
  }
  // Leases refer to clock_, which goes before them otherwise.
  {
    std::lock_guard lock(mutex_);
    lease_.reset();
  }
}

void EtcdBackend::end_at_exit() noexcept {
  ended_at_exit_ = true;
  if (getpid() != pid_) return;  // a forked child's copy: no threads here, the parent's lease
  shut_down();
  connection_.close();
  // Threads still waiting (the program's own, not joined before exit) stop waiting; joining
  // again on a new lease fails on the closed connection.
  std::lock_guard lock(mutex_);
  if (!lease_) return;
  lease_->lost = true;
  for (auto* wait : lease_->waits) wait->cancel();
}

LocalTurn::~LocalTurn() {
  if (in_line) backend->leave_local_turn(name, ticket);
}

std::uint64_t EtcdBackend::queue_local_turn(const std::string& name) {
  std::lock_guard lock(mutex_);
  const auto ticket = ++next_ticket_;
  turns_[name].push_back(ticket);
  return ticket;
}

bool EtcdBackend::has_local_turn(const std::string& name, std::uint64_t ticket) {
  std::lock_guard lock(mutex_);
  const auto line = turns_.find(name);
  return line != turns_.end() && line->second.front() == ticket;
}

bool EtcdBackend::wait_local_turn(const std::string& name, std::uint64_t ticket, const CallBudget& budget) {
  std::unique_lock lock(mutex_);
  const auto mine = [&] {
    const auto line = turns_.find(name);
    return line != turns_.end() && line->second.front() == ticket;
  };
  return budget.deadline() ? turns_cv_.wait_until(lock, budget.stop(), *budget.deadline(), mine)
                           : turns_cv_.wait(lock, budget.stop(), mine);
}

std::unique_ptr<WakeArm> EtcdBackend::arm_local_turn(const std::string& name, std::uint64_t ticket, Wake wake) {
  auto armed = key_watcher_.arm_unwatched(std::move(wake));
  bool now = false;
  {
    std::lock_guard lock(mutex_);
    const auto line = turns_.find(name);
    now = line == turns_.end() || line->second.front() == ticket;
    if (!now) turn_wakes_[ticket] = armed;
  }
  if (now) key_watcher_.fire(armed);  // on the worker, never inside arm()
  return std::make_unique<ArmedWake>(key_watcher_, std::move(armed), [this, ticket] {
    std::lock_guard lock(mutex_);
    turn_wakes_.erase(ticket);
  });
}

void EtcdBackend::leave_local_turn(const std::string& name, std::uint64_t ticket) {
  std::shared_ptr<KeyWatcher::Watched> next;
  {
    std::lock_guard lock(mutex_);
    const auto found = turns_.find(name);
    if (found == turns_.end()) return;
    auto& line = found->second;
    const bool had_turn = line.front() == ticket;
    line.remove(ticket);
    if (line.empty()) {
      turns_.erase(found);
    } else if (had_turn) {
      // The next ticket's turn: one wake-up, for it alone.
      const auto armed = turn_wakes_.find(line.front());
      if (armed != turn_wakes_.end()) next = armed->second;
    }
  }
  turns_cv_.notify_all();
  if (next) key_watcher_.fire(next);
}

void EtcdBackend::shut_down() noexcept {
  key_watcher_.stop();
  keeper_.request_stop();
  keeper_cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  // What is still pending gets a last try, and no attempt outlives the client (nor, at exit,
  // gRPC's statics).
  removal_.drain(kEtcdTimes.drain_at_end);
  removal_.close();
  // Every key this client wrote goes with its lease, at once rather than after the TTL.
  std::shared_ptr<ClientLease> last;
  {
    std::lock_guard lock(mutex_);
    last = lease_;
    if (last && last->lost) last.reset();
  }
  if (!last || getpid() != pid_) return;
  try {
    connection_.lease_revoke(last->id, CallBudget(SteadyClock::now() + kRevokeAtEnd));
  } catch (const LeaseGone&) {
  } catch (...) {
    return;
  }
  std::lock_guard lock(mutex_);
  last->gone = true;
  last->revoked_by_client = true;
}

void end_backends_at_exit() {
  auto& live = live_backends();
  std::lock_guard lock(live.mutex);
  for (auto* backend : live.backends) backend->end_at_exit();
}

}  // namespace turnstile::detail::etcd

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v2(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options,
    turnstile::detail::BackendReports& reports) {
  using namespace turnstile::detail::etcd;
  auto settings = parse_settings(url, options);
  settings.reports = &reports;
  const auto timeout = connect_timeout(settings);
  const auto connect_by = turnstile::SteadyClock::now() + timeout;
  try {
    return std::make_unique<EtcdBackend>(settings);
  } catch (const turnstile::BackendUnavailable&) {
    // Whatever step ran out of time (authenticating, the lease grant): the connect timed out,
    // which is what the message must say (a live etcd given 1 ms did not fail to answer).
    if (turnstile::SteadyClock::now() < connect_by) throw;
    throw turnstile::BackendUnavailable("connecting to etcd at " + settings.description + " timed out after " +
                                        std::to_string(timeout.count()) + " ms");
  }
}
