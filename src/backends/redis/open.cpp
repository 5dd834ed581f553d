// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/connection.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>

namespace turnstile::detail::redis {
namespace {

using std::chrono::milliseconds;
// Probes of the permissions the backend needs, run at connect. The empty hash tag `{}` is no
// name's (names are never empty), so nothing real is touched or woken.
constexpr std::string_view kProbeKey = "turnstile:{}:access-check";
constexpr std::string_view kProbeQueueChannel = "turnstile:{}:access-check";
constexpr std::string_view kProbeCounterChannel = "redisson_sc:{}:access-check";
// Reads and writes (a DEL of a key that never exists) one key of turnstile's key space.
constexpr std::string_view kProbeScript = "redis.call('EXISTS', KEYS[1]) redis.call('DEL', KEYS[1]) return 1";

// What a new connection sends: credentials, database, INFO (for the run_id), and then, for a
// command connection, the scripts and the permission probes (see open_context: two round trips).
struct Hello {
  std::vector<Command> commands;
  std::size_t info_at = 0;     // INFO's index (AUTH and SELECT come before)
  std::size_t role_at = 0;     // ROLE's, right after INFO (with sentinels only)
  std::size_t scripts_at = 0;  // the first SCRIPT LOAD's; the probes follow the scripts
  std::size_t policy_at = 0;   // CONFIG GET maxmemory-policy's, the last (0: not asked)
};

Hello hello_commands(const Settings& settings, const redisContext* context, const std::vector<const Script*>* scripts) {
  Hello hello;
  auto& commands = hello.commands;
  if (!settings.password.empty()) {
    commands.push_back(settings.user.empty() ? Command{"AUTH", settings.password}
                                             : Command{"AUTH", settings.user, settings.password});
  }
  if (settings.db != 0) commands.push_back({"SELECT", std::to_string(settings.db)});
  hello.info_at = commands.size();
  commands.push_back({"INFO", "server"});
  if (settings.sentinel()) {
    hello.role_at = commands.size();
    commands.push_back({"ROLE"});
  }
  hello.scripts_at = commands.size();
  if (!scripts) return hello;
  for (const auto* script : *scripts) commands.push_back({"SCRIPT", "LOAD", script->body});
  // What the scripts do besides running: publish wake-ups, read and write turnstile's keys;
  // and the subscriber connection's SUBSCRIBE. A user lacking any of them is refused here,
  // before anything is written, rather than by a script halfway through.
  commands.push_back({"PUBLISH", std::string(kProbeQueueChannel), ""});
  commands.push_back({"PUBLISH", std::string(kProbeCounterChannel), ""});
  commands.push_back({"EVAL", std::string(kProbeScript), "1", std::string(kProbeKey)});
  // One reply each. Channels of this connection's own (nobody else knows them, so no
  // message can arrive in between and add a reply), under the same two patterns.
  const auto own = ":" + std::to_string(reinterpret_cast<std::uintptr_t>(context)) + "-" +
                   std::to_string(SteadyClock::now().time_since_epoch().count());
  for (const auto channel : {kProbeQueueChannel, kProbeCounterChannel}) {
    commands.push_back({"SUBSCRIBE", std::string(channel) + own});
  }
  for (const auto channel : {kProbeQueueChannel, kProbeCounterChannel}) {
    commands.push_back({"UNSUBSCRIBE", std::string(channel) + own});
  }
  if (settings.refuse_evicting) {
    hello.policy_at = commands.size();
    commands.push_back({"CONFIG", "GET", "maxmemory-policy"});
  }
  return hello;
}

// ?eviction=refuse: throws EvictingServer when the hello's CONFIG GET maxmemory-policy found an
// allkeys-* policy. CONFIG refused to the user (or renamed away): nothing to check, as at connect.
void check_policy(const Settings& settings, const redisReply* policy) {
  if (policy && policy->type == REDIS_REPLY_ARRAY && policy->elements >= 2 &&
      reply_view(policy->element[1]).starts_with("allkeys-")) {
    throw EvictingServer(eviction_risk(settings, std::string(reply_view(policy->element[1]))) +
                         ", or accept the risk with ?eviction=allow (or ?eviction=warn)");
  }
}

// Throws AccessDenied when the reply to hello.commands[index] refuses what the user `needs`.
void check_allowed(const Settings& settings, const Hello& hello, const std::vector<Reply>& replies, std::size_t index,
                   const std::string& needs) {
  const auto* reply = replies[index].get();
  if (auto error = reply_error(settings, hello.commands[index].front(), reply)) {
    try {
      std::rethrow_exception(error);
    } catch (const AccessDenied&) {
      throw AccessDenied("redis at " + settings.description + " does not let " + user_of(settings) + " " + needs +
                         ": " + redacted(settings, reply_view(reply)));
    }
  }
}

// The credentials, the database, the run_id and (with sentinels) the role, from the replies.
void read_identity(const Settings& settings, const Hello& hello, const std::vector<Reply>& replies, Opened& opened) {
  for (std::size_t i = 0; i < hello.info_at; ++i) {
    if (hello.commands[i].front() == "AUTH") {
      if (auto error = credentials_refused(settings, replies[i].get())) std::rethrow_exception(error);
    }
    check_allowed(settings, hello, replies, i, "select database " + std::to_string(settings.db));
  }
  if (is_error(replies[hello.info_at].get(), "NOAUTH")) {
    throw AccessDenied("redis at " + settings.description + " requires a password, and " +
                       (settings.password.empty() ? "none was given (redis://:PASSWORD@HOST:PORT)"
                                                  : "the one given did not authenticate"));
  }
  // INFO may be refused to a restricted user: the run_id is then unknown, which is no error.
  if (const auto* info_reply = replies[hello.info_at].get(); !is_error(info_reply, "NOPERM")) {
    check_allowed(settings, hello, replies, hello.info_at, "run INFO");
    const auto info = reply_view(info_reply);
    const auto at = info.find("run_id:");
    if (info_reply->type != REDIS_REPLY_STRING || at == std::string::npos) {
      throw BackendUnavailable("the server at " + settings.description + " does not look like Redis (no run_id)");
    }
    opened.run_id = std::string(info.substr(at + 7, info.find_first_of("\r\n", at) - at - 7));
  }
  if (!settings.sentinel()) return;
  // The sentinels may name a server that has just been demoted (their view lags a failover):
  // only a primary will do.
  check_allowed(settings, hello, replies, hello.role_at, "run ROLE");
  const auto* role = replies[hello.role_at].get();
  const auto first =
      role && role->type == REDIS_REPLY_ARRAY && role->elements > 0 ? reply_view(role->element[0]) : std::string_view();
  if (first != "master") {
    throw BackendUnavailable("redis at " + settings.description +
                             ", named by the sentinels, is not a primary (ROLE: " + redacted(settings, first) + ")");
  }
}

// A command connection's part: the policy, the scripts' SHA1s and the permission probes.
void read_script_checks(const Settings& settings, const Hello& hello, const std::vector<Reply>& replies,
                        const std::vector<const Script*>& scripts, Opened& opened) {
  if (hello.policy_at) check_policy(settings, replies[hello.policy_at].get());
  for (std::size_t i = hello.scripts_at; i < hello.scripts_at + scripts.size(); ++i) {
    check_allowed(settings, hello, replies, i, "run scripts");
    if (replies[i]->type != REDIS_REPLY_STRING) {
      throw BackendUnavailable("the server at " + settings.description + " answered SCRIPT LOAD oddly");
    }
    opened.shas.emplace_back(reply_view(replies[i].get()));
  }
  const auto probes = hello.scripts_at + scripts.size();
  check_allowed(settings, hello, replies, probes, "publish on turnstile's channels (turnstile:*)");
  check_allowed(settings, hello, replies, probes + 1, "publish on PermitCounter's channels (redisson_sc:*)");
  // On a cluster node that does not serve the probe's slot, MOVED says the script was not run:
  // its permissions are checked by the node that serves it.
  if (!settings.cluster() ||
      !(is_error(replies[probes + 2].get(), "MOVED") || is_error(replies[probes + 2].get(), "ASK"))) {
    check_allowed(settings, hello, replies, probes + 2, "read and write turnstile's keys (turnstile:*) from scripts");
  }
  for (std::size_t i = probes + 3; i < probes + 7; ++i) {
    check_allowed(settings, hello, replies, i, "subscribe to turnstile's channels (turnstile:*, redisson_sc:*)");
    const auto* reply = replies[i].get();
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 3 || reply->element[0]->type != REDIS_REPLY_STRING) {
      throw BackendUnavailable("the server at " + settings.description + " answered (UN)SUBSCRIBE oddly");
    }
  }
}

// Asks the sentinels, each in turn, for the address of the primary of settings.master_name; every
// sentinel gets its share of the time left until `until` (at least kSentinelShare), so one that
// hangs does not use up the others' time. Throws AccessDenied when a sentinel refuses
// sentinel_password, BackendUnavailable when none answers with an address.
constexpr milliseconds kSentinelShare{300};

// The share of the time left until `until` of the first of `count` that are asked in turn.
SteadyClock::time_point share_of(SteadyClock::time_point until, std::size_t count) {
  const auto now = SteadyClock::now();
  return std::min(until,
                  now + std::max<SteadyClock::duration>((until - now) / static_cast<long>(count), kSentinelShare));
}

// What one sentinel's reply to get-master-addr-by-name names; nullopt with `why` when nothing.
std::optional<HostPort> read_master_address(const Settings& settings, const Settings& probe, const redisReply* reply,
                                            std::string& why) {
  if (reply->type == REDIS_REPLY_ERROR) {
    if (auto error = sentinel_refused(probe, "SENTINEL get-master-addr-by-name", reply)) std::rethrow_exception(error);
    why = redacted(probe, reply_view(reply));
    return std::nullopt;
  }
  if (reply->type == REDIS_REPLY_NIL) {
    why = "knows no master named '" + redacted(settings, settings.master_name) + "'";
    return std::nullopt;
  }
  int port = 0;
  if (reply->type == REDIS_REPLY_ARRAY && reply->elements == 2 && reply->element[0]->type == REDIS_REPLY_STRING &&
      reply->element[1]->type == REDIS_REPLY_STRING) {
    const auto text = reply_view(reply->element[1]);
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), port);
    if (error == std::errc() && end == text.data() + text.size() && port > 0 && port <= 65535 &&
        valid_host(reply_view(reply->element[0]))) {
      return HostPort{std::string(reply_view(reply->element[0])), port};
    }
  }
  why = "answered get-master-addr-by-name oddly";
  return std::nullopt;
}

