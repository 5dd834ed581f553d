#include "backends/redis/connection.hpp"

#include <algorithm>
#include <charconv>
#include <thread>

namespace turnstile::detail::redis {
namespace {

timeval to_timeval(std::chrono::milliseconds ms) {
  const auto clamped = std::max(ms, std::chrono::milliseconds(1));
  return timeval{static_cast<time_t>(clamped.count() / 1000), static_cast<suseconds_t>((clamped.count() % 1000) * 1000)};
}

bool starts_with(const redisReply* reply, std::string_view prefix) {
  return reply && reply->type == REDIS_REPLY_ERROR && std::string_view(reply->str, reply->len).substr(0, prefix.size()) == prefix;
}

std::string reply_text(const redisReply* reply) {
  return reply && reply->str ? std::string(reply->str, reply->len) : std::string();
}

constexpr auto kFirstBackoff = std::chrono::milliseconds(50);
constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);
constexpr auto kConnectTimeout = std::chrono::milliseconds(2000);
constexpr auto kReplyTimeout = std::chrono::milliseconds(5000);

}  // namespace

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  if (url.scheme == "rediss") throw BackendNotBuilt("rediss:// (TLS) needs a hiredis with TLS, which Debian 12's 0.14 lacks");
  if (url.hosts.size() != 1) {
    throw InvalidUrl("redis:// URLs name exactly one host:port, got '" + url.text + "'");
  }
  const auto endpoint = parse_host_port(url.hosts.front(), 6379, url);
  settings.host = endpoint.host;
  settings.port = endpoint.port;
  settings.description = settings.host + ":" + std::to_string(settings.port);
  settings.user = url.user;
  settings.password = url.password;
  if (!url.user.empty() && url.password.empty()) {
    // redis://secret@host is a password alone, as redis-cli -u reads it.
    settings.password = url.user;
    settings.user.clear();
  }
  if (!url.path.empty() && url.path != "/") {
    const auto db_text = url.path.substr(1);
    const auto [end, error] = std::from_chars(db_text.data(), db_text.data() + db_text.size(), settings.db);
    if (error != std::errc() || end != db_text.data() + db_text.size() || settings.db < 0) {
      throw InvalidUrl("bad database number '" + db_text + "' in '" + url.text + "'");
    }
  }
  for (const auto& [key, value] : url.query) {
    if (key != "ttl") throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl)");
    settings.ttl = parse_seconds("ttl", value, 0.3, 86400);
  }
  if (options.ttl.count() > 0) {
    if (options.ttl < std::chrono::milliseconds(300)) throw InvalidArgument("ttl must be at least 300 ms");
    settings.ttl = options.ttl;
  }
  return settings;
}

bool exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies) {
  for (const auto& command : commands) {
    std::vector<const char*> argv;
    std::vector<size_t> lengths;
    for (const auto& arg : command) {
      argv.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    if (redisAppendCommandArgv(context, static_cast<int>(argv.size()), argv.data(), lengths.data()) != REDIS_OK) return false;
  }
  replies.clear();
  for (std::size_t i = 0; i < commands.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(context, &raw) != REDIS_OK || raw == nullptr) return false;
    replies.emplace_back(static_cast<redisReply*>(raw));
  }
  return true;
}

