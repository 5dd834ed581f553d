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
  if (held) backend->leave_local_turn(name);
}

bool EtcdBackend::enter_local_turn(const std::string& name, const CallBudget& budget) {
  std::unique_lock lock(mutex_);
  const auto ticket = next_ticket_++;
  turns_[name].push_back(ticket);
  const auto mine = [&] { return turns_[name].front() == ticket; };
  const bool got = budget.deadline() ? turns_cv_.wait_until(lock, budget.stop(), *budget.deadline(), mine)
                                     : turns_cv_.wait(lock, budget.stop(), mine);
  if (got) return true;
  auto& waiting = turns_[name];
  waiting.remove(ticket);
  if (waiting.empty()) turns_.erase(name);
  turns_cv_.notify_all();
  return false;
}

void EtcdBackend::leave_local_turn(const std::string& name) {
  std::lock_guard lock(mutex_);
  auto it = turns_.find(name);
  if (it == turns_.end()) return;
  it->second.pop_front();
  if (it->second.empty()) turns_.erase(it);
  turns_cv_.notify_all();
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

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::etcd;
  return std::make_unique<EtcdBackend>(parse_settings(url, options));
}