// Asks one sentinel, by `by`: the primary's address, or nullopt with `why`.
std::optional<HostPort> ask_sentinel(const Settings& settings, const SentinelAddress& sentinel,
                                     SteadyClock::time_point by, int cancel_fd, std::string& why) {
  Settings probe;  // messages and redaction for this sentinel
  probe.host = sentinel.host;
  probe.port = sentinel.port;
  probe.description = "sentinel " + sentinel.description;
  probe.password = settings.sentinel_password;
  probe.sentinel_password = settings.password;
  const int fd = connect_socket(probe, by, cancel_fd);
  Context context(redisConnectFd(fd));
  if (!context) {
    close(fd);
    why = "out of memory";
    return std::nullopt;
  }
  context->flags &= ~REDIS_BLOCK;
  bound_replies(context.get());
  std::vector<Command> commands;
  if (!settings.sentinel_password.empty()) commands.push_back({"AUTH", settings.sentinel_password});
  commands.push_back({"SENTINEL", "get-master-addr-by-name", settings.master_name});
  std::vector<Reply> replies;
  if (why = exchange(context.get(), commands, replies, by, cancel_fd); !why.empty()) {
    if (why == "cancelled") throw BackendUnavailable("asking the sentinels was cancelled");
    return std::nullopt;
  }
  if (!settings.sentinel_password.empty()) {
    if (auto error = sentinel_refused(probe, "the sentinel password", replies.front().get()))
      std::rethrow_exception(error);
  }
  return read_master_address(settings, probe, replies.back().get(), why);
}