Context open_context(const Settings& settings, std::chrono::milliseconds timeout, std::string* run_id) {
  Context context(redisConnectWithTimeout(settings.host.c_str(), settings.port, to_timeval(timeout)));
  if (!context) throw BackendUnavailable("cannot connect to redis at " + settings.description + ": out of memory");
  if (context->err) {
    throw BackendUnavailable("cannot connect to redis at " + settings.description + ": " + context->errstr);
  }
  // Bounded replies: a server that stops answering is treated as gone, never waited on forever.
  redisSetTimeout(context.get(), to_timeval(kReplyTimeout));
  redisEnableKeepAlive(context.get());
  std::vector<Command> hello;
  if (!settings.password.empty()) {
    hello.push_back(settings.user.empty() ? Command{"AUTH", settings.password}
                                          : Command{"AUTH", settings.user, settings.password});
  }
  if (settings.db != 0) hello.push_back({"SELECT", std::to_string(settings.db)});
  hello.push_back({"INFO", "server"});
  std::vector<Reply> replies;
  if (!exchange(context.get(), hello, replies)) {
    const bool protocol = context->err == REDIS_ERR_PROTOCOL;
    throw BackendUnavailable(protocol ? "the server at " + settings.description + " does not speak the Redis protocol"
                                      : "redis at " + settings.description + " did not answer: " + context->errstr);
  }
  for (const auto& reply : replies) {
    if (reply->type != REDIS_REPLY_ERROR) continue;
    const auto text = reply_text(reply.get());
    if (starts_with(reply.get(), "WRONGPASS") || starts_with(reply.get(), "NOAUTH") || starts_with(reply.get(), "NOPERM") ||
        text.find("password") != std::string::npos || text.find("AUTH") != std::string::npos) {
      throw AccessDenied("redis at " + settings.description + " refused us: " + text);
    }
    throw BackendUnavailable("redis at " + settings.description + " answered: " + text);
  }
  const auto info = reply_text(replies.back().get());
  const auto at = info.find("run_id:");
  if (replies.back()->type != REDIS_REPLY_STRING || at == std::string::npos) {
    throw BackendUnavailable("the server at " + settings.description + " does not look like Redis (no run_id)");
  }
  if (run_id) *run_id = info.substr(at + 7, info.find_first_of("\r\n", at) - at - 7);
  return context;
}

Connection::Connection(Settings settings, std::vector<const Script*> scripts, std::function<void()> on_server_changed)
    : settings_(std::move(settings)), scripts_(std::move(scripts)), on_server_changed_(std::move(on_server_changed)) {
  std::lock_guard lock(mutex_);
  ensure_connected(SteadyClock::now());  // one attempt: connect() reports a bad URL or password at once
}

void Connection::ensure_connected(Deadline deadline) {
  while (!context_) {
    const auto now = SteadyClock::now();
    if (now < next_attempt_) {
      if (deadline && *deadline < next_attempt_) {
        throw BackendUnavailable("redis at " + settings_.description + " is unreachable (reconnecting)");
      }
      std::this_thread::sleep_until(next_attempt_);
    }
    try {
      std::string run_id;
      auto context = open_context(settings_, kConnectTimeout, &run_id);
      // Load every script at once: one round trip, and an ACL that forbids scripting is
      // refused here, at connect time, rather than at the first lock.
      std::vector<Command> loads;
      for (const auto* script : scripts_) loads.push_back({"SCRIPT", "LOAD", script->body});
      std::vector<Reply> replies;
      if (!exchange(context.get(), loads, replies)) {
        throw BackendUnavailable("redis at " + settings_.description + " failed while loading scripts: " + context->errstr);
      }
      std::vector<std::string> shas;
      for (const auto& reply : replies) {
        if (reply->type == REDIS_REPLY_ERROR) {
          if (starts_with(reply.get(), "NOPERM")) {
            throw AccessDenied("redis at " + settings_.description + " does not let this user run scripts: " + reply_text(reply.get()));
          }
          throw BackendUnavailable("redis at " + settings_.description + " refused a script: " + reply_text(reply.get()));
        }
        shas.push_back(reply_text(reply.get()));
      }
      const bool changed = !run_id_.empty() && run_id != run_id_;
      context_ = std::move(context);
      shas_ = std::move(shas);
      run_id_ = run_id;
      if (changed) ++generation_;
      backoff_ = std::chrono::milliseconds(0);
      if (changed && on_server_changed_) on_server_changed_();
    } catch (const AccessDenied&) {
      throw;
    } catch (const BackendUnavailable&) {
      backoff_ = std::clamp(backoff_ * 2, kFirstBackoff, kMaxBackoff);
      next_attempt_ = SteadyClock::now() + backoff_;
      if (!deadline || *deadline <= SteadyClock::now() || *deadline < next_attempt_) throw;
    }
  }
}

