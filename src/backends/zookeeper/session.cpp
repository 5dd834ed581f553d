#include "backends/zookeeper/session.hpp"

#include <charconv>
#include <cstdio>
#include <cstdlib>

namespace turnstile::detail::zookeeper {

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  if (url.hosts.empty()) throw InvalidUrl("no host in '" + url.text + "'");
  for (const auto& host : url.hosts) {
    const auto endpoint = parse_host_port(host, 2181, url);
    if (!settings.hosts.empty()) settings.hosts += ',';
    settings.hosts += endpoint.host + ":" + std::to_string(endpoint.port);
  }
  settings.description = settings.hosts;
  settings.root = url.path;
  while (!settings.root.empty() && settings.root.back() == '/') settings.root.pop_back();
  if (settings.root.find("//") != std::string::npos) throw InvalidUrl("empty segment in the chroot of '" + url.text + "'");
  settings.user = url.user;
  settings.password = url.password;
  if (!settings.user.empty() && settings.user.find(':') != std::string::npos) {
    throw InvalidUrl("a digest user name cannot contain ':' in '" + url.text + "'");
  }
  for (const auto& [key, value] : url.query) {
    if (key != "session_timeout" && key != "ttl") {
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected session_timeout)");
    }
    settings.session_timeout = parse_seconds("session_timeout", value, 0.1, 86400);
  }
  if (options.ttl.count() > 0) settings.session_timeout = options.ttl;
  return settings;
}

bool server_answered(int rc) {
  if (rc == ZOK) return true;
  return rc <= ZAPIERROR && rc != ZSESSIONEXPIRED && rc != ZCLOSING && rc != ZINVALIDCALLBACK;
}

bool connection_trouble(int rc) {
  return rc == ZCONNECTIONLOSS || rc == ZOPERATIONTIMEOUT || rc == ZSYSTEMERROR || rc == ZMARSHALLINGERROR ||
         rc == ZSESSIONMOVED || rc == ZTHROTTLEDOP;
}

bool session_gone(int rc) { return rc == ZSESSIONEXPIRED || rc == ZINVALIDSTATE || rc == ZCLOSING || rc == ZAUTHFAILED; }

Session::~Session() { zookeeper_close(handle_); }

void Session::confirm(SteadyClock::time_point sent_at) {
  auto current = confirmed_at_.load();
  while (current < sent_at && !confirmed_at_.compare_exchange_weak(current, sent_at)) {
  }
}

namespace {
// Runs one call, noting when the server answered it.
template <class Call>
int timed(Session& session, Call call) {
  const auto sent_at = SteadyClock::now();
  const int rc = call();
  if (server_answered(rc)) session.confirm(sent_at);
  return rc;
}
}  // namespace

int Session::create(const std::string& path, const std::string& data, int flags, std::string* created) {
  char buffer[1024];
  const int rc = timed(*this, [&] {
    return zoo_create(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), connection_.acl(), flags,
                      buffer, sizeof buffer);
  });
  if (rc == ZOK && created) *created = buffer;
  return rc;
}

int Session::remove(const std::string& path, int version) {
  return timed(*this, [&] { return zoo_delete(handle_, path.c_str(), version); });
}

int Session::get(const std::string& path, bool watch, std::string* data, Stat* stat) {
  // Our nodes carry a short line of text: a small buffer first (a waiter keeps nothing large
  // alive), a second read when a peer stored more.
  std::string buffer(512, '\0');
  Stat local{};
  Stat& result = stat ? *stat : local;
  for (;;) {
    int length = static_cast<int>(buffer.size());
    const int rc = timed(*this, [&] { return zoo_get(handle_, path.c_str(), watch ? 1 : 0, buffer.data(), &length, &result); });
    if (rc == ZOK && result.dataLength > static_cast<int>(buffer.size())) {
      buffer.resize(static_cast<std::size_t>(result.dataLength));
      continue;
    }
    if (rc == ZOK && data) data->assign(buffer.data(), length > 0 ? static_cast<std::size_t>(length) : 0);
    return rc;
  }
}

int Session::exists(const std::string& path, bool watch, Stat* stat) {
  Stat local{};
  return timed(*this, [&] { return zoo_exists(handle_, path.c_str(), watch ? 1 : 0, stat ? stat : &local); });
}

int Session::set(const std::string& path, const std::string& data, int version, Stat* stat) {
  Stat local{};
  return timed(*this, [&] {
    return zoo_set2(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), version, stat ? stat : &local);
  });
}

int Session::children(const std::string& path, bool watch, std::vector<std::string>* names) {
  String_vector strings{};
  const int rc = timed(*this, [&] { return zoo_get_children(handle_, path.c_str(), watch ? 1 : 0, &strings); });
  if (rc == ZOK) {
    names->clear();
    names->reserve(static_cast<std::size_t>(strings.count));
    for (int i = 0; i < strings.count; ++i) names->emplace_back(strings.data[i]);
    deallocate_String_vector(&strings);
  }
  return rc;
}

