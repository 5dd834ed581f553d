// SPDX-License-Identifier: Apache-2.0
// The connection of one turnstile client: its current Session (replaced when the server expires
// it), the keeper that tells the holds what the session's state means for them, the watches.
//
// Loss: every session has a ServerLease of the core's LossClock, with the timeout the server
// GRANTED (zoo_recv_timeout) as its TTL. Every reply confirms the send time of its request
// (the server's expiry counts from when it last heard from us, which is later); the keeper
// suspends the holds while the C client is CONNECTING, loses them on SESSION_EXPIRED, and the
// clock's thread reports them lost at the deadline whatever the network does.
//
// Watches all go to one watcher function, which wakes the Waiters registered on the event's
// path (a waiter registers before the call that sets the watch, so no event is missed), and
// every waiter on any session event: the one dispatcher never outlives the Connection.
//
// A waiter is a sleeping thread (the blocking wait) or an armed wake (QueuePlace::arm: an async
// acquire waits without a thread). An armed wake runs on the thread that heard the event: the C
// client's event thread for a watch, the keeper for a session's end; it only posts the
// acquire's next look. A lost connection does not run it: the C client sets its watches again
// on the next connection (SetWatches, from the last zxid it saw), and the server fires those
// whose node changed meanwhile; the session's expiry runs every armed wake (its entries went
// with it), a reconnect those whose watch was never confirmed.
#pragma once

#include <zookeeper/zookeeper.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/zookeeper/session.hpp"
#include "backends/zookeeper/settings.hpp"
#include "core/loss_clock.hpp"
#include "core/queue_store.hpp"

namespace turnstile::detail::zookeeper {

// An async acquire's wake-up (QueuePlace::arm), shared by its arm and whoever may run it.
class WakeSlot {
 public:
  WakeSlot(Wake wake, bool confirmed) : watch_set(confirmed), wake_(std::move(wake)) {}
  // Runs the wake unless it ran or was disarmed. Never blocks but on a disarm under way.
  void fire();
  // Once it returns, the wake is neither running nor will it run.
  void disarm();
  // The server's watch is known to be set (a reconnect need not run the wake).
  std::atomic<bool> watch_set;

 private:
  std::mutex mutex_;  // held while the wake runs, so that disarm() waits for it
  Wake wake_;
};

// A thread sleeping until a watched path changes or the session's state does, or a wake armed
// for the same events.
struct Waiter {
  bool woken = false;                // guarded by the connection's mutex
  std::condition_variable cv;        // its own: an event wakes only the threads it concerns
  std::shared_ptr<WakeSlot> wake{};  // armed: run instead (guarded by the connection's mutex)
};

// A Waiter registered for events on one path while it lives: registered before the call that
// sets the ZooKeeper watch, so no event between the two is missed.
class PathWatch {
 public:
  PathWatch(Connection& connection, std::string path);
  ~PathWatch();
  PathWatch(const PathWatch&) = delete;
  PathWatch& operator=(const PathWatch&) = delete;
  // Until an event on the path or the session, the deadline or a stop; false on the last two.
  bool sleep(const CallBudget& caller);
  // From now on the path's events run `wake` instead; one that came since the watch was
  // registered runs it at once, on the keeper's thread.
  void arm(std::shared_ptr<WakeSlot> wake);

 private:
  Connection& connection_;
  std::string path_;
  Waiter waiter_;
};

// A wake armed on a path's watch (QueuePlace::arm, CounterLine::arm). Destroying it disarms
// the wake, then forgets the watch.
class ArmedWatch final : public WakeArm {
 public:
  // No watch: nothing to wait for, the wake runs at once on the keeper's thread. `watch_set`:
  // the server's watch is set already (by the look that registered `watch`).
  ArmedWatch(Connection& connection, std::unique_ptr<PathWatch> watch, Wake wake, bool watch_set = true);
  ~ArmedWatch() override { slot_->disarm(); }
  const std::shared_ptr<WakeSlot>& slot() const { return slot_; }

 private:
  std::unique_ptr<PathWatch> watch_;
  std::shared_ptr<WakeSlot> slot_;
};

class Connection {
 public:
  // Connects; throws BackendUnavailable when no server answers in time.
  explicit Connection(Settings settings);
  ~Connection();

  const Settings& settings() const { return settings_; }
  // The ACL of every node we create: the creator's digest identity when credentials were
  // given, else open.
  const ACL_vector* acl() const { return settings_.user.empty() ? &ZOO_OPEN_ACL_UNSAFE : &ZOO_CREATOR_ALL_ACL; }
  // The live session, waiting (until the deadline) while a new one is being opened.
  // Throws BackendUnavailable, CallStopped when `stop` ends the wait.
  std::shared_ptr<Session> session(const CallBudget& caller);

