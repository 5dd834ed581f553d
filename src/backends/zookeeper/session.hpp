// One ZooKeeper connection per turnstile client, through the C client's multithreaded API.
//
// A Session is one zhandle_t, i.e. one ZooKeeper session: its ephemeral nodes live exactly as
// long as it. When the server expires it, the Connection opens a new one; holds made on the
// old one are reported lost. Calls use the C client's asynchronous API (it pipelines concurrent
// calls on its one socket) and wait for the completion on the caller's thread, at most until
// the caller's bound: a request already sent when the link goes silent (no reset) is completed
// by the C client only when it declares the connection lost, two thirds of the granted timeout
// later. A call given up at its bound returns ZOPERATIONTIMEOUT (outcome unknown, like a
// connection loss); its completion state is shared with the C client's completion, so a late
// reply writes into memory that is still alive.
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
#pragma once

#include <zookeeper/zookeeper.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

struct Settings {
  std::string hosts;          // "host:port,host:port" as the C client takes it
  std::string root;           // the URL's chroot, "" or "/something" (no trailing '/')
  std::string user;           // digest credentials, optional
  std::string password;
  milliseconds session_timeout{30'000};  // asked for; the server may grant another
  std::string description;    // for messages
  std::string holder_label;   // ClientOptions::holder_label, kept in our nodes' data
  milliseconds connect_timeout{0};  // ClientOptions::connect_timeout; 0: see kMaxConnectWait
};

Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

// The backend's fixed waits, all in one place.
// A housekeeping call (release, downgrade, removals, the janitor's, a try-once acquire's) waits
// a third of the granted timeout for its reply, within these: long enough for a busy server,
// short enough that an unlock never hangs on a silent link.
inline constexpr milliseconds kShortWaitMin{500};
inline constexpr milliseconds kShortWaitMax{2000};
// Calls without a deadline of their own (counters, inspect, the first connection, waiting for a
// new session) wait a session timeout, and at least this: a reconnect takes the C client seconds.
inline constexpr milliseconds kMinCallWait{5000};
// The first connection waits at most this (unless the session timeout is shorter).
inline constexpr milliseconds kMaxConnectWait{15000};
// A caller whose deadline has passed still waits this long for a new session, for its one try.
inline constexpr milliseconds kMinSessionWait{1000};
// Between attempts after connection trouble: no busy loop while the link is down.
inline constexpr milliseconds kRetryPause{50};
// A call waiting for its reply looks this often whether its session expired meanwhile.
inline constexpr milliseconds kExpiryPoll{250};
// The keeper pings every third of the granted timeout, within these.
inline constexpr milliseconds kPingPeriodMin{50};
inline constexpr milliseconds kPingPeriodMax{1000};
// The janitor tries again this often to remove orphans it could not remove.
inline constexpr milliseconds kJanitorRetry{200};
// The C client resolves the host list at most this often (see Connection::open_session).
inline constexpr milliseconds kResolutionDelay{60'000};

// The most node data we read: turnstile's entries carry a short line; larger data (a hostile
// server or peer) reads as empty, i.e. a foreign node.
inline constexpr std::size_t kMaxNodeData = 64 * 1024;

// True when `rc` came from the server (so the server heard us), false for connection trouble.
bool server_answered(int rc);
// Connection trouble that a later attempt may not have: the outcome of the call is unknown.
bool connection_trouble(int rc);
// The session is gone (expired or closed): its ephemeral nodes are gone or going.
bool session_gone(int rc);

// How long a call waits for its answer: until `deadline` (none: until the C client completes it)
// or until `stop` is requested, whichever comes first.
struct CallBound {
  Deadline deadline;
  std::stop_token stop;
  template <class T>
    requires std::constructible_from<Deadline, T>
  CallBound(T&& deadline) : deadline(std::forward<T>(deadline)) {}  // NOLINT: a deadline alone is a bound
  CallBound(Deadline deadline, std::stop_token stop) : deadline(deadline), stop(std::move(stop)) {}
  bool stopped() const { return stop.stop_requested(); }
  bool passed() const { return stopped() || (deadline && SteadyClock::now() >= *deadline); }
};

// Thrown by a wait on the connection that its bound's stop ended (the caller gave up; it never
// leaves the backend).
struct CallStopped {};

class Connection;
// One call's completion state (session.cpp).
struct CallState;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Connection& connection, zhandle_t* handle, std::shared_ptr<ServerLease> lease)
      : connection_(connection), handle_(handle), lease_(std::move(lease)) {}
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  zhandle_t* handle() const { return handle_; }
  // The server's id of the session: the ephemeralOwner of the nodes it creates.
  std::int64_t id() const { return zoo_client_id(handle_)->client_id; }
  // The timeout the server granted (known once connected).
  milliseconds timeout() const { return milliseconds(zoo_recv_timeout(handle_)); }
  // The C client's own state too: it fails pending calls before our watcher hears of it.
  bool connected() const { return connected_.load() && zoo_state(handle_) == ZOO_CONNECTED_STATE; }
  bool expired() const { return expired_.load(); }
  // The send time of the latest request the server answered: the server cannot expire the
  // session before that plus the timeout.
  SteadyClock::time_point confirmed_at() const { return confirmed_at_.load(); }
  void confirm(SteadyClock::time_point sent_at);
  // The lease the session's holds ride on (replaced by the keeper when it was reported lost
  // while the session lived on: new holds need a lease that is not lost).
  std::shared_ptr<ServerLease> lease() const;
  // The keeper's ping (a few may be in flight: one left unanswered on a silent link must not
  // stop the next, whose reply after the link heals lets the C client notice a stream that
  // lost replies). Its answer is noted here (the C client's completion thread must not run
  // holds' callbacks) and applied by the keeper.
  bool start_ping();
  void ping_answered(int rc, SteadyClock::time_point sent_at);