int Session::multi(int count, const zoo_op_t* ops, zoo_op_result_t* results) {
  return timed(*this, [&] { return zoo_multi(handle_, count, ops, results); });
}

Connection::Connection(Settings settings) : settings_(std::move(settings)) {
  // The C client logs connection trouble to stderr; a library stays quiet unless asked.
  zoo_set_debug_level(std::getenv("TURNSTILE_ZK_LOG") ? ZOO_LOG_LEVEL_INFO : static_cast<ZooLogLevel>(0));
  auto first = open_session();
  {
    std::unique_lock lock(mutex_);
    adopt_locked(first);
    const auto wait = std::max(milliseconds(5000), std::min(settings_.session_timeout, milliseconds(15000)));
    cv_.wait_for(lock, wait, [&] { return first->connected() || first->expired(); });
    if (!first->connected()) {
      session_.reset();
      lock.unlock();
      throw BackendUnavailable("no ZooKeeper server answered at " + settings_.description);
    }
  }
  keeper_ = std::jthread([this](std::stop_token stop) { keeper_loop(stop); });
}

Connection::~Connection() {
  keeper_.request_stop();
  cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  std::shared_ptr<Session> last;
  {
    std::lock_guard lock(mutex_);
    last = std::move(session_);
  }
  last.reset();  // closes the session now: its ephemeral nodes go at once, not after a timeout
}