  // Registers `waiter` for events on `path` (and on every session event) until unwatch().
  void watch(const std::string& path, Waiter* waiter);
  void unwatch(const std::string& path, Waiter* waiter);
  // Sleeps until the waiter is woken, the deadline passes or `stop` is requested. Returns
  // false on the deadline or the stop.
  bool sleep(Waiter& waiter, const CallBudget& caller);
  // Makes `waiter` run `wake` on its events (see PathWatch::arm).
  void arm(Waiter& waiter, std::shared_ptr<WakeSlot> wake);
  // Runs `wake` soon on the keeper's thread (an armed wake never runs inside arm()).
  void wake_soon(std::shared_ptr<WakeSlot> wake);

  // Waits (until the deadline) while `session`'s connection is down: calls made meanwhile
  // would wait in the C client, past any deadline, for the next connection. False when the
  // bound passed (or its stop came) first.
  bool wait_connected(const Session& session, const CallBudget& bound);

  // A hold's own nodes (its entry, or its lease nodes), watched while it lives: a node deleted
  // by anyone but this hold (by hand, by a peer) loses that hold, and only it, at once, although
  // the session lives on. The watch is set again after it fired for another change (a
  // downgrade's new data) and after every reconnect. Never blocks.
  void watch_held(const Session& session, const std::vector<std::string>& paths, std::shared_ptr<LossSignal> loss);
  // Before the hold deletes its nodes itself (release), and when it ends: no loss.
  void unwatch_held(const std::vector<std::string>& paths);

  // The answers of Session::remove_pipelined: `finish` is registered under an id until its
  // answer comes, then run by the keeper (never on the C client's completion thread). What is
  // still unanswered when the connection ends is finished with ZCONNECTIONLOSS.
  std::uint64_t add_pipelined(std::function<void(int rc)> finish);
  // Noted for the keeper; an id already taken is ignored. Any thread; never blocks.
  void pipelined_answered(std::uint64_t id, int rc);
  // Takes an unanswered `finish` back (empty when it was answered already).
  std::function<void(int rc)> take_pipelined(std::uint64_t id);

 private:
  friend class Session;
  static void on_event(zhandle_t* handle, int type, int state, const char* path, void* context);
  void handle_event(zhandle_t* handle, int type, int state, const char* path);
  void handle_event_locked(zhandle_t* handle, int type, int state, const char* path,
                           std::vector<std::shared_ptr<WakeSlot>>& due);
  std::shared_ptr<Session> open_session();
  // Makes `session` the current one, applying a state event that arrived for its handle
  // before it was current. With mutex_ held.
  void adopt_locked(std::shared_ptr<Session> session);
  static void apply_state(Session& session, int state);
  void keeper_loop(std::stop_token stop);
  void tell_session(Session& session, bool expired, bool connected, SteadyClock::time_point pinged);
  bool reported_up_ = false;  // the keeper's: the connection as last reported, and whether it ever was
  bool ever_up_ = false;
  // Wakes the sleeping waiters and hands the armed wakes that `state` concerns to the keeper.
  void wake_all_locked(int state);
  // An event on a waiter's path: wakes it, or adds its armed wake to `due`.
  static void notify_locked(Waiter& waiter, std::vector<std::shared_ptr<WakeSlot>>& due);
  static void fire_all(const std::vector<std::shared_ptr<WakeSlot>>& due);
  // For Session::watch_held_node's completion: the watch is set (ZOK), the node is gone
  // (ZNONODE), or it must be set again.
  void held_node_answered(const Session& session, const std::string& path, int rc);
  // The keeper's share of the held nodes: the watches to set (connected only) and the holds
  // whose node went. With mutex_ held.
  void take_held_work_locked(const Session& session, bool connected, std::vector<std::string>& to_watch,
                             std::vector<std::pair<std::string, std::shared_ptr<LossSignal>>>& deleted);

  Settings settings_;
  LossClock clock_;  // outlives every session (their leases refer to it)

  mutable std::mutex mutex_;  // the session pointer, the waiters, the tracked holds
  std::condition_variable_any cv_;
  std::shared_ptr<Session> session_;
  // The client may connect before open_session() returns: the event is kept until adopted.
  std::map<zhandle_t*, int> early_states_;
  std::map<std::string, std::set<Waiter*>> waiters_;
  std::set<Waiter*> all_waiters_;
  bool session_event_ = false;  // wakes the keeper
  struct HeldNode {
    zhandle_t* handle;  // of the session that made it: events of another handle are not about it
    std::shared_ptr<LossSignal> loss;
    bool watch = true;  // its watch needs setting (again)
    bool gone = false;  // the server said it is gone
  };
  std::map<std::string, HeldNode> held_;  // by path (sequential nodes: one hold each)
  std::uint64_t next_pipelined_ = 1;
  std::map<std::uint64_t, std::function<void(int rc)>> pipelined_;     // sent, unanswered
  std::vector<std::pair<std::function<void(int rc)>, int>> answered_;  // for the keeper to run
  std::vector<std::shared_ptr<WakeSlot>> due_wakes_;                   // for the keeper to run
  // Runs the answered pipelined calls' `finish` (without mutex_: they run holds' callbacks).
  static void finish_answered(std::vector<std::pair<std::function<void(int rc)>, int>> answered);

  std::jthread keeper_;  // last: stopped and joined first
};

}  // namespace turnstile::detail::zookeeper
