#include "backends/zookeeper/session.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace turnstile::detail::zookeeper {

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  settings.holder_label = options.holder_label;
  settings.connect_timeout = options.connect_timeout;
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
  check_ttl_option(options.ttl, 0.1);
  if (options.ttl.count() > 0) settings.session_timeout = options.ttl;
  return settings;
}

bool server_answered(int rc) {
  if (rc == ZOK) return true;
  // ZSESSIONMOVED: another connection owns the session now; no word about ours.
  return rc <= ZAPIERROR && rc != ZSESSIONEXPIRED && rc != ZCLOSING && rc != ZINVALIDCALLBACK && rc != ZSESSIONMOVED;
}

bool connection_trouble(int rc) {
  // ZRUNTIMEINCONSISTENCY: a reply came out of order (replies were lost on the way); the C
  // client drops the connection and fails every pending call with this code, outcome unknown.
  return rc == ZCONNECTIONLOSS || rc == ZOPERATIONTIMEOUT || rc == ZSYSTEMERROR || rc == ZMARSHALLINGERROR ||
         rc == ZSESSIONMOVED || rc == ZTHROTTLEDOP || rc == ZRUNTIMEINCONSISTENCY || rc == ZSSLCONNECTIONERROR;
}

bool session_gone(int rc) { return rc == ZSESSIONEXPIRED || rc == ZINVALIDSTATE || rc == ZCLOSING || rc == ZAUTHFAILED; }

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

milliseconds Session::short_wait() const { return std::clamp(timeout() / 3, kShortWaitMin, kShortWaitMax); }

// One call's completion state, owned jointly by the caller and the call's entry in the registry
// of calls in flight (below), which its completion claims. The C client runs the completion of
// every call it accepted at most once (on the reply, a connection loss or the session's
// expiry), so a caller that gave up at its bound leaves the state to a completion that may come
// much later and write into it: the results of a transaction and its created paths' buffers
// included, which the C client writes only then.
struct CallState {
  Session* session = nullptr;
  SteadyClock::time_point sent_at;  // pings: what their answer confirms
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  int rc = ZOK;
  std::string value;  // create, sync: the path; get: the data
  Stat stat{};
  bool has_stat = false;
  std::vector<std::string> names;
  std::vector<zoo_op_result_t> results;  // multi
  std::vector<std::vector<char>> buffers;
};

namespace {

// Calls in flight, by id: the C client's context is the id, never a pointer. A completion
// claims its state here. zookeeper_close joins the C client's threads and frees the handle
// without completing calls still pending: ~Session drops their states, and a completion that
// never comes leaks nothing (nor could a late one reach freed memory: its id is gone).
class InFlight {
 public:
  void* add(std::shared_ptr<CallState> call) {
    std::lock_guard lock(mutex_);
    const auto id = next_++;
    calls_.emplace(id, std::move(call));
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id));
  }
  std::shared_ptr<CallState> claim(const void* context) {
    std::lock_guard lock(mutex_);
    const auto it = calls_.find(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(context)));
    if (it == calls_.end()) return nullptr;
    auto call = std::move(it->second);
    calls_.erase(it);
    return call;
  }
  void drop(const Session* session) {
    std::lock_guard lock(mutex_);
    std::erase_if(calls_, [&](const auto& entry) { return entry.second->session == session; });
  }

 private:
  std::mutex mutex_;
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, std::shared_ptr<CallState>> calls_;
};

InFlight& in_flight() {
  static auto* registry = new InFlight;  // never destroyed: a completion may run at exit
  return *registry;
}

// Ends a call on the C client's completion thread: `fill` copies the results (ZOK only). Never
// calls the C client or a hold's callback.
template <class Fill>
void complete(const void* data, int rc, Fill fill) {
  const auto claimed = in_flight().claim(data);
  if (!claimed) return;
  CallState& call = *claimed;
  if (server_answered(rc)) call.session->heard_from_server();
  {
    std::lock_guard lock(call.mutex);
    call.rc = rc;
    if (rc == ZOK) fill(call);
    call.done = true;
  }
  call.cv.notify_all();
}

void void_done(int rc, const void* data) {
  complete(data, rc, [](CallState&) {});
}

void string_done(int rc, const char* value, const void* data) {
  complete(data, rc, [&](CallState& call) { call.value = value ? value : ""; });
}

