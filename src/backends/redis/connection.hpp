// Redis connections over hiredis 0.14, hardened: every socket is close-on-exec from its
// creation, every network wait ends by the caller's deadline (capped), replies are bounded in
// size, every error reply becomes a typed error, and a connection the server or a NAT may have
// dropped while idle is checked before anything that must not be resent is written to it.
//
// A Connection is a small pool of such connections shared by a client's threads: a call takes
// an idle one or opens its own, so no call ever waits for another's round trip or reconnect
// beyond its own deadline, and a release never queues behind a long acquire.
#pragma once

#include <hiredis/hiredis.h>

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

#include "core/backend.hpp"

namespace turnstile::detail::redis {

// A sentinel of a redis+sentinel:// URL, or a node of a redis+cluster:// URL.
struct SentinelAddress {
  std::string host;  // without an IPv6 address' brackets
  int port = 26379;
  std::string description;  // host:port as written
};

struct Settings {
  std::string description;  // host:port, for messages (never the password); with sentinels,
                            // the master's name and the sentinels until a primary is found
  std::string host;         // "" with sentinels: open_context asks them
  int port = 6379;
  std::string user;
  std::string password;
  int db = 0;
  std::chrono::milliseconds ttl{30'000};
  // When set, Client::connect's bound (ClientOptions::connect_timeout from the parse): what
  // the backend does while it is being made (its connections, the eviction check) ends by then.
  std::optional<SteadyClock::time_point> connect_by;
  // redis+sentinel://: the sentinels to ask, in order, for the primary of `master_name`; and
  // the password they want (sentinel_password=), if any.
  std::vector<SentinelAddress> sentinels;
  std::string master_name;
  std::string sentinel_password;
  // redis+cluster://: the nodes the URL names, asked in turn for the slot map (and, by the
  // subscriber, for any node to listen on: PUBLISH reaches every node of a cluster).
  std::vector<SentinelAddress> cluster_seeds;
  // ?min_replicas=N: an acquire returns only once WAIT says N replicas have its entry.
  int min_replicas = 0;
  // ?eviction=refuse (eviction.hpp): every new command link asks the server its maxmemory-policy
  // in its hello, and an allkeys-* one is refused (EvictingServer) before anything is written:
  // so each cluster node is checked when first used, and each primary a failover brings.
  bool refuse_evicting = false;
  bool sentinel() const { return !sentinels.empty(); }
  bool cluster() const { return !cluster_seeds.empty(); }
};

inline constexpr int kMaxMinReplicas = 100;

// redis://[user:password@]host:port[/db][?ttl=SECONDS&min_replicas=N],
// redis+sentinel://[user:password@]s1:p1,s2:p2/MASTER[?ttl=…&min_replicas=N&sentinel_password=…]
// and redis+cluster://[user:password@]h1:p1,h2:p2[?ttl=…&min_replicas=N] (database 0 only);
// ClientOptions::ttl wins when set.
Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

// Caps on each network wait; each is also bounded by the caller's deadline.
inline constexpr std::chrono::milliseconds kConnectTimeout{2000};
inline constexpr std::chrono::milliseconds kReplyTimeout{5000};
// The most one reply may make us buffer or allocate (a hostile server cannot make us allocate
// without bound; hiredis 0.14 has no limit of its own).
inline constexpr std::size_t kMaxReplyBytes = std::size_t{64} << 20;
// A connection idle for this long is PINGed before a call that must not be resent: Redis'
// `timeout` (1 s at least) cannot have closed it since, and a NAT that dropped it shows.
inline constexpr std::chrono::milliseconds kIdleProbe{500};
// At most this many connections per Connection; more callers wait (within their deadlines).
inline constexpr int kMaxLinks = 8;
// Reconnect attempts back off from 50 ms up to this (per Connection; see its constructor).
inline constexpr std::chrono::milliseconds kMaxReconnectBackoff{2000};

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* context) const;
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

using Command = std::vector<std::string>;

// A Lua script of scripts/, with its SHA1 once the server has loaded it.
struct Script {
  std::string name;
  std::string body;
};

// An eventfd that becomes readable when `stop` is requested, for poll() (-1 when no stop is
// possible): network waits end at once on it.
class StopFd {
 public:
  explicit StopFd(std::stop_token stop);
  ~StopFd();
  StopFd(const StopFd&) = delete;
  StopFd& operator=(const StopFd&) = delete;
  int fd() const { return fd_; }