Command Connection::eval_command(const Script& script, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& args, bool by_sha) const {
  const auto index = static_cast<std::size_t>(std::find(scripts_.begin(), scripts_.end(), &script) - scripts_.begin());
  Command command{by_sha ? "EVALSHA" : "EVAL", by_sha ? shas_.at(index) : script.body, std::to_string(keys.size())};
  command.insert(command.end(), keys.begin(), keys.end());
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

std::vector<Reply> Connection::run(const std::vector<Command>& commands, Deadline deadline, bool retry) {
  // Called with mutex_ held.
  for (;;) {
    ensure_connected(deadline);
    std::vector<Reply> replies;
    if (exchange(context_.get(), commands, replies)) return replies;
    const std::string why = context_->errstr;
    context_.reset();
    if (!retry) {
      throw BackendUnavailable("redis at " + settings_.description + " failed mid-request (" + why +
                               "); the outcome is unknown");
    }
    if (deadline && *deadline <= SteadyClock::now()) {
      throw BackendUnavailable("redis at " + settings_.description + " failed: " + why);
    }
  }
}

Reply Connection::eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                       Deadline deadline, bool retry, std::uint64_t* server_generation) {
  std::lock_guard lock(mutex_);
  auto replies = run({eval_command(script, keys, args, true)}, deadline, retry);
  if (starts_with(replies.front().get(), "NOSCRIPT")) {
    // The server lost its script cache (restart, SCRIPT FLUSH): EVAL sends and caches it.
    replies = run({eval_command(script, keys, args, false)}, deadline, retry);
  }
  if (replies.front()->type == REDIS_REPLY_ERROR) {
    const auto text = reply_text(replies.front().get());
    if (starts_with(replies.front().get(), "NOPERM")) throw AccessDenied("redis refused: " + text);
    throw BackendUnavailable("redis script " + script.name + " failed: " + text);
  }
  if (server_generation) *server_generation = generation_;
  return std::move(replies.front());
}

std::vector<Reply> Connection::eval_pipelined(
    const std::vector<std::tuple<const Script*, std::vector<std::string>, std::vector<std::string>>>& calls, Deadline deadline,
    std::uint64_t* server_generation) {
  std::lock_guard lock(mutex_);
  std::vector<Command> commands;
  for (const auto& [script, keys, args] : calls) commands.push_back(eval_command(*script, keys, args, true));
  // The watchdog's renewals must give up by their deadline, not after the usual reply timeout:
  // until they do, it cannot check how long its holds have gone unconfirmed.
  ensure_connected(deadline);
  if (deadline) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now());
    redisSetTimeout(context_.get(), to_timeval(std::clamp(left, std::chrono::milliseconds(50), kReplyTimeout)));
  }
  struct RestoreTimeout {
    Connection& connection;
    ~RestoreTimeout() {
      if (connection.context_) redisSetTimeout(connection.context_.get(), to_timeval(kReplyTimeout));
    }
  } restore{*this};
  auto replies = run(commands, deadline, true);
  for (std::size_t i = 0; i < replies.size(); ++i) {
    if (starts_with(replies[i].get(), "NOSCRIPT")) {
      const auto& [script, keys, args] = calls[i];
      replies[i] = std::move(run({eval_command(*script, keys, args, false)}, deadline, true).front());
    }
  }
  if (server_generation) *server_generation = generation_;
  return replies;
}

Reply Connection::command(const Command& command, Deadline deadline) {
  std::lock_guard lock(mutex_);
  auto replies = run({command}, deadline, true);
  if (replies.front()->type == REDIS_REPLY_ERROR) {
    throw BackendUnavailable("redis " + command.front() + " failed: " + reply_text(replies.front().get()));
  }
  return std::move(replies.front());
}

}  // namespace turnstile::detail::redis