void string_stat_done(int rc, const char* value, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    call.value = value ? value : "";
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

void stat_done(int rc, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

void data_done(int rc, const char* value, int length, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    // What a server or peer stores beyond kMaxNodeData reads as empty (a foreign node).
    if (value && length > 0 && static_cast<std::size_t>(length) <= kMaxNodeData) call.value.assign(value, static_cast<std::size_t>(length));
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

void strings_done(int rc, const String_vector* strings, const void* data) {
  complete(data, rc, [&](CallState& call) {
    if (!strings) return;
    call.names.reserve(static_cast<std::size_t>(strings->count));
    for (int i = 0; i < strings->count; ++i) call.names.emplace_back(strings->data[i]);
  });
}

}  // namespace

Session::~Session() {
  zookeeper_close(handle_);
  in_flight().drop(this);  // calls the C client will never complete now
}

template <class Start>
int Session::run(const CallBound& bound, const std::shared_ptr<CallState>& call, Start start) {
  call->session = this;
  const auto sent_at = SteadyClock::now();
  void* context = in_flight().add(call);
  const int started = start(context);
  if (started != ZOK) {
    // Refused before the C client registered the completion (bad arguments, a closed or
    // expired handle): ours to drop. Other refusals (out of memory inside the client) may come
    // after it registered it: left to that completion, or to ~Session.
    if (started == ZBADARGUMENTS || started == ZINVALIDSTATE) in_flight().claim(context);
    return started;
  }
  // A stop ends the wait as its bound passing would (registered before the lock is taken: it
  // runs at once when the stop was requested already).
  std::stop_callback on_stop(bound.stop, [&call] {
    std::lock_guard guard(call->mutex);
    call->cv.notify_all();
  });
  std::unique_lock lock(call->mutex);
  while (!call->done) {
    // The C client completes calls on expiry too; a session seen gone is not waited for.
    if (expired_) return ZSESSIONEXPIRED;
    if (bound.passed()) {
      if (!bound.stopped()) silent_ = true;  // a stop says nothing about the link
      return ZOPERATIONTIMEOUT;  // the completion still comes, to a state that is still alive
    }
    auto until = SteadyClock::now() + kExpiryPoll;  // to see the session gone
    if (bound.deadline) until = std::min(until, *bound.deadline);
    call->cv.wait_until(lock, until);
  }
  const int rc = call->rc;
  lock.unlock();
  // Confirmed on the caller's thread: it may resume holds, whose callbacks must not run on the
  // C client's completion thread.
  if (server_answered(rc)) confirm(sent_at);
  return rc;
}

int Session::create(const std::string& path, const std::string& data, int flags, const CallBound& bound, std::string* created,
                    Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    if (stat) {
      return zoo_acreate2(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), connection_.acl(), flags,
                          string_stat_done, context);
    }
    return zoo_acreate(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), connection_.acl(), flags,
                       string_done, context);
  });
  if (rc == ZOK && created) *created = call->value;
  if (rc == ZOK && stat) *stat = call->stat;
  return rc;
}

int Session::remove(const std::string& path, const CallBound& bound, int version) {
  return run(bound, std::make_shared<CallState>(),
             [&](void* context) { return zoo_adelete(handle_, path.c_str(), version, void_done, context); });
}

int Session::get(const std::string& path, bool watch, const CallBound& bound, std::string* data, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) { return zoo_aget(handle_, path.c_str(), watch ? 1 : 0, data_done, context); });
  if (rc == ZOK) {
    if (data) *data = std::move(call->value);
    if (stat) *stat = call->stat;
  }
  return rc;
}

int Session::exists(const std::string& path, bool watch, const CallBound& bound, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) { return zoo_aexists(handle_, path.c_str(), watch ? 1 : 0, stat_done, context); });
  if (rc == ZOK && stat) *stat = call->stat;
  return rc;
}

int Session::set(const std::string& path, const std::string& data, int version, const CallBound& bound, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    return zoo_aset(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), version, stat_done, context);
  });
  if (rc == ZOK && stat) *stat = call->stat;
  return rc;
}

int Session::children(const std::string& path, bool watch, const CallBound& bound, std::vector<std::string>* names) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    return zoo_aget_children(handle_, path.c_str(), watch ? 1 : 0, strings_done, context);
  });
  if (rc == ZOK) *names = std::move(call->names);
  return rc;
}

