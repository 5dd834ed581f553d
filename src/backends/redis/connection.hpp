// SPDX-License-Identifier: Apache-2.0
// Redis connections over hiredis 0.14, hardened: every socket is close-on-exec from its
// creation, every network wait ends by the caller's deadline (capped), replies are bounded in
// size, every error reply becomes a typed error, and a connection the server or a NAT may have
// dropped while idle is checked before anything that must not be resent is written to it.
//
// A Connection is a small pool of such connections shared by a client's threads: a call takes
// an idle one or opens its own, so no call ever waits for another's round trip or reconnect
// beyond its own deadline, and a release never queues behind a long acquire.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "backends/redis/replies.hpp"
#include "backends/redis/settings.hpp"
#include "backends/redis/wire.hpp"
#include "core/call_budget.hpp"

namespace turnstile::detail::redis {

// A connection idle for this long is PINGed before a call that must not be resent: Redis'
// `timeout` (1 s at least) cannot have closed it since, and a NAT that dropped it shows.
inline constexpr std::chrono::milliseconds kIdleProbe{500};
// At most this many connections per Connection; more callers wait (within their deadlines).
inline constexpr int kMaxLinks = 8;
// Reconnect attempts back off from 50 ms up to this (per Connection; see its constructor).
inline constexpr std::chrono::milliseconds kMaxReconnectBackoff{2000};

// A Lua script of scripts/, with its SHA1 once the server has loaded it.
struct Script {
  std::string name;
  std::string body;
};

// A connected, authenticated context on the selected database.
struct Opened {
  Context context;
  std::string run_id;             // "" when the user may not run INFO
  std::string server;             // "host:port run_id": which server (and which of its boots)
  std::string address;            // host:port connected to (with sentinels: the primary found)
  std::vector<std::string> shas;  // of `scripts`, in order
};

// Connects (close-on-exec socket), authenticates, selects the database and reads the server's
// run_id. With sentinels, first asks them (each in turn, within the connect timeout) for the
// primary's address, and checks with ROLE that the server found is a primary. With `scripts` (command connections),
// also loads them and checks every permission the backend needs: scripts, turnstile's keys, publishing and subscribing
// on its channels. Every wait ends by `wait`'s limits, and at once when `cancel_fd` (if >= 0) becomes readable. Throws
// AccessDenied (password, ACL) or BackendUnavailable (unreachable, not Redis, replica, no sentinel answering).
Opened open_context(const Settings& settings, const Wait& wait, const std::vector<const Script*>* scripts,
                    int cancel_fd = -1);

// With sentinels: asks them, each in turn (each its share of the time until `until`), for the
// address of the primary. Throws AccessDenied (sentinel_password) or BackendUnavailable.
HostPort ask_sentinels(const Settings& settings, SteadyClock::time_point until, int cancel_fd = -1);

using ScriptCall = std::tuple<const Script*, std::vector<std::string>, std::vector<std::string>>;

// What becomes of a script call sent without waiting for its reply (Connection::send_pipelined):
// called exactly once, from whichever thread reads the reply, with the reply or its typed
// error; BackendUnavailable when the connection failed or closed before the reply came (the
// outcome is unknown then).
using Answer = std::function<void(Result)>;

// After a call's replies came, a command to send on the same connection (WAIT counts the
// replicas that have that connection's writes), or none.
using FollowUp = std::function<std::optional<Command>(const std::vector<Reply>&)>;

// How one call runs; written with designated initializers, e.g.
// `{.budget = {deadline, stop}, .idempotent = true, .server = &server}`.
struct CallOptions {
  // The caller's deadline and stop: every wait of the call (connect, reply, backoff, a busy
  // pool) ends by the deadline, and at once on the stop. A deadline already passed gets one
  // attempt within the caps (kConnectTimeout, kReplyTimeout).
  CallBudget budget;
  // The call may run again after a failure that left its outcome unknown: it then keeps
  // reconnecting until the deadline. Otherwise it is only written to a connection known to be
  // alive, and a failure after writing throws BackendUnavailable saying the outcome is unknown.
  bool idempotent = false;
  // Receives the identity of the server the call ran on (Opened::server).
  std::string* server = nullptr;
  // May name a command to send on the same connection once the reply came; its reply goes to
  // `follow_reply` (left empty when it failed: the connection is dropped then).
  const FollowUp* follow_up = nullptr;
  Reply* follow_reply = nullptr;
  // Sends ASKING first, in the same round trip (a cluster's ASK redirection).
  bool asking = false;
  // Plain commands only (command_result): see Wait::fail_fast.
  bool fail_fast = false;
};

class Connection {
 public:
  // Opens the first connection now (one attempt), so a bad URL, password or ACL fails at once.
  // on_server_changed(server) runs (with nothing locked) when a new connection finds a different
  // server (run_id, or with sentinels another primary) than the last one did.
  // Reconnects back off up to `max_backoff`. Without `connect_now` (a cluster's nodes) the first
  // connection is made by the first call.
  Connection(Settings settings, std::vector<const Script*> scripts,
             std::function<void(const std::string& server)> on_server_changed,
             std::chrono::milliseconds max_backoff = kMaxReconnectBackoff, bool connect_now = true);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Runs the script (EVALSHA, or EVAL after NOSCRIPT) as `options` say. Error replies throw
  // their typed error (see reply_error); BackendUnavailable when the deadline passes or a stop
  // comes. With sentinels, a READONLY reply (the primary was demoted) drops the connection and
  // the call goes out again on a new one to the primary the sentinels name, until the deadline.
  Reply eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
             const CallOptions& options) {
    return eval_result(script, keys, args, options).take();
  }
  // The same, with an error reply returned in the Result rather than thrown.
  Result eval_result(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                     const CallOptions& options);
  // Several idempotent script calls in one round trip, each with its own outcome: an error
  // reply to one (OOM, READONLY, BUSY...) is that call's typed error, never thrown. Throws
  // BackendUnavailable only when no reply came by the deadline.
  std::vector<Result> eval_each(const std::vector<ScriptCall>& calls, const CallBudget& budget,
                                std::string* server = nullptr);
  // The same, throwing the first call's error reply as its typed error.
  std::vector<Reply> eval_pipelined(const std::vector<ScriptCall>& calls, const CallBudget& budget);
  // Sends an idempotent script call on an idle connection without waiting for its reply. The
  // reply goes to `answer`: read by the next call on that connection (whose commands go out
  // after this one, and which reads this reply before its own: the server answers in order),
  // by collect_pending(), or failed when the connection closes. A call that finds several
  // connections idle takes one that owes replies first. False (nothing sent, `answer` dropped)
  // when no connection is idle and alive or the scripts are not loaded yet: call eval() then.
  bool send_pipelined(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                      Answer answer);
  // Reads the replies owed on idle connections, by `until`, and hands them to their answers; a
  // connection that fails or has not answered by then is dropped (its answers get
  // BackendUnavailable).
  void collect_pending(SteadyClock::time_point until);
  // A plain command, retried like an idempotent script; error replies throw typed errors.
  Reply command(const Command& command, const CallBudget& budget) {
    return command_result(command, {.budget = budget}).take();
  }
  // The same, with an error reply returned; options.idempotent is implied.
  Result command_result(const Command& command, CallOptions options);