constexpr milliseconds kNodeHelloShare{500};

// A cluster's subscriber connection: any node will do (PUBLISH reaches every node). Each seed in
// turn, each with its share of the time left.
Opened open_any_seed(const Settings& given, const Wait& wait, const std::vector<const Script*>* scripts,
                     int cancel_fd) {
  std::string failures;
  const auto until = wait.connect_until();
  for (std::size_t i = 0; i < given.cluster_seeds.size(); ++i) {
    const auto& seed = given.cluster_seeds[i];
    Settings node = given;
    node.host = seed.host;
    node.port = seed.port;
    node.description = seed.description;
    if (SteadyClock::now() >= until) break;
    Wait share = wait;
    share.until = share_of(until, given.cluster_seeds.size() - i);
    // A node that does not answer (SIGSTOPped, a dead link) holds up the others for as long as
    // a healthy one takes at most; the last gets all that is left.
    if (i + 1 < given.cluster_seeds.size()) share.until = std::min(share.until, SteadyClock::now() + kNodeHelloShare);
    try {
      return open_context(node, share, scripts, cancel_fd);
    } catch (const AccessDenied&) {
      throw;
    } catch (const BackendUnavailable& error) {
      if (std::string_view(error.what()).ends_with("cancelled")) throw;
      failures += (failures.empty() ? "" : "; ") + std::string(error.what());
    }
  }
  throw BackendUnavailable("no node of " + given.description + " answered: " + failures);
}