int Session::multi(const std::vector<Op>& ops, const CallBound& bound, std::vector<std::string>* created) {
  auto call = std::make_shared<CallState>();
  // The C client serializes the operations' paths and data at once (they may be the caller's),
  // but writes the results and the created paths only on completion: those live in the state.
  call->results.resize(ops.size());
  call->buffers.resize(ops.size());
  std::vector<zoo_op_t> zoo_ops(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    switch (op.kind) {
      case Op::Kind::create:
        call->buffers[i].assign(op.path.size() + 64, '\0');  // room for the sequence suffix
        zoo_create_op_init(&zoo_ops[i], op.path.c_str(), op.data.data(), static_cast<int>(op.data.size()),
                           connection_.acl(), op.flags, call->buffers[i].data(), static_cast<int>(call->buffers[i].size()));
        break;
      case Op::Kind::remove:
        zoo_delete_op_init(&zoo_ops[i], op.path.c_str(), op.version);
        break;
      case Op::Kind::set:
        zoo_set_op_init(&zoo_ops[i], op.path.c_str(), op.data.data(), static_cast<int>(op.data.size()), op.version, nullptr);
        break;
    }
  }
  const int rc = run(bound, call, [&](void* context) {
    return zoo_amulti(handle_, static_cast<int>(zoo_ops.size()), zoo_ops.data(), call->results.data(), void_done, context);
  });
  if (rc == ZOK && created) {
    created->clear();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind != Op::Kind::create) continue;
      const auto& buffer = call->buffers[i];
      created->emplace_back(buffer.data(), strnlen(buffer.data(), buffer.size()));
    }
  }
  return rc;
}

int Session::sync(const std::string& path, const CallBound& bound) {
  return run(bound, std::make_shared<CallState>(),
             [&](void* context) { return zoo_async(handle_, path.c_str(), string_done, context); });
}

Connection::Connection(Settings settings) : settings_(std::move(settings)) {
  // The C client logs connection trouble to stderr; a library stays quiet unless asked.
  zoo_set_debug_level(std::getenv("TURNSTILE_ZK_LOG") ? ZOO_LOG_LEVEL_INFO : static_cast<ZooLogLevel>(0));
  auto first = open_session();
  {
    std::unique_lock lock(mutex_);
    adopt_locked(first);
    const auto wait = settings_.connect_timeout.count() > 0
                          ? settings_.connect_timeout
                          : std::max(kMinCallWait, std::min(settings_.session_timeout, kMaxConnectWait));
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
  zoo_set_servers_resolution_delay(handle, static_cast<int>(kResolutionDelay.count()));
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
  for (auto* waiter : all_waiters_) {
    waiter->woken = true;
    waiter->cv.notify_one();
  }
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
    if (state == ZOO_CONNECTED_STATE) {
      // Connected again, same session: the C client sets its watches again itself, but a watch
      // whose setting failed with the old connection is not among them. Set all of them again.
      for (auto& [node, held] : held_) {
        if (held.handle == handle) held.watch = true;
      }
    }
    session_event_ = true;  // the keeper tells the holds at once
    wake_all_locked();
    return;
  }
  if (!path) return;
  if (const auto it = waiters_.find(path); it != waiters_.end()) {
    for (auto* waiter : it->second) {
      waiter->woken = true;
      waiter->cv.notify_one();
    }
  }
  if (const auto it = held_.find(path); it != held_.end() && it->second.handle == handle) {
    // Deleted: the hold is gone on the server. Anything else (a downgrade's new data) used the
    // watch up: set it again. The keeper does both (holds' callbacks must not run here).
    (type == ZOO_DELETED_EVENT ? it->second.gone : it->second.watch) = true;
    session_event_ = true;
    cv_.notify_all();
  }
}

void Connection::watch_held(const Session& session, const std::vector<std::string>& paths,
                            std::shared_ptr<LossSignal> loss) {
  {
    std::lock_guard lock(mutex_);
    for (const auto& path : paths) held_.insert_or_assign(path, HeldNode{session.handle(), loss});
    session_event_ = true;  // the keeper sets the watches now
  }
  cv_.notify_all();
}

void Connection::unwatch_held(const std::vector<std::string>& paths) {
  std::lock_guard lock(mutex_);
  for (const auto& path : paths) held_.erase(path);
}