  // How long housekeeping calls (release, downgrade, removals, the janitor) and the calls of a
  // try-once acquire wait for their reply: a third of the granted timeout, within 0.5-2 s.
  milliseconds short_wait() const;
  // True while a call of ours was given up unanswered and nothing was answered since: the
  // link is probably silent, so clean-up is left to the janitor rather than waited for.
  bool silent() const { return silent_.load(); }

  // The calls; each returns the C client's code and notes the server's answer. Each waits for
  // its reply until `bound` passes (or its stop is requested) and returns ZOPERATIONTIMEOUT
  // then: the call may still be applied.
  // With `stat`, the created node's Stat too (create2, ZooKeeper 3.5+; an older server answers
  // ZUNIMPLEMENTED).
  int create(const std::string& path, const std::string& data, int flags, const CallBound& bound,
             std::string* created = nullptr, Stat* stat = nullptr);
  int remove(const std::string& path, const CallBound& bound, int version = -1);
  int get(const std::string& path, bool watch, const CallBound& bound, std::string* data, Stat* stat = nullptr);
  int exists(const std::string& path, bool watch, const CallBound& bound, Stat* stat = nullptr);
  int set(const std::string& path, const std::string& data, int version, const CallBound& bound, Stat* stat = nullptr);
  int children(const std::string& path, bool watch, const CallBound& bound, std::vector<std::string>* names);
  // One operation of a transaction.
  struct Op {
    enum class Kind { create, remove, set } kind;
    std::string path;
    std::string data;  // create, set
    int flags = 0;     // create
    int version = -1;  // remove, set
    static Op create(std::string path, std::string data, int flags) { return {Kind::create, std::move(path), std::move(data), flags, -1}; }
    static Op remove(std::string path) { return {Kind::remove, std::move(path), {}, 0, -1}; }
    static Op set(std::string path, std::string data, int version) { return {Kind::set, std::move(path), std::move(data), 0, version}; }
  };
  // A transaction; `created` receives the paths the creates made, in order.
  int multi(const std::vector<Op>& ops, const CallBound& bound, std::vector<std::string>* created = nullptr);
  // Brings the server we talk to up to date with the leader for `path` (zoo_async), so the
  // read after it sees every write applied before: the read that decides "did my write
  // happen?" after a lost reply must not come from a lagging ensemble member.
  int sync(const std::string& path, const CallBound& bound);

  // For the completions (the C client's completion thread): the server answered something.
  void heard_from_server() { silent_ = false; }

  // Sets a watch on a held node (exists, so it is set whether or not the node is there); its
  // answer goes to Connection::held_node_answered. Never waits.
  void watch_held_node(const std::string& path);
  void held_node_answered(const std::string& path, int rc);