// With sentinels: the settings of the primary they name now.
Settings primary_settings(const Settings& given, const Wait& wait, int cancel_fd) {
  // Connection loss, a READONLY reply or a demotion all end up here: ask again every time.
  const auto primary = ask_sentinels(given, wait.connect_until(), cancel_fd);
  Settings found = given;
  found.host = primary.host.starts_with('[') ? primary.host.substr(1, primary.host.size() - 2) : primary.host;
  found.port = primary.port;
  found.description =
      primary.host + ":" + std::to_string(primary.port) + " (the primary of '" + given.master_name + "')";
  return found;
}

}  // namespace

HostPort ask_sentinels(const Settings& settings, SteadyClock::time_point until, int cancel_fd) {
  std::string failures;
  const auto count = settings.sentinels.size();
  for (std::size_t i = 0; i < count; ++i) {
    const auto& sentinel = settings.sentinels[i];
    if (SteadyClock::now() >= until) {
      failures += (failures.empty() ? "" : "; ") + std::string("no time left for the others");
      break;
    }
    std::string why;
    try {
      if (auto address = ask_sentinel(settings, sentinel, share_of(until, count - i), cancel_fd, why)) return *address;
    } catch (const AccessDenied&) {
      throw;
    } catch (const BackendUnavailable& error) {
      if (std::string_view(error.what()).ends_with("cancelled")) throw;
      why = error.what();
    }
    failures += (failures.empty() ? "" : "; ") + sentinel.description + ": " + why;
  }
  throw BackendUnavailable("no sentinel named the primary of '" + redacted(settings, settings.master_name) +
                           "': " + failures);
}

// Sends hello.commands[from, to) and appends their replies to `replies` (indexed as the
// commands are).
void send_part(const Settings& settings, redisContext* context, const Hello& hello, std::size_t from, std::size_t to,
               std::vector<Reply>& replies, const Wait& wait, int cancel_fd) {
  const std::vector<Command> part(hello.commands.begin() + static_cast<std::ptrdiff_t>(from),
                                  hello.commands.begin() + static_cast<std::ptrdiff_t>(to));
  std::vector<Reply> answered;
  if (const auto why = exchange(context, part, answered, wait.reply_until(), cancel_fd); !why.empty()) {
    if (context->err == REDIS_ERR_PROTOCOL) {
      throw BackendUnavailable("the server at " + settings.description + " does not speak the Redis protocol");
    }
    throw BackendUnavailable("redis at " + settings.description + " did not answer: " + why);
  }
  for (auto& reply : answered) replies.push_back(std::move(reply));
}

Opened open_context(const Settings& given, const Wait& wait, const std::vector<const Script*>* scripts, int cancel_fd) {
  if (given.cluster() && given.host.empty()) return open_any_seed(given, wait, scripts, cancel_fd);
  const Settings settings = given.sentinel() ? primary_settings(given, wait, cancel_fd) : given;
  Opened opened;
  opened.address = settings.host + ":" + std::to_string(settings.port);
  const int fd = connect_socket(settings, wait.connect_until(), cancel_fd);
  opened.context.reset(redisConnectFd(fd));
  if (!opened.context) {
    close(fd);
    throw BackendUnavailable("cannot connect to redis at " + settings.description + ": out of memory");
  }
  auto* context = opened.context.get();
  context->flags &= ~REDIS_BLOCK;  // we wait in poll(), with deadlines, never in read()/write()
  bound_replies(context);
  redisEnableKeepAlive(context);
  const auto hello = hello_commands(settings, context, scripts);
  // In two parts: Redis 7 closes a connection that sends a bulk over 16 KiB before it is
  // authenticated (the scripts' SCRIPT LOAD), which turned a wrong or missing password into
  // "connection reset". So the credentials, the database and INFO are answered (and a refusal
  // told as AccessDenied) before the scripts go: one more round trip on a command connection.
  std::vector<Reply> replies;
  send_part(settings, context, hello, 0, hello.scripts_at, replies, wait, cancel_fd);
  read_identity(settings, hello, replies, opened);
  if (scripts) {
    send_part(settings, context, hello, hello.scripts_at, hello.commands.size(), replies, wait, cancel_fd);
    read_script_checks(settings, hello, replies, *scripts, opened);
  }
  opened.server = opened.address + " " + opened.run_id;
  return opened;
}

}  // namespace turnstile::detail::redis