void Connection::held_node_answered(const Session& session, const std::string& path, int rc) {
  {
    std::lock_guard lock(mutex_);
    const auto it = held_.find(path);
    if (it == held_.end() || it->second.handle != session.handle()) return;
    if (rc == ZNONODE) {
      it->second.gone = true;  // deleted before the watch was set (the node was ours: only a deletion)
      session_event_ = true;
    } else if (connection_trouble(rc)) {
      // Set again once connected (a reconnect marks every watch anyway); not at once: the
      // keeper's next round, so a refusal that repeats never spins.
      it->second.watch = true;
      return;
    } else {
      return;  // set (ZOK), or the session is gone (its lease tells the holds)
    }
  }
  cv_.notify_all();
}

void Connection::take_held_work_locked(const Session& session, bool connected, std::vector<std::string>& to_watch,
                                       std::vector<std::pair<std::string, std::shared_ptr<LossSignal>>>& deleted) {
  for (auto it = held_.begin(); it != held_.end();) {
    auto& held = it->second;
    if (held.handle != session.handle()) {
      ++it;  // an earlier session's: its lease loses it
      continue;
    }
    if (held.gone) {
      deleted.emplace_back(it->first, std::move(held.loss));
      it = held_.erase(it);
      continue;
    }
    if (held.watch && connected) {
      held.watch = false;
      to_watch.push_back(it->first);
    }
    ++it;
  }
}

std::shared_ptr<Session> Connection::session(Deadline deadline, const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  // Waiting for a reconnect is bounded even without a deadline: the caller reports trouble.
  auto until = SteadyClock::now() + std::max(settings_.session_timeout, kMinCallWait);
  if (deadline) until = std::min(until, std::max(*deadline, SteadyClock::now() + kMinSessionWait));
  cv_.wait_until(lock, stop, until, [&] { return session_ && session_->connected() && !session_->expired(); });
  if (stop.stop_requested()) throw CallStopped{};
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
    waiter.cv.notify_one();
  });
  // On the waiter's own condition variable: the connection's (pings, keeper work) would run
  // every sleeping waiter thread of the client again at each of its events.
  std::unique_lock lock(mutex_);
  if (deadline) {
    const bool woken = waiter.cv.wait_until(lock, *deadline, [&] { return waiter.woken; });
    waiter.woken = false;
    return (woken || SteadyClock::now() < *deadline) && !stop.stop_requested();
  }
  waiter.cv.wait(lock, [&] { return waiter.woken; });
  waiter.woken = false;
  return !stop.stop_requested();
}

PathWatch::PathWatch(Connection& connection, std::string path) : connection_(connection), path_(std::move(path)) {
  connection_.watch(path_, &waiter_);
}

PathWatch::~PathWatch() { connection_.unwatch(path_, &waiter_); }

bool PathWatch::sleep(Deadline deadline, const std::stop_token& stop) { return connection_.sleep(waiter_, deadline, stop); }

bool Connection::wait_connected(const Session& session, const CallBound& bound) {
  std::unique_lock lock(mutex_);
  const auto ready = [&] { return session.connected() || session.expired(); };
  if (!bound.deadline) return cv_.wait(lock, bound.stop, ready);
  return cv_.wait_until(lock, bound.stop, *bound.deadline, ready);
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
  // Bounded: on a silent link the C client completes a call only when it declares the
  // connection lost; the next attempt, after the link heals, may find it out sooner (a reply
  // out of order makes the C client reconnect at once).
  const Deadline bound = SteadyClock::now() + session->short_wait();
  const auto done = [](int rc) { return !connection_trouble(rc); };  // removed, gone, or not ours to remove
  if (!orphan.path.empty()) return done(session->remove(orphan.path, bound));
  std::vector<std::string> mine;
  const int rc = own_children(*session, orphan.parent, orphan.uuid, bound, &mine);
  if (rc != ZOK) return done(rc);
  for (const auto& child : mine) {
    if (!done(session->remove(orphan.parent + "/" + child, bound))) return false;
  }
  return true;
}