 private:
  struct Signal {
    int fd;
    void operator()() const noexcept;
  };
  int fd_ = -1;
  std::optional<std::stop_callback<Signal>> callback_;
};

// The network waits of one call: they end by `until`, the caller's deadline, or at once when
// `stop` is requested (`cancel_fd` is its StopFd). A call whose deadline had already passed when
// it began ("try once") gets one attempt bounded by the caps.
struct Wait {
  explicit Wait(Deadline deadline, std::stop_token stop = {}, int cancel_fd = -1);
  SteadyClock::time_point start;
  bool try_once;
  SteadyClock::time_point until;  // time_point::max() for "no deadline"
  std::stop_token stop;
  int cancel_fd;
  SteadyClock::time_point connect_until() const;
  SteadyClock::time_point reply_until() const;
  bool expired() const { return SteadyClock::now() >= until; }
};

// A connected, authenticated context on the selected database.
struct Opened {
  Context context;
  std::string run_id;               // "" when the user may not run INFO
  std::string server;               // "host:port run_id": which server (and which of its boots)
  std::string address;              // host:port connected to (with sentinels: the primary found)
  std::vector<std::string> shas;    // of `scripts`, in order
};

// Connects (close-on-exec socket), authenticates, selects the database and reads the server's
// run_id. With sentinels, first asks them (each in turn, within the connect timeout) for the
// primary's address, and checks with ROLE that the server found is a primary. With `scripts` (command connections), also loads them and checks every permission the
// backend needs: scripts, turnstile's keys, publishing and subscribing on its channels.
// Every wait ends by `wait`'s limits, and at once when `cancel_fd` (if >= 0) becomes readable.
// Throws AccessDenied (password, ACL) or BackendUnavailable (unreachable, not Redis, replica,
// no sentinel answering).
Opened open_context(const Settings& settings, const Wait& wait, const std::vector<const Script*>* scripts,
                    int cancel_fd = -1);

// With sentinels: asks them, each in turn (each its share of the time until `until`), for the
// address of the primary. Throws AccessDenied (sentinel_password) or BackendUnavailable.
HostPort ask_sentinels(const Settings& settings, SteadyClock::time_point until, int cancel_fd = -1);

// Sends every command and reads every reply by `until` (each reply at most kMaxReplyBytes).
// Returns "" on success, else what failed (the context is then unusable). `sent` (optional) is
// set when any byte of the commands may have reached the server.
std::string exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies,
                     SteadyClock::time_point until, int cancel_fd = -1, bool* sent = nullptr);

// Appends a command in the protocol's encoding. False when out of memory.
bool append_command(std::string& out, const Command& command);
// Writes what the socket takes now of `out` and removes it (non-blocking; never SIGPIPE).
// False when the connection failed (context->errstr says).
bool write_pending(redisContext* context, std::string& out);
// Reads what the socket has (non-blocking), refusing to buffer more than kMaxReplyBytes of one
// reply. False when the connection failed or the reply is too large (context->errstr says).
bool read_available(redisContext* context);
// The next complete reply already read (null when none yet). False on a protocol error or a
// reply over kMaxReplyBytes.
bool next_reply(redisContext* context, Reply& reply);

// What a server answers becomes a turnstile exception here and only here (the model is
// redis-plus-plus's throw_error(context, reply)): error replies by their code (reply_error), and
// replies of a shape no script gives (the readers below); failures of the connection itself
// become BackendUnavailable in Connection. Callers never look into an exception's text.
//
// The typed error an error reply (or an array holding one) stands for; null when it is none.
// `call` names what was asked, for the message. NOPERM/NOAUTH/WRONGPASS and ACL refusals inside
// scripts are AccessDenied; everything else (OOM, READONLY, BUSY, MOVED, script errors...) is
// BackendUnavailable with the server's message, redacted.
std::exception_ptr reply_error(const Settings& settings, const std::string& call, const redisReply* reply);
// A server's text made safe to show: bounded, printable, the password masked.
std::string redacted(const Settings& settings, std::string_view text);