  private:
  friend class Connection;
  Connection& connection_;
  zhandle_t* handle_;
  mutable std::mutex lease_mutex_;
  std::shared_ptr<ServerLease> lease_;
  std::atomic<SteadyClock::time_point> ping_confirmed_{SteadyClock::time_point{}};
  std::atomic<bool> connected_{false};
  std::atomic<bool> expired_{false};
  std::atomic<SteadyClock::time_point> confirmed_at_{SteadyClock::time_point{}};
  std::atomic<int> pings_in_flight_{0};
  std::atomic<bool> silent_{false};
  // Runs one asynchronous call (see session.cpp).
  template <class Start>
  int run(const CallBound& bound, const std::shared_ptr<CallState>& call, Start start);
};

// The children of `parent` whose name carries `uuid` (a Curator protection id) and that
// `session` owns, read after a sync, each call waiting until `bound`. ZOK (none when `parent`
// is gone) or the failing code.
int own_children(Session& session, const std::string& parent, const std::string& uuid, const CallBound& bound,
                 std::vector<std::string>* names);

// A thread sleeping until a watched path changes or the session's state does.
struct Waiter {
  bool woken = false;          // guarded by the connection's mutex
  std::condition_variable cv;  // its own: an event wakes only the threads it concerns
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
  bool sleep(Deadline deadline, const std::stop_token& stop);

 private:
  Connection& connection_;
  std::string path_;
  Waiter waiter_;
};

// Nodes of ours whose removal (or whose creation) could not be confirmed: the janitor thread
// removes them once the connection is back, so no entry of ours stays in a queue (where
// everyone, Curator peers included, would wait behind it) until the session ends.
struct Orphan {
  std::weak_ptr<Session> session;  // the nodes die with it
  std::string path;                // a node to delete, or
  std::string parent, uuid;        // every child of `parent` carrying `uuid` that this session owns
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
  std::shared_ptr<Session> session(Deadline deadline, const std::stop_token& stop = {});

  // Registers `waiter` for events on `path` (and on every session event) until unwatch().
  void watch(const std::string& path, Waiter* waiter);
  void unwatch(const std::string& path, Waiter* waiter);
  // Sleeps until the waiter is woken, the deadline passes or `stop` is requested. Returns
  // false on the deadline or the stop.
  bool sleep(Waiter& waiter, Deadline deadline, const std::stop_token& stop = {});

  // Waits (until the deadline) while `session`'s connection is down: calls made meanwhile
  // would wait in the C client, past any deadline, for the next connection. False when the
  // bound passed (or its stop came) first.
  bool wait_connected(const Session& session, const CallBound& bound);

  // A hold's own nodes (its entry, or its lease nodes), watched while it lives: a node deleted
  // by anyone but this hold (by hand, by a peer) loses that hold, and only it, at once, although
  // the session lives on. The watch is set again after it fired for another change (a
  // downgrade's new data) and after every reconnect. Never blocks.
  void watch_held(const Session& session, const std::vector<std::string>& paths, std::shared_ptr<LossSignal> loss);
  // Before the hold deletes its nodes itself (release), and when it ends: no loss.
  void unwatch_held(const std::vector<std::string>& paths);

  // Hands nodes of ours to the janitor (see Orphan). Never blocks.
  void remove_later(Orphan orphan);
  // Orphans not yet removed (for tests and inspect of the client itself).
  std::size_t orphans() const;

 private:
  friend class Session;
  static void on_event(zhandle_t* handle, int type, int state, const char* path, void* context);
  void handle_event(zhandle_t* handle, int type, int state, const char* path);
  std::shared_ptr<Session> open_session();
  // Makes `session` the current one, applying a state event that arrived for its handle
  // before it was current. With mutex_ held.
  void adopt_locked(std::shared_ptr<Session> session);
  static void apply_state(Session& session, int state);
  void keeper_loop(std::stop_token stop);
  void janitor_loop(std::stop_token stop);
  // One attempt at removing an orphan; true when done (removed, or died with its session).
  bool clean(const Orphan& orphan);
  void wake_all_locked();
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
  std::vector<Orphan> orphans_;
  struct HeldNode {
    zhandle_t* handle;  // of the session that made it: events of another handle are not about it
    std::shared_ptr<LossSignal> loss;
    bool watch = true;  // its watch needs setting (again)
    bool gone = false;  // the server said it is gone
  };
  std::map<std::string, HeldNode> held_;  // by path (sequential nodes: one hold each)
  std::condition_variable_any janitor_cv_;

  std::jthread janitor_;
  std::jthread keeper_;  // last: stopped and joined first
};

}  // namespace turnstile::detail::zookeeper