std::shared_ptr<Session> Connection::open_session() {
  // The chroot is not given to the C client: the backend prefixes its paths itself, so it can
  // create the chroot's nodes like any other parent.
  zhandle_t* handle = zookeeper_init(settings_.hosts.c_str(), &Connection::on_event,
                                     static_cast<int>(settings_.session_timeout.count()), nullptr, this, 0);
  if (!handle) throw BackendUnavailable("cannot start a ZooKeeper client for " + settings_.description);
  // By default the C client resolves the host list again at nearly every poll (getaddrinfo
  // twice per request, half its CPU per lock+unlock): at most once a minute instead. (-1,
  // "never during normal operation", raced with the first resolution and could leave a new
  // handle with no address to connect to.)
  zoo_set_servers_resolution_delay(handle, 60'000);
  auto session = std::make_shared<Session>(*this, handle);
  if (!settings_.user.empty()) {
    const auto credentials = settings_.user + ":" + settings_.password;
    zoo_add_auth(handle, "digest", credentials.data(), static_cast<int>(credentials.size()), nullptr, nullptr);
  }
  return session;
}

void Connection::on_event(zhandle_t* handle, int type, int state, const char* path, void* context) {
  static_cast<Connection*>(context)->handle_event(handle, type, state, path);
}

void Connection::wake_all_locked() {
  for (auto* waiter : all_waiters_) waiter->woken = true;
  cv_.notify_all();
}

void Connection::apply_state(Session& session, int state) {
  if (state == ZOO_CONNECTED_STATE) {
    session.connected_ = true;
    session.confirm(SteadyClock::now());
  } else if (state == ZOO_EXPIRED_SESSION_STATE || state == ZOO_AUTH_FAILED_STATE) {
    session.connected_ = false;
    session.expired_ = true;
  } else {
    session.connected_ = false;  // connecting again: suspended until it answers
  }
}

void Connection::adopt_locked(std::shared_ptr<Session> session) {
  if (const auto early = early_states_.find(session->handle()); early != early_states_.end()) {
    apply_state(*session, early->second);
  }
  early_states_.clear();  // states of handles never adopted are of no use
  session_ = std::move(session);
}

void Connection::handle_event(zhandle_t* handle, int type, int state, const char* path) {
  std::lock_guard lock(mutex_);
  if (type == ZOO_SESSION_EVENT) {
    // Only the current session's state matters; an old one was already given up. A session
    // still being opened may connect before it becomes current: keep its state for then.
    if (session_ && session_->handle() == handle) {
      apply_state(*session_, state);
    } else {
      early_states_[handle] = state;
    }
    session_event_ = true;  // the keeper tells the holds at once
    wake_all_locked();
    return;
  }
  if (!path) return;
  if (const auto it = waiters_.find(path); it != waiters_.end()) {
    for (auto* waiter : it->second) waiter->woken = true;
    cv_.notify_all();
  }
}

std::shared_ptr<Session> Connection::session(Deadline deadline) {
  std::unique_lock lock(mutex_);
  // Waiting for a reconnect is bounded even without a deadline: the caller reports trouble.
  auto until = SteadyClock::now() + std::max(settings_.session_timeout, milliseconds(5000));
  if (deadline) until = std::min(until, std::max(*deadline, SteadyClock::now() + milliseconds(1000)));
  cv_.wait_until(lock, until, [&] { return session_ && session_->connected() && !session_->expired(); });
  if (!session_ || session_->expired()) throw BackendUnavailable("the ZooKeeper session at " + settings_.description + " is being replaced");
  // Still connecting: hand it out, its calls wait for the connection or fail with trouble.
  return session_;
}

void Connection::watch(const std::string& path, Waiter* waiter) {
  std::lock_guard lock(mutex_);
  waiters_[path].insert(waiter);
  all_waiters_.insert(waiter);
}

void Connection::unwatch(const std::string& path, Waiter* waiter) {
  std::lock_guard lock(mutex_);
  if (const auto it = waiters_.find(path); it != waiters_.end()) {
    it->second.erase(waiter);
    if (it->second.empty()) waiters_.erase(it);
  }
  all_waiters_.erase(waiter);
}

bool Connection::sleep(Waiter& waiter, Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (deadline) {
    const bool woken = cv_.wait_until(lock, *deadline, [&] { return waiter.woken; });
    waiter.woken = false;
    return woken || SteadyClock::now() < *deadline;
  }
  cv_.wait(lock, [&] { return waiter.woken; });
  waiter.woken = false;
  return true;
}

void Connection::track(TrackedHold* hold) {
  std::lock_guard lock(mutex_);
  holds_.insert(hold);
}

void Connection::untrack(TrackedHold* hold) {
  std::lock_guard lock(mutex_);
  holds_.erase(hold);
}

namespace {
void ping_done(int rc, const Stat*, const void* data) {
  const_cast<Session*>(static_cast<const Session*>(data))->ping_answered(rc);
}
}  // namespace

bool Session::start_ping() {
  if (ping_in_flight_.exchange(true)) return false;
  ping_sent_at_ = SteadyClock::now();
  if (zoo_aexists(handle_, "/", 0, ping_done, this) != ZOK) {
    ping_in_flight_ = false;
    return false;
  }
  return true;
}

void Session::ping_answered(int rc) {
  if (server_answered(rc)) confirm(ping_sent_at_.load());
  ping_in_flight_ = false;
}

// The keeper: replaces an expired session, pings the live one every third of its timeout,
// and tells every hold what it may assume. Lost: its session expired, or was not heard from
// for (nearly) a whole timeout, after which the server may have expired it and granted its
// nodes' places. Suspended: the connection is down but the session may still be alive (Curator's
// SUSPENDED); held again once the same session reconnects.
void Connection::keeper_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    auto session = session_;
    const auto timeout = session->connected() ? session->timeout() : settings_.session_timeout;
    const auto period = std::clamp(timeout / 3, milliseconds(50), milliseconds(1000));
    cv_.wait_for(lock, stop, period, [&] { return session_event_; });
    session_event_ = false;
    if (stop.stop_requested()) break;
    session = session_;
    // Signals, not holds: a hold may be released and destroyed while we report it.
    struct Change {
      std::shared_ptr<LossSignal> signal;
      HoldState state;
      const char* why;
    };
    std::vector<Change> changes;
    const auto now = SteadyClock::now();
    // Trust a hold only until a tenth of the timeout before the server could drop it.
    const auto margin = timeout / 10;
    for (auto* hold : holds_) {
      if (hold->loss->lost()) continue;
      if (hold->session != session.get() || session->expired()) {
        changes.push_back({hold->loss, HoldState::lost, "its ZooKeeper session expired"});
      } else if (now - session->confirmed_at() >= timeout - margin) {
        changes.push_back({hold->loss, HoldState::lost,
                           "ZooKeeper did not answer for a whole session timeout (the process was paused or the server unreachable)"});
      } else if (!session->connected()) {
        changes.push_back({hold->loss, HoldState::suspended,
                           "the connection to ZooKeeper was lost; its session may still be alive"});
      } else if (hold->loss->state() == HoldState::suspended) {
        changes.push_back({hold->loss, HoldState::held, ""});
      }
    }
    if (session->expired()) {
      // A new session: its ephemeral nodes start afresh; waiters wake and join again.
      lock.unlock();
      std::shared_ptr<Session> fresh;
      try {
        fresh = open_session();
      } catch (const Error&) {
      }
      lock.lock();
      if (fresh) adopt_locked(fresh);  // the old one closes when its last user lets go
      wake_all_locked();
    } else if (session->connected()) {
      session->start_ping();
    }
    // These run user callbacks, which may release holds (and untrack): not under our lock.
    lock.unlock();
    for (auto& change : changes) {
      if (change.state == HoldState::lost) change.signal->lose(change.why);
      else if (change.state == HoldState::suspended) change.signal->suspend(change.why);
      else change.signal->resume();
    }
    // Closing a session joins the client's threads, whose watcher takes our lock: never
    // let go of the last reference under it.
    session.reset();
    lock.lock();
  }
}

}  // namespace turnstile::detail::zookeeper