int own_children(Session& session, const std::string& parent, const std::string& uuid, const CallBound& bound,
                 std::vector<std::string>* names) {
  names->clear();
  // sync first: after a reconnect to a lagging ensemble member, a plain read could miss a node
  // the leader made (and the caller would make a second one, or leave it behind).
  int rc = session.sync(parent, bound);
  std::vector<std::string> children;
  if (rc == ZOK) rc = session.children(parent, false, bound, &children);
  if (rc == ZNONODE) return ZOK;
  if (rc != ZOK) return rc;
  for (const auto& child : children) {
    if (child.find(uuid) == std::string::npos) continue;
    // Ours only if this very session owns it (a node of an earlier session is not, CURATOR-604).
    Stat stat{};
    rc = session.exists(parent + "/" + child, false, bound, &stat);
    if (rc == ZOK && stat.ephemeralOwner == session.id()) names->push_back(child);
    else if (rc != ZNONODE) return rc;
  }
  return ZOK;
}

// The janitor: removes orphans whenever the session is connected, retrying every 200 ms.
// Its calls block this thread only: the keeper's pings and the loss clock never wait for it.
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
    if (!orphans_.empty()) cv_.wait_for(lock, stop, kJanitorRetry, [] { return false; });
  }
}

namespace {
void ping_done(int rc, const Stat*, const void* data) {
  // The session is alive: completions never run once ~Session closed the handle.
  if (const auto ping = in_flight().claim(data)) ping->session->ping_answered(rc, ping->sent_at);
}

void held_node_watched(int rc, const Stat*, const void* data) {
  if (const auto call = in_flight().claim(data)) {
    if (server_answered(rc)) call->session->heard_from_server();
    call->session->held_node_answered(call->value, rc);
  }
}
}  // namespace

void Session::watch_held_node(const std::string& path) {
  auto call = std::make_shared<CallState>();
  call->session = this;
  call->value = path;
  void* context = in_flight().add(std::move(call));
  // watch=1: the watcher of the handle, Connection::on_event, hears of the node's next change.
  const int rc = zoo_aexists(handle_, path.c_str(), 1, held_node_watched, context);
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  if (rc != ZOK) held_node_answered(path, ZCONNECTIONLOSS);  // tried again later
}

void Session::held_node_answered(const std::string& path, int rc) { connection_.held_node_answered(*this, path, rc); }

bool Session::start_ping() {
  // A few at most: the C client fails them all when it declares the connection lost.
  constexpr int kMaxPingsInFlight = 8;
  if (pings_in_flight_.load() >= kMaxPingsInFlight) return false;
  auto ping = std::make_shared<CallState>();
  ping->session = this;
  ping->sent_at = SteadyClock::now();
  ++pings_in_flight_;
  void* context = in_flight().add(std::move(ping));
  const int rc = zoo_aexists(handle_, "/", 0, ping_done, context);
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  if (rc != ZOK) --pings_in_flight_;
  return rc == ZOK;
}

void Session::ping_answered(int rc, SteadyClock::time_point sent_at) {
  // On the C client's completion thread: holds' callbacks (which may call the C client and
  // wait for its completion thread) must not run here. The keeper confirms it.
  if (server_answered(rc)) {
    heard_from_server();
    auto current = ping_confirmed_.load();
    while (current < sent_at && !ping_confirmed_.compare_exchange_weak(current, sent_at)) {
    }
  }
  --pings_in_flight_;
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
    const auto period = std::clamp(session->timeout() / 3, kPingPeriodMin, kPingPeriodMax);
    const auto wake = session->connected() ? last_ping + period : SteadyClock::now() + period;
    cv_.wait_until(lock, stop, wake, [&] { return session_event_; });
    session_event_ = false;
    if (stop.stop_requested()) break;
    session = session_;
    const bool expired = session->expired();
    const bool connected = session->connected();
    const auto pinged = session->ping_confirmed_.exchange(SteadyClock::time_point{});
    std::vector<std::string> to_watch;
    std::vector<std::pair<std::string, std::shared_ptr<LossSignal>>> deleted;
    take_held_work_locked(*session, connected && !expired, to_watch, deleted);
    lock.unlock();
    // Only the hold whose node went is lost: the session, and its other holds, live on. The
    // server may already have admitted someone else: told at once.
    for (auto& [path, loss] : deleted) {
      loss->lose("its node " + path + " was deleted on the ZooKeeper server by someone else (by hand or by a peer)");
    }
    for (const auto& path : to_watch) session->watch_held_node(path);
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
      session->start_ping();  // another one a period later, answered or not
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