// A cluster node's MOVED or ASK reply (reply_error makes these): the slot is served by `address`
// (host:port), for good (MOVED) or for this one command (ASK: resend it there after ASKING); or
// a refusal that passes (CLUSTERDOWN, TRYAGAIN: a failover or a migration under way).
struct Redirected : BackendUnavailable {
  enum class Kind { moved, ask, again };
  Redirected(const std::string& message, Kind what, int slot_number, std::string to)
      : BackendUnavailable(message), kind(what), slot(slot_number), address(std::move(to)) {}
  Kind kind;
  int slot;             // -1 with again
  std::string address;  // "" with again
};

// A server whose maxmemory-policy may evict lock state (allkeys-*), refused with
// ?eviction=refuse: a BackendUnavailable to callers, but never retried (it will not pass).
struct EvictingServer : BackendUnavailable {
  using BackendUnavailable::BackendUnavailable;
};
// What is wrong with a server of `policy` (for EvictingServer and the warning at connect).
std::string eviction_risk(const Settings& settings, const std::string& policy);

// Throws BackendUnavailable: redis answered `call` with a reply of a shape it never gives.
[[noreturn]] void unexpected_reply(const std::string& call);
// Fencing tokens and places in line stay below 2^53 (the scripts refuse to hand out more), so
// Lua's doubles carry them exactly; anything else in a reply is not a token.
inline constexpr long long kMaxToken = (1LL << 53) - 1;
// Element `index` of a script's array reply: an integer (or decimal text), a token in
// 1..kMaxToken, or text ("" when absent). The first two throw on anything else.
long long integer_at(const redisReply* reply, std::size_t index);
std::uint64_t token_at(const redisReply* reply, std::size_t index);
std::string string_at(const redisReply* reply, std::size_t index);
// A script's integer reply.
long long integer_of(const Reply& reply);

// One script call's outcome in a pipeline: the reply, or the typed error the server answered.
struct Result {
  Reply reply;
  std::exception_ptr error;
  std::string server;  // the server that answered (Opened::server)
  bool ok() const { return error == nullptr; }
  // The reply; rethrows the error.
  Reply take();
};

// poll()'s timeout for waiting until `until` (-1 for forever), in whole milliseconds rounded up.
int poll_timeout(SteadyClock::time_point until);

using ScriptCall = std::tuple<const Script*, std::vector<std::string>, std::vector<std::string>>;

// After a call's replies came, a command to send on the same connection (WAIT counts the
// replicas that have that connection's writes), or none.
using FollowUp = std::function<std::optional<Command>(const std::vector<Reply>&)>;

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

  // Runs the script (EVALSHA, or EVAL after NOSCRIPT). `retry` says whether the script may run
  // again after a failure that left its outcome unknown (it must be idempotent); the call then
  // keeps reconnecting until `deadline`. Otherwise it is only written to a connection known to
  // be alive, and a failure after writing throws BackendUnavailable saying the outcome is
  // unknown. Error replies throw their typed error (see reply_error). Throws
  // BackendUnavailable when the deadline passes, or at once when `stop` is requested (every wait:
  // connect, reply, backoff, a busy pool).
  // `server`, when given, receives the identity of the server the script ran on (Opened::server).
  // `follow_up`, when given, may name a command to send on the same connection once the script's
  // reply came; its reply goes to `follow_reply` (left empty when it failed: the connection is
  // dropped then).
  // With sentinels, a READONLY reply (the primary was demoted) drops the connection and the call
  // goes out again on a new one to the primary the sentinels name, until the deadline.
  // `asking` sends ASKING first, in the same round trip (a cluster's ASK redirection).
  Reply eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
             Deadline deadline, bool retry, std::string* server = nullptr, std::stop_token stop = {},
             const FollowUp* follow_up = nullptr, Reply* follow_reply = nullptr, bool asking = false) {
    return eval_result(script, keys, args, deadline, retry, server, std::move(stop), follow_up, follow_reply, asking)
        .take();
  }
  // The same, with an error reply returned in the Result rather than thrown.
  Result eval_result(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                     Deadline deadline, bool retry, std::string* server = nullptr, std::stop_token stop = {},
                     const FollowUp* follow_up = nullptr, Reply* follow_reply = nullptr, bool asking = false);
  // Several idempotent script calls in one round trip, each with its own outcome: an error
  // reply to one (OOM, READONLY, BUSY...) is that call's typed error, never thrown. Throws
  // BackendUnavailable only when no reply came by the deadline.
  std::vector<Result> eval_each(const std::vector<ScriptCall>& calls, Deadline deadline,
                                std::string* server = nullptr, std::stop_token stop = {});
  // The same, throwing the first call's error reply as its typed error.
  std::vector<Reply> eval_pipelined(const std::vector<ScriptCall>& calls, Deadline deadline,
                                    std::string* server = nullptr);
  // A plain command, retried like an idempotent script; error replies throw typed errors.
  Reply command(const Command& command, Deadline deadline, std::stop_token stop = {}) {
    return command_result(command, deadline, std::move(stop)).take();
  }
  Result command_result(const Command& command, Deadline deadline, std::stop_token stop = {}, bool asking = false);

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
  // An idle live connection, or a new one; waits (by `wait.until`) when kMaxLinks are busy.
  std::unique_ptr<Link> checkout(const Wait& wait);
  void checkin(std::unique_ptr<Link> link);
  // Closes a broken link; `fresh` (it never completed a call) counts as a failed attempt.
  void discard(std::unique_ptr<Link> link, bool fresh);
  std::unique_ptr<Link> open_link(const Wait& wait);
  // Waits (mutex_ held by `lock`) until a link comes back or a slot frees up, `until`, or a stop.
  // False on timeout or stop.
  bool wait_returned(std::unique_lock<std::mutex>& lock, SteadyClock::time_point until, const std::stop_token& stop);
  void notify_returned();  // mutex_ held
  // One round trip of `commands` on some link; error replies are returned, not thrown.
  std::vector<Reply> run(const std::vector<Command>& commands, const Wait& wait, bool retry, std::string* server,
                         const FollowUp* follow_up = nullptr, Reply* follow_reply = nullptr, bool asking = false);
  std::vector<Result> run_scripts(const std::vector<ScriptCall>& calls, const Wait& wait, bool retry,
                                  std::string* server, const FollowUp* follow_up = nullptr,
                                  Reply* follow_reply = nullptr, bool asking = false);
  // With sentinels: drops the idle links (they lead to a demoted primary). mutex_ not held.
  void forget_idle();
  Command eval_command(const Script& script, const std::vector<std::string>& keys,
                       const std::vector<std::string>& args, bool by_sha);

  const Settings settings_;
  const std::vector<const Script*> scripts_;
  const std::function<void(const std::string&)> on_server_changed_;
  const std::chrono::milliseconds max_backoff_;
  std::vector<std::string> shas_;  // by index in scripts_; set by the first link (SHA1s never change); mutex_

  std::mutex mutex_;  // guards what follows; never held across network I/O
  std::condition_variable_any returned_;  // a link came back, or a slot or a reconnect became possible
  std::uint64_t returns_ = 0;             // counts notify_returned(): what returned_'s waiters wait for
  std::vector<std::unique_ptr<Link>> idle_;
  std::unique_ptr<Link> lent_;  // lend_idle's, out of the pool until taken back
  int links_ = 0;  // idle, in use and being opened
  std::string server_;  // the last server a new link found (Opened::server)
  std::uint64_t generation_ = 0;
  std::chrono::milliseconds backoff_{0};
  SteadyClock::time_point next_attempt_{};
};

}  // namespace turnstile::detail::redis
