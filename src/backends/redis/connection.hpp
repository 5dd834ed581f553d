// A Redis connection over hiredis that survives the server going away: it reconnects with
// capped exponential backoff, re-authenticates, and tells its owner when the server it finds
// is not the one it knew (a restart without persistence forgets every hold).
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace turnstile::detail::redis {

struct Settings {
  std::string description;  // host:port, for messages
  std::string host;
  int port = 6379;
  std::string user;
  std::string password;
  int db = 0;
  std::chrono::milliseconds ttl{30'000};
};

// redis://[user:password@]host:port[/db][?ttl=SECONDS]; ClientOptions::ttl wins when set.
Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* context) const { redisFree(context); }
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

using Command = std::vector<std::string>;

// A Lua script of scripts/, with its SHA1 once the server has loaded it.
struct Script {
  std::string name;
  std::string body;
};

// Opens, authenticates and selects the database. Throws AccessDenied (bad password, ACL),
// BackendUnavailable (unreachable, not Redis). Returns the server's run_id through `run_id`.
Context open_context(const Settings& settings, std::chrono::milliseconds timeout, std::string* run_id);

// Appends every command, then reads every reply. Returns false on an I/O or protocol error
// (the context is then unusable).
bool exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies);

class Connection {
 public:
  // on_server_changed runs with the connection locked: it must not call back into it.
  Connection(Settings settings, std::vector<const Script*> scripts, std::function<void()> on_server_changed);

  // Runs the script (EVALSHA, or EVAL after NOSCRIPT). `retry` says whether the script may
  // run again after a failure that left its outcome unknown (it must be idempotent); the
  // call then keeps reconnecting until `deadline`. Error replies throw BackendUnavailable
  // with the server's message. Throws BackendUnavailable when the deadline passes.
  // `server_generation`, when given, receives the generation of the server the script ran on:
  // it grows each time a reconnect finds a different server (run_id).
  Reply eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
             Deadline deadline, bool retry, std::uint64_t* server_generation = nullptr);
  // Several idempotent script calls in one round trip (the watchdog's renewals).
  std::vector<Reply> eval_pipelined(const std::vector<std::tuple<const Script*, std::vector<std::string>, std::vector<std::string>>>& calls,
                                    Deadline deadline, std::uint64_t* server_generation = nullptr);
  // A plain command, retried like an idempotent script.
  Reply command(const Command& command, Deadline deadline);

  const Settings& settings() const { return settings_; }

 private:
  std::vector<Reply> run(const std::vector<Command>& commands, Deadline deadline, bool retry);
  void ensure_connected(Deadline deadline);  // with mutex_ held
  Command eval_command(const Script& script, const std::vector<std::string>& keys,
                       const std::vector<std::string>& args, bool by_sha) const;

  Settings settings_;
  std::vector<const Script*> scripts_;
  std::function<void()> on_server_changed_;
  std::mutex mutex_;
  Context context_;
  std::string run_id_;
  std::uint64_t generation_ = 0;
  std::vector<std::string> shas_;  // by index in scripts_
  std::chrono::milliseconds backoff_{0};
  std::chrono::steady_clock::time_point next_attempt_{};
};

}  // namespace turnstile::detail::redis