  // Sleeps until `until`, until `wake_fd` becomes readable, or until an idle connection shows
  // that its server went away (EOF or reset: a restart, a shutdown, a killed server), so that
  // a watcher learns of it at once rather than at its next call. Such a connection is dropped;
  // returns true then. Only for a Connection whose calls all come from the caller's thread (the
  // watchdog's): the connection watched is out of the pool meanwhile.
  bool watch_idle(SteadyClock::time_point until, int wake_fd);
  // watch_idle in two steps, so that a cluster's watchdog watches every node at once: lends an
  // idle connection out of the pool (its fd; -1 when none is idle or one is lent already), and
  // takes it back, dropped when its fd showed anything (then true).
  int lend_idle();
  bool take_back_idle(bool readable);

  const Settings& settings() const { return settings_; }

  // With sentinels: when `server` (Opened::server) is not the one this Connection last found,
  // its connections are dropped (idle ones now, busy ones when they come back), so the next call
  // connects to the primary the sentinels name.
  void follow(const std::string& server);
  // With sentinels: `address` (host:port) is the primary the sentinels name now; when it is not
  // the one this Connection's latest connection found, drops its connections and returns true. A
  // primary demoted by a failover may go on accepting writes for seconds before the sentinels
  // reconfigure it: this is how a client connected to it learns of the failover.
  bool primary_moved(const std::string& address);

