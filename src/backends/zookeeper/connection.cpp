// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/connection.hpp"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "backends/zookeeper/errors.hpp"
#include "backends/zookeeper/timeouts.hpp"
#include "core/refusal_probe.hpp"

namespace turnstile::detail::zookeeper {

Connection::Connection(Settings settings) : settings_(std::move(settings)) {
  // The C client logs connection trouble to stderr; a library stays quiet unless asked.
  zoo_set_debug_level(std::getenv("TURNSTILE_ZK_LOG") ? ZOO_LOG_LEVEL_INFO : static_cast<ZooLogLevel>(0));
  const auto wait = settings_.connect_timeout.count() > 0
                        ? settings_.connect_timeout
                        : std::max(kZookeeperTimes.call.cap, std::min(settings_.session_timeout, kMaxConnectWait));
  const auto connect_by = SteadyClock::now() + wait;
  auto first = open_session();
  {
    std::unique_lock lock(mutex_);
    adopt_locked(first);
    const auto answered = [&] { return first->connected() || first->expired(); };
    // Not connected at once: a refusal by every server is a definite answer, which the C
    // client, reconnecting until we give up, would never give us.
    if (!cv_.wait_until(lock, std::min(connect_by, SteadyClock::now() + kRefusalProbeAfter), answered)) {
      lock.unlock();
      const bool refused = every_server_refuses(split_server_list(settings_.hosts),
                                                std::min(connect_by, SteadyClock::now() + kRefusalProbeBound));
      lock.lock();
      if (refused && !answered()) {
        session_.reset();
        lock.unlock();
        throw BackendUnavailable("every ZooKeeper server refused the connection (connection refused) at " +
                                 settings_.description);
      }
    }
    cv_.wait_until(lock, connect_by, answered);
    if (!first->connected()) {
      session_.reset();
      lock.unlock();
      throw BackendUnavailable("no ZooKeeper server answered at " + settings_.description + " within " +
                               std::to_string(wait.count()) + " ms (the connect timed out)");
    }
  }
  keeper_ = std::jthread([this](std::stop_token stop) { keeper_loop(stop); });
}

Connection::~Connection() {
  keeper_.request_stop();
  cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  std::shared_ptr<Session> last;
  std::vector<std::pair<std::function<void(int rc)>, int>> answered;
  {
    std::lock_guard lock(mutex_);
    last = std::move(session_);
    answered.swap(answered_);
    // Unanswered at the end (the core waited for them, bounded): outcome unknown; the session's
    // close below takes the node with it.
    for (auto& [id, finish] : pipelined_) answered.emplace_back(std::move(finish), ZCONNECTIONLOSS);
    pipelined_.clear();
  }
  finish_answered(std::move(answered));  // before the close: they hold the session
  last.reset();                          // closes the session now: its ephemeral nodes go at once, not after a timeout
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

void Connection::wake_all_locked(int state) {
  // Armed wakes (see the header): a session's end runs them all, a reconnect those whose watch
  // was never confirmed, a lost connection none.
  const bool ended = state == ZOO_EXPIRED_SESSION_STATE || state == ZOO_AUTH_FAILED_STATE;
  for (auto* waiter : all_waiters_) {
    if (!waiter->wake) {
      waiter->woken = true;
      waiter->cv.notify_one();
    } else if (ended || (state == ZOO_CONNECTED_STATE && !waiter->wake->watch_set)) {
      due_wakes_.push_back(waiter->wake);
    }
  }
  if (!due_wakes_.empty()) session_event_ = true;  // the keeper runs them
  cv_.notify_all();
}

void Connection::notify_locked(Waiter& waiter, std::vector<std::shared_ptr<WakeSlot>>& due) {
  waiter.woken = true;
  if (waiter.wake) {
    due.push_back(waiter.wake);
  } else {
    waiter.cv.notify_one();
  }
}

void Connection::fire_all(const std::vector<std::shared_ptr<WakeSlot>>& due) {
  for (const auto& wake : due) wake->fire();
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
  std::vector<std::shared_ptr<WakeSlot>> due;
  {
    std::lock_guard lock(mutex_);
    handle_event_locked(handle, type, state, path, due);
  }
  // Outside our mutex: an arm being destroyed takes it, after waiting for its running wake.
  fire_all(due);
}

void Connection::handle_event_locked(zhandle_t* handle, int type, int state, const char* path,
                                     std::vector<std::shared_ptr<WakeSlot>>& due) {
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
    wake_all_locked(state);
    return;
  }
  if (!path) return;
  if (const auto it = waiters_.find(path); it != waiters_.end()) {
    for (auto* waiter : it->second) notify_locked(*waiter, due);
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

std::uint64_t Connection::add_pipelined(std::function<void(int rc)> finish) {
  std::lock_guard lock(mutex_);
  const auto id = next_pipelined_++;
  pipelined_.emplace(id, std::move(finish));
  return id;
}

void Connection::pipelined_answered(std::uint64_t id, int rc) {
  {
    std::lock_guard lock(mutex_);
    const auto it = pipelined_.find(id);
    if (it == pipelined_.end()) return;
    answered_.emplace_back(std::move(it->second), rc);
    pipelined_.erase(it);
    session_event_ = true;
  }
  cv_.notify_all();
}

std::function<void(int rc)> Connection::take_pipelined(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  const auto it = pipelined_.find(id);
  if (it == pipelined_.end()) return {};
  auto finish = std::move(it->second);
  pipelined_.erase(it);
  return finish;
}

void Connection::finish_answered(std::vector<std::pair<std::function<void(int rc)>, int>> answered) {
  for (auto& [finish, rc] : answered) finish(rc);
  // Their closures (and the holds they own) end here too, still without the mutex.
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

std::shared_ptr<Session> Connection::session(const CallBudget& caller) {
  // Waiting for a reconnect is bounded even without a deadline (the caller reports trouble), by
  // a session timeout when that is longer than the cap; a passed deadline still gets one try.
  auto limits = kZookeeperTimes.one_shot;
  limits.cap = std::max(limits.cap, settings_.session_timeout);
  std::unique_lock lock(mutex_);
  cv_.wait_until(lock, caller.stop(), caller.call_end(limits),
                 [&] { return session_ && session_->connected() && !session_->expired(); });
  if (caller.stopped()) throw CallStopped{};
  if (!session_ || session_->expired())
    throw BackendUnavailable("the ZooKeeper session at " + settings_.description + " is being replaced");
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

bool Connection::sleep(Waiter& waiter, const CallBudget& caller) {
  const auto& deadline = caller.deadline();
  const auto& stop = caller.stop();
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
    return (woken || !passed(deadline)) && !stop.stop_requested();
  }
  waiter.cv.wait(lock, [&] { return waiter.woken; });
  waiter.woken = false;
  return !stop.stop_requested();
}

void Connection::arm(Waiter& waiter, std::shared_ptr<WakeSlot> wake) {
  bool woken = false;
  {
    std::lock_guard lock(mutex_);
    waiter.wake = wake;
    woken = waiter.woken;
  }
  if (woken) wake_soon(std::move(wake));
}

void Connection::wake_soon(std::shared_ptr<WakeSlot> wake) {
  {
    std::lock_guard lock(mutex_);
    due_wakes_.push_back(std::move(wake));
    session_event_ = true;
  }
  cv_.notify_all();
}

void WakeSlot::fire() {
  std::lock_guard lock(mutex_);
  if (!wake_) return;
  const auto wake = std::exchange(wake_, Wake{});  // at most once
  wake();
}

void WakeSlot::disarm() {
  Wake dropped;
  {
    std::lock_guard lock(mutex_);  // waits for a running wake
    dropped = std::exchange(wake_, Wake{});
  }
  // Its captures end here, outside the lock.
}

ArmedWatch::ArmedWatch(Connection& connection, std::unique_ptr<PathWatch> watch, Wake wake, bool watch_set)
    : watch_(std::move(watch)), slot_(std::make_shared<WakeSlot>(std::move(wake), watch_set)) {
  if (watch_) {
    watch_->arm(slot_);
  } else {
    connection.wake_soon(slot_);
  }
}

void PathWatch::arm(std::shared_ptr<WakeSlot> wake) { connection_.arm(waiter_, std::move(wake)); }

PathWatch::PathWatch(Connection& connection, std::string path) : connection_(connection), path_(std::move(path)) {
  connection_.watch(path_, &waiter_);
}

PathWatch::~PathWatch() { connection_.unwatch(path_, &waiter_); }

bool PathWatch::sleep(const CallBudget& caller) { return connection_.sleep(waiter_, caller); }

bool Connection::wait_connected(const Session& session, const CallBudget& bound) {
  std::unique_lock lock(mutex_);
  const auto ready = [&] { return session.connected() || session.expired(); };
  if (!bound.deadline()) return cv_.wait(lock, bound.stop(), ready);
  return cv_.wait_until(lock, bound.stop(), *bound.deadline(), ready);
}

// The keeper: replaces an expired session, pings the live one every third of its granted
// timeout (at most every second, and at once after a reconnect), and tells the session's
// lease what it learnt: unconfirmed while the connection is down (the C client's CONNECTING:
// the session may still be alive, Curator's SUSPENDED), confirmed by each answered ping, lost
// when the session expired. Loss for want of answers is the LossClock's: nothing here can
// delay it.
// Tells the session's lease what the keeper learnt (this runs holds' callbacks, which may release
// holds: never under our lock), and the client's BackendReports (if any): a connection made (the
// first one, or again after one was lost or a session expired), pings answered and failed.
void Connection::tell_session(Session& session, bool expired, bool connected, SteadyClock::time_point pinged) {
  if (expired) {
    session.lease()->lose("its ZooKeeper session expired", LossCause::session_expired);
  } else if (!connected) {
    session.lease()->unconfirmed("the connection to ZooKeeper was lost; its session may still be alive",
                                 SuspendCause::connection_lost);
  } else if (pinged != SteadyClock::time_point{}) {
    session.confirm(pinged);
  }
  auto* reports = settings_.reports;
  if (!reports) return;
  const bool up = connected && !expired;
  if (up && !reported_up_) reports->connected(std::exchange(ever_up_, true));
  reported_up_ = up;
  if (pinged != SteadyClock::time_point{}) {
    reports->renewed(std::chrono::nanoseconds(session.ping_round_trip_ns_.load()));
  }
  if (session.ping_failed_.exchange(false)) reports->renewal_failed("a ZooKeeper ping got no answer");
}

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
    auto answered = std::exchange(answered_, {});
    const auto due = std::exchange(due_wakes_, {});
    lock.unlock();
    fire_all(due);
    finish_answered(std::move(answered));
    // Only the hold whose node went is lost: the session, and its other holds, live on. The
    // server may already have admitted someone else: told at once.
    for (auto& [path, loss] : deleted) {
      loss->lose("its node " + path + " was deleted on the ZooKeeper server by someone else (by hand or by a peer)",
                 LossCause::entry_gone);
    }
    for (const auto& path : to_watch) session->watch_held_node(path);
    tell_session(*session, expired, connected, pinged);  // not under our lock
    if (expired) {
      // A new session: its ephemeral nodes start afresh; waiters wake and join again.
      std::shared_ptr<Session> fresh;
      try {
        fresh = open_session();
      } catch (const Error&) {
      }
      lock.lock();
      if (fresh) adopt_locked(fresh);  // the old one closes when its last user lets go
      wake_all_locked(ZOO_EXPIRED_SESSION_STATE);
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
