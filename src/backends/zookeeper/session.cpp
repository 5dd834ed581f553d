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
  // ZSESSIONMOVED: another connection owns the session now; no word about ours.
  return rc <= ZAPIERROR && rc != ZSESSIONEXPIRED && rc != ZCLOSING && rc != ZINVALIDCALLBACK && rc != ZSESSIONMOVED;
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
  std::shared_ptr<ServerLease> lease;
  {
    std::lock_guard lock(lease_mutex_);
    if (lease_->lost() && !expired_) {
      // Reported lost (no answer in time), yet the session lives: the server answered on it.
      // The holds told are lost for good; holds made from now on need a lease that is not.
      lease_ = connection_.clock_.watch(lease_->ttl(), sent_at);
      return;
    }
    lease = lease_;
  }
  lease->confirmed(sent_at);  // may resume holds: their callbacks run outside our mutex
}

std::shared_ptr<ServerLease> Session::lease() const {
  std::lock_guard lock(lease_mutex_);
  return lease_;
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
  // alive), a second read when a peer stored more, up to kMaxNodeData: what a server or peer
  // claims beyond that is never allocated here; such data reads as empty (a foreign node).
  std::string buffer(512, '\0');
  Stat local{};
  Stat& result = stat ? *stat : local;
  for (;;) {
    int length = static_cast<int>(buffer.size());
    const int rc = timed(*this, [&] { return zoo_get(handle_, path.c_str(), watch ? 1 : 0, buffer.data(), &length, &result); });
    if (rc == ZOK && result.dataLength > static_cast<int>(kMaxNodeData)) {
      if (data) data->clear();
      return rc;
    }
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

namespace {
struct SyncWait {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  int rc = ZOK;
};
void sync_done(int rc, const char*, const void* data) {
  auto* wait = const_cast<SyncWait*>(static_cast<const SyncWait*>(data));
  std::lock_guard lock(wait->mutex);
  wait->rc = rc;
  wait->done = true;
  wait->cv.notify_all();  // under the mutex: the waiter's stack frame may go right after
}
}  // namespace

int Session::sync(const std::string& path) {
  return timed(*this, [&] {
    // The C client completes every call it accepted (connection loss and close included).
    SyncWait wait;
    const int rc = zoo_async(handle_, path.c_str(), sync_done, &wait);
    if (rc != ZOK) return rc;
    std::unique_lock lock(wait.mutex);
    wait.cv.wait(lock, [&] { return wait.done; });
    return wait.rc;
  });
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
  janitor_ = std::jthread([this](std::stop_token stop) { janitor_loop(stop); });
  keeper_ = std::jthread([this](std::stop_token stop) { keeper_loop(stop); });
}

Connection::~Connection() {
  keeper_.request_stop();
  janitor_.request_stop();
  cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  if (janitor_.joinable()) janitor_.join();
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
  // The lease starts before the session exists: conservative. No hold rides on it before a
  // reply confirms it (or replaces it, if it ran out while connecting).
  auto lease = clock_.watch(settings_.session_timeout, SteadyClock::now());
  zhandle_t* handle = zookeeper_init(settings_.hosts.c_str(), &Connection::on_event,
                                     static_cast<int>(settings_.session_timeout.count()), nullptr, this, 0);
  if (!handle) throw BackendUnavailable("cannot start a ZooKeeper client for " + settings_.description);
  // By default the C client resolves the host list again at nearly every poll (getaddrinfo
  // twice per request, half its CPU per lock+unlock): at most once a minute instead. (-1,
  // "never during normal operation", raced with the first resolution and could leave a new
  // handle with no address to connect to.)
  zoo_set_servers_resolution_delay(handle, 60'000);
  auto session = std::make_shared<Session>(*this, handle, std::move(lease));
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
    // The granted timeout is the one the server expires the session by (the C client has
    // stored it before telling us). Not a confirmation: when the server heard us last is
    // known only from the send time of a request it answered (the keeper pings at once).
    session.lease()->set_ttl(session.timeout());
    session.connected_ = true;
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

bool Connection::sleep(Waiter& waiter, Deadline deadline, const std::stop_token& stop) {
  // Registered before our mutex is taken: it runs at once if the stop was already requested.
  std::stop_callback on_stop(stop, [&] {
    std::lock_guard lock(mutex_);
    waiter.woken = true;
    cv_.notify_all();
  });
  std::unique_lock lock(mutex_);
  if (deadline) {
    const bool woken = cv_.wait_until(lock, *deadline, [&] { return waiter.woken; });
    waiter.woken = false;
    return (woken || SteadyClock::now() < *deadline) && !stop.stop_requested();
  }
  cv_.wait(lock, [&] { return waiter.woken; });
  waiter.woken = false;
  return !stop.stop_requested();
}

bool Connection::wait_connected(const Session& session, Deadline deadline) {
  std::unique_lock lock(mutex_);
  const auto ready = [&] { return session.connected() || session.expired(); };
  if (!deadline) {
    cv_.wait(lock, ready);
    return true;
  }
  return cv_.wait_until(lock, *deadline, ready);
}

void Connection::remove_later(Orphan orphan) {
  {
    std::lock_guard lock(mutex_);
    orphans_.push_back(std::move(orphan));
  }
  cv_.notify_all();
}

std::size_t Connection::orphans() const {
  std::lock_guard lock(mutex_);
  return orphans_.size();
}

bool Connection::clean(const Orphan& orphan) {
  const auto session = orphan.session.lock();
  if (!session || session->expired()) return true;  // its ephemeral nodes went with it
  if (!session->connected()) return false;
  const auto done = [](int rc) { return !connection_trouble(rc); };  // removed, gone, or not ours to remove
  if (!orphan.path.empty()) return done(session->remove(orphan.path));
  std::vector<std::string> mine;
  const int rc = own_children(*session, orphan.parent, orphan.uuid, &mine);
  if (rc != ZOK) return done(rc);
  for (const auto& child : mine) {
    if (!done(session->remove(orphan.parent + "/" + child))) return false;
  }
  return true;
}

int own_children(Session& session, const std::string& parent, const std::string& uuid, std::vector<std::string>* names) {
  names->clear();
  // sync first: after a reconnect to a lagging ensemble member, a plain read could miss a node
  // the leader made (and the caller would make a second one, or leave it behind).
  int rc = session.sync(parent);
  std::vector<std::string> children;
  if (rc == ZOK) rc = session.children(parent, false, &children);
  if (rc == ZNONODE) return ZOK;
  if (rc != ZOK) return rc;
  for (const auto& child : children) {
    if (child.find(uuid) == std::string::npos) continue;
    // Ours only if this very session owns it (a node of an earlier session is not, CURATOR-604).
    Stat stat{};
    rc = session.exists(parent + "/" + child, false, &stat);
    if (rc == ZOK && stat.ephemeralOwner == session.id()) names->push_back(child);
    else if (rc != ZNONODE) return rc;
  }
  return ZOK;
}

// The janitor: removes orphans whenever the session is connected, retrying every 200 ms.
// Sync calls block this thread only: the keeper's pings and the loss clock never wait for it.
void Connection::janitor_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    cv_.wait(lock, stop, [&] { return !orphans_.empty() && session_ && (session_->connected() || session_->expired()); });
    if (stop.stop_requested()) break;
    auto work = orphans_;
    lock.unlock();
    std::vector<bool> finished(work.size());
    for (std::size_t i = 0; i < work.size(); ++i) finished[i] = clean(work[i]);
    lock.lock();
    // Orphans added meanwhile sit after the ones we worked on.
    for (std::size_t i = work.size(); i-- > 0;) {
      if (finished[i]) orphans_.erase(orphans_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (!orphans_.empty()) cv_.wait_for(lock, stop, milliseconds(200), [] { return false; });
  }
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
  // On the C client's completion thread: holds' callbacks (which may call the C client
  // synchronously) must not run here. The keeper confirms it.
  if (server_answered(rc)) ping_confirmed_ = ping_sent_at_.load();
  ping_in_flight_ = false;
  {
    std::lock_guard lock(connection_.mutex_);
    connection_.session_event_ = true;
  }
  connection_.cv_.notify_all();
}

// The keeper: replaces an expired session, pings the live one every third of its granted
// timeout (at most every second, and at once after a reconnect), and tells the session's
// lease what it learnt: unconfirmed while the connection is down (the C client's CONNECTING:
// the session may still be alive, Curator's SUSPENDED), confirmed by each answered ping, lost
// when the session expired. Loss for want of answers is the LossClock's: nothing here can
// delay it.
void Connection::keeper_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  auto last_ping = SteadyClock::time_point{};
  bool was_connected = true;
  while (!stop.stop_requested()) {
    auto session = session_;
    const auto period = std::clamp(session->timeout() / 3, milliseconds(50), milliseconds(1000));
    const auto wake = session->connected() ? last_ping + period : SteadyClock::now() + period;
    cv_.wait_until(lock, stop, wake, [&] { return session_event_; });
    session_event_ = false;
    if (stop.stop_requested()) break;
    session = session_;
    const bool expired = session->expired();
    const bool connected = session->connected();
    const auto pinged = session->ping_confirmed_.exchange(SteadyClock::time_point{});
    lock.unlock();
    // These run holds' callbacks, which may release holds: not under our lock.
    if (expired) {
      session->lease()->lose("its ZooKeeper session expired");
    } else if (!connected) {
      session->lease()->unconfirmed("the connection to ZooKeeper was lost; its session may still be alive");
    } else if (pinged != SteadyClock::time_point{}) {
      session->confirm(pinged);
    }
    if (expired) {
      // A new session: its ephemeral nodes start afresh; waiters wake and join again.
      std::shared_ptr<Session> fresh;
      try {
        fresh = open_session();
      } catch (const Error&) {
      }
      lock.lock();
      if (fresh) adopt_locked(fresh);  // the old one closes when its last user lets go
      wake_all_locked();
      lock.unlock();
    } else if (connected && (!was_connected || SteadyClock::now() >= last_ping + period)) {
      session->start_ping();  // none when the last is still unanswered: tried again a period later
      last_ping = SteadyClock::now();
    }
    was_connected = connected && !expired;
    // Closing a session joins the client's threads, whose watcher takes our lock: never
    // let go of the last reference under it.
    session.reset();
    lock.lock();
  }
}

}  // namespace turnstile::detail::zookeeper