 private:
  struct Link;
  struct Owed;
  // An idle link (mutex_ held): the most recently used one that owes replies, else the most
  // recently used; null when none is idle.
  std::unique_ptr<Link> take_idle_locked();
  // Hands the replies read for `owed` to their answers; those without one (`failure` says why)
  // get BackendUnavailable.
  void answer(std::vector<Owed>& owed, std::vector<Reply>& replies, const std::string& failure,
              const std::string& server) const;
  // Reads the replies `link` owes (by `wait`) and answers them; false when the link failed (it
  // is discarded then).
  bool settle_owed(std::unique_ptr<Link>& link, const Wait& wait);
  // An idle live connection, or a new one; waits (by `wait.until`) when kMaxLinks are busy.
  std::unique_ptr<Link> checkout(const Wait& wait);
  void checkin(std::unique_ptr<Link> link);
  // Closes a broken link; `fresh` (it never completed a call) counts as a failed attempt.
  void discard(std::unique_ptr<Link> link, bool fresh);
  std::unique_ptr<Link> open_link(const Wait& wait);
  // Opens a link in a slot already counted in links_ (`lock` released meanwhile, held again on
  // return). Null when it failed and the call may try again (after the reconnect backoff).
  std::unique_ptr<Link> open_counted(std::unique_lock<std::mutex>& lock, const Wait& wait);
  // Before a call that must not be resent: PINGs a link idle for kIdleProbe. False when it did
  // not answer (it is discarded: try another); throws when the wait is over.
  bool shown_alive(std::unique_ptr<Link>& link, const Wait& wait);
  // Sends options.follow_up's command, if any, after `replies`; false when the link failed.
  bool send_follow_up(Link& link, const std::vector<Reply>& replies, const Wait& wait, const CallOptions& options);
  // Waits (mutex_ held by `lock`) until a link comes back or a slot frees up, `until`, or a stop.
  // False on timeout or stop.
  bool wait_returned(std::unique_lock<std::mutex>& lock, SteadyClock::time_point until, const std::stop_token& stop);
  void notify_returned();  // mutex_ held
  // One round trip of `commands` on some link; error replies are returned, not thrown.
  std::vector<Reply> run(const std::vector<Command>& commands, const Wait& wait, const CallOptions& options);
  std::vector<Result> run_scripts(const std::vector<ScriptCall>& calls, const Wait& wait, CallOptions options);
  // With sentinels: drops the idle links (they lead to a demoted primary). mutex_ not held.
  void forget_idle();
  Command eval_command(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                       bool by_sha);

  const Settings settings_;
  const std::vector<const Script*> scripts_;
  const std::function<void(const std::string&)> on_server_changed_;
  const std::chrono::milliseconds max_backoff_;
  std::vector<std::string> shas_;  // by index in scripts_; set by the first link (SHA1s never change); mutex_

  std::mutex mutex_;                      // guards what follows; never held across network I/O
  std::condition_variable_any returned_;  // a link came back, or a slot or a reconnect became possible
  std::uint64_t returns_ = 0;             // counts notify_returned(): what returned_'s waiters wait for
  std::vector<std::unique_ptr<Link>> idle_;
  std::unique_ptr<Link> lent_;  // lend_idle's, out of the pool until taken back
  int links_ = 0;               // idle, in use and being opened
  std::string server_;          // the last server a new link found (Opened::server)
  std::uint64_t generation_ = 0;
  std::chrono::milliseconds backoff_{0};
  bool lost_a_link_ = false;  // a link broke since the last one opened: the next one reconnects
  SteadyClock::time_point next_attempt_{};
};

}  // namespace turnstile::detail::redis