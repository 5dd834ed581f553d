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

constexpr auto kFirstBackoff = milliseconds(50);

// Probes of the permissions the backend needs, run at connect. The empty hash tag `{}` is no
// name's (names are never empty), so nothing real is touched or woken.
constexpr std::string_view kProbeKey = "turnstile:{}:access-check";
constexpr std::string_view kProbeQueueChannel = "turnstile:{}:access-check";
constexpr std::string_view kProbeCounterChannel = "redisson_sc:{}:access-check";
// Reads and writes (a DEL of a key that never exists) one key of turnstile's key space.
constexpr std::string_view kProbeScript = "redis.call('EXISTS', KEYS[1]) redis.call('DEL', KEYS[1]) return 1";

std::string_view reply_view(const redisReply* reply) {
  return reply && reply->str ? std::string_view(reply->str, reply->len) : std::string_view();
}

bool is_error(const redisReply* reply, std::string_view code) {
  if (!reply || reply->type != REDIS_REPLY_ERROR) return false;
  const auto text = reply_view(reply);
  return text.substr(0, code.size()) == code && (text.size() == code.size() || text[code.size()] == ' ');
}

// hiredis 0.14 builds replies of any size the server announces (an array header allocates its
// element table at once). These wrap its default builders and refuse a reply that would take
// more than kMaxReplyBytes; the reader then fails and the connection is dropped.
struct ReplyBudget {
  std::size_t used = 0;
  bool exceeded = false;
};

const redisReplyObjectFunctions* default_functions() {
  static const redisReplyObjectFunctions* const functions = [] {
    redisReader* reader = redisReaderCreate();
    const auto* found = reader ? reader->fn : nullptr;  // hiredis' static default table
    if (reader) redisReaderFree(reader);
    return found;
  }();
  return functions;
}

bool charge(const redisReadTask* task, std::size_t bytes) {
  auto* budget = static_cast<ReplyBudget*>(task->privdata);
  if (!budget) return true;
  if (bytes > kMaxReplyBytes || budget->used > kMaxReplyBytes - bytes) {
    budget->exceeded = true;
    return false;
  }
  budget->used += bytes;
  return true;
}

void* bounded_string(const redisReadTask* task, char* text, size_t length) {
  if (!charge(task, sizeof(redisReply) + length)) return nullptr;
  return default_functions()->createString(task, text, length);
}
void* bounded_array(const redisReadTask* task, int elements) {
  if (elements < 0 || !charge(task, sizeof(redisReply) + static_cast<std::size_t>(elements) * sizeof(redisReply*))) {
    return nullptr;
  }
  return default_functions()->createArray(task, elements);
}
void* bounded_integer(const redisReadTask* task, long long value) {
  if (!charge(task, sizeof(redisReply))) return nullptr;
  return default_functions()->createInteger(task, value);
}
void* bounded_nil(const redisReadTask* task) {
  if (!charge(task, sizeof(redisReply))) return nullptr;
  return default_functions()->createNil(task);
}

redisReplyObjectFunctions bounded_functions{bounded_string, bounded_array, bounded_integer, bounded_nil, freeReplyObject};

void bound_replies(redisContext* context) {
  if (!default_functions()) return;  // cannot happen with hiredis 0.14; unbounded rather than broken
  context->reader->fn = &bounded_functions;
  context->reader->privdata = new ReplyBudget;
}

ReplyBudget* budget_of(redisContext* context) {
  return context->reader && context->reader->fn == &bounded_functions ? static_cast<ReplyBudget*>(context->reader->privdata)
                                                                        : nullptr;
}

void set_error(redisContext* context, int code, const std::string& text) {
  context->err = code;
  std::snprintf(context->errstr, sizeof context->errstr, "%s", text.c_str());
}

std::string too_large() {
  return "a reply larger than " + std::to_string(kMaxReplyBytes >> 20) + " MiB (refused)";
}

// Waits until `fd` has one of `events` (or an error/hangup), by `until`. False, with `why`, on
// timeout or when `cancel_fd` became readable.
bool wait_for(int fd, short events, SteadyClock::time_point until, int cancel_fd, std::string& why) {
  for (;;) {
    pollfd fds[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int timeout = poll_timeout(until);
    const int ready = poll(fds, cancel_fd >= 0 ? 2 : 1, timeout);
    if (ready < 0) {
      if (errno == EINTR) continue;
      why = std::string("poll failed: ") + std::strerror(errno);
      return false;
    }
    if (cancel_fd >= 0 && fds[1].revents) {
      why = "cancelled";
      return false;
    }
    if (fds[0].revents) return true;
    if (timeout == 0 || SteadyClock::now() >= until) {
      why = "no answer in time";
      return false;
    }
  }
}

// A non-blocking, close-on-exec TCP connection to host:port, made by `until`.
int connect_socket(const Settings& settings, SteadyClock::time_point until, int cancel_fd) {
  const auto fail = [&](const std::string& why) -> BackendUnavailable {
    return BackendUnavailable("cannot connect to redis at " + settings.description + ": " + why);
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const auto port = std::to_string(settings.port);
  if (const int error = getaddrinfo(settings.host.c_str(), port.c_str(), &hints, &found); error != 0) {
    throw fail(gai_strerror(error));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, freeaddrinfo);
  std::string why = "no address";
  for (const auto* address = found; address; address = address->ai_next) {
    // Close-on-exec from the start: no window in which a fork+exec elsewhere inherits it.
    const int fd = socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, address->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int error = 0;
    if (connect(fd, address->ai_addr, address->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        if (!wait_for(fd, POLLOUT, until, cancel_fd, why)) {
          close(fd);
          if (why == "cancelled") throw fail(why);
          why = "no answer within the connect timeout";
          continue;
        }
        socklen_t length = sizeof error;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      }
    }
    if (error != 0) {
      why = std::strerror(error);
      close(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  throw fail(why);
}

}  // namespace

int poll_timeout(SteadyClock::time_point until) {
  if (until == SteadyClock::time_point::max()) return -1;
  const auto left = std::chrono::ceil<milliseconds>(until - SteadyClock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
}

void ContextDeleter::operator()(redisContext* context) const {
  auto* budget = budget_of(context);
  redisFree(context);
  delete budget;
}

StopFd::StopFd(std::stop_token stop) {
  if (!stop.stop_possible()) return;
  fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd_ < 0) throw BackendUnavailable(std::string("eventfd failed: ") + std::strerror(errno));
  callback_.emplace(std::move(stop), Signal{fd_});  // runs at once when already requested
}

StopFd::~StopFd() {
  callback_.reset();  // waits for a callback running on another thread
  if (fd_ >= 0) close(fd_);
}

void StopFd::Signal::operator()() const noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(fd, &one, sizeof one);
}

Wait::Wait(Deadline deadline, std::stop_token stop_token, int cancel)
    : start(SteadyClock::now()),
      try_once(deadline && *deadline <= start),
      until(!deadline ? SteadyClock::time_point::max() : try_once ? start + kReplyTimeout : *deadline),
      stop(std::move(stop_token)),
      cancel_fd(cancel) {}

SteadyClock::time_point Wait::connect_until() const { return std::min(until, SteadyClock::now() + kConnectTimeout); }
SteadyClock::time_point Wait::reply_until() const { return std::min(until, SteadyClock::now() + kReplyTimeout); }

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  // url.text is already redacted (no password); messages name only it.
  Settings settings;
  if (options.connect_timeout.count() > 0) settings.connect_by = SteadyClock::now() + options.connect_timeout;
  if (url.scheme == "rediss" || url.scheme == "rediss+sentinel" || url.scheme == "rediss+cluster") {
    throw BackendNotBuilt(url.scheme + ":// (TLS) needs a hiredis with TLS, which Debian 12's 0.14 lacks");
  }
  // getaddrinfo takes an IPv6 address without its URL brackets.
  const auto unbracketed = [](const std::string& host) {
    return host.starts_with('[') ? host.substr(1, host.size() - 2) : host;
  };
  const bool sentinel = url.scheme == "redis+sentinel";
  const bool cluster = url.scheme == "redis+cluster";
  if (cluster) {
    if (url.hosts.empty()) throw InvalidUrl("redis+cluster:// URLs name at least one node host:port, got '" + url.text + "'");
    if (!url.path.empty() && url.path != "/") {
      throw InvalidUrl("redis+cluster:// URLs name no database (a cluster has only database 0), got '" + url.text + "'");
    }
    std::string names;
    for (const auto& host : url.hosts) {
      const auto endpoint = parse_host_port(host, 6379, url);
      settings.cluster_seeds.push_back({unbracketed(endpoint.host), endpoint.port, endpoint.host + ":" + std::to_string(endpoint.port)});
      names += (names.empty() ? "" : ",") + settings.cluster_seeds.back().description;
    }
    settings.host.clear();
    settings.port = 0;
    settings.description = "the redis cluster of " + names;
  } else if (sentinel) {
    if (url.hosts.empty()) throw InvalidUrl("redis+sentinel:// URLs name at least one sentinel host:port, got '" + url.text + "'");
    for (const auto& host : url.hosts) {
      const auto endpoint = parse_host_port(host, 26379, url);
      settings.sentinels.push_back({unbracketed(endpoint.host), endpoint.port, endpoint.host + ":" + std::to_string(endpoint.port)});
    }
    settings.master_name = url.path.empty() ? std::string() : url.path.substr(1);
    if (settings.master_name.empty() || settings.master_name.find('/') != std::string::npos ||
        std::any_of(settings.master_name.begin(), settings.master_name.end(),
                    [](char c) { return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f; })) {
      throw InvalidUrl("redis+sentinel:// URLs end in /MASTERNAME (one segment, no spaces or control characters), got '" +
                       url.text + "'");
    }
    settings.host.clear();
    settings.port = 0;
    std::string names;
    for (const auto& address : settings.sentinels) names += (names.empty() ? "" : ",") + address.description;
    settings.description = "the primary of '" + settings.master_name + "' (sentinels " + names + ")";
  } else {
    if (url.hosts.size() != 1) {
      throw InvalidUrl("redis:// URLs name exactly one host:port, got '" + url.text + "'");
    }
    const auto endpoint = parse_host_port(url.hosts.front(), 6379, url);
    settings.host = unbracketed(endpoint.host);
    settings.port = endpoint.port;
    settings.description = endpoint.host + ":" + std::to_string(settings.port);
  }
  settings.user = url.user;
  settings.password = url.password;
  if (!url.user.empty() && url.password.empty()) {
    // redis://secret@host is a password alone, as redis-cli -u reads it.
    settings.password = url.user;
    settings.user.clear();
  }
  if (!sentinel && !cluster && !url.path.empty() && url.path != "/") {
    const auto db_text = url.path.substr(1);
    const auto [end, error] = std::from_chars(db_text.data(), db_text.data() + db_text.size(), settings.db);
    if (error != std::errc() || end != db_text.data() + db_text.size() || settings.db < 0) {
      throw InvalidUrl("bad database number '" + db_text + "' in '" + url.text + "'");
    }
  }
  for (const auto& [key, value] : url.query) {
    if (key == "ttl") {
      settings.ttl = parse_seconds("ttl", value, 0.3, 86400);
    } else if (key == "min_replicas") {
      int n = -1;
      const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (error != std::errc() || end != value.data() + value.size() || n < 0 || n > kMaxMinReplicas) {
        throw InvalidUrl("bad min_replicas=" + value + " in '" + url.text + "' (expected a whole number from 0 to " +
                         std::to_string(kMaxMinReplicas) + ")");
      }
      settings.min_replicas = n;
    } else if (key == "sentinel_password" && sentinel) {
      if (value.empty()) throw InvalidUrl("empty sentinel_password in '" + url.text + "'");
      settings.sentinel_password = value;
    } else {
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl, min_replicas" +
                       (sentinel ? ", sentinel_password" : "") + ")");
    }
  }
  if (options.ttl.count() > 0) {
    check_ttl_option(options.ttl, 0.3);
    settings.ttl = options.ttl;
  }
  return settings;
}

std::string redacted(const Settings& settings, std::string_view text) {
  constexpr std::size_t kMaxShown = 300;
  std::string out(text.substr(0, kMaxShown));
  for (const auto* secret : {&settings.password, &settings.sentinel_password}) {
    if (secret->empty()) continue;
    for (auto at = out.find(*secret); at != std::string::npos; at = out.find(*secret, at + 3)) {
      out.replace(at, secret->size(), "***");
    }
  }
  for (auto& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  }
  if (text.size() > kMaxShown) out += "...";
  return out;
}

namespace {
std::string user_of(const Settings& settings) {
  return settings.user.empty() ? std::string("the default user") : "user '" + redacted(settings, settings.user) + "'";
}
}  // namespace

std::exception_ptr reply_error(const Settings& settings, const std::string& call, const redisReply* reply) {
  if (!reply) return nullptr;
  if (reply->type == REDIS_REPLY_ARRAY) {
    for (std::size_t i = 0; i < reply->elements; ++i) {
      if (auto error = reply_error(settings, call, reply->element[i])) return error;
    }
    return nullptr;
  }
  if (reply->type != REDIS_REPLY_ERROR) return nullptr;
  const auto text = reply_view(reply);
  const auto message = "redis at " + settings.description + " refused " + call + ": " + redacted(settings, text);
  // Redis 7.0 reports an ACL refusal inside a script as "ERR The user executing the script can't ...".
  if (is_error(reply, "NOPERM") || is_error(reply, "NOAUTH") || is_error(reply, "WRONGPASS") ||
      text.find("The user executing the script can't") != std::string_view::npos) {
    const auto who = user_of(settings);
    return std::make_exception_ptr(AccessDenied(message + " (as " + who + ")"));
  }
  if (is_error(reply, "MOVED") || is_error(reply, "ASK")) {
    // "MOVED 3999 127.0.0.1:6381"; an address without a host (":6381") is on the same host.
    const bool ask = is_error(reply, "ASK");
    const auto rest = text.substr(ask ? 4 : 6);
    const auto kind = ask ? Redirected::Kind::ask : Redirected::Kind::moved;
    const auto space = rest.find(' ');
    int slot = -1;
    std::from_chars(rest.data(), rest.data() + std::min(space, rest.size()), slot);
    auto address = space == std::string_view::npos ? std::string() : std::string(rest.substr(space + 1));
    if (address.starts_with(':')) address = settings.host + address;
    if (slot >= 0 && slot < 16384 && address.find(':') != std::string::npos) {
      return std::make_exception_ptr(Redirected(message, kind, slot, address));
    }
  }
  if (is_error(reply, "CLUSTERDOWN") || is_error(reply, "TRYAGAIN")) {
    return std::make_exception_ptr(Redirected(message, Redirected::Kind::again, -1, ""));
  }
  // OOM, READONLY, MASTERDOWN, CLUSTERDOWN, MOVED, ASK, BUSY, MISCONF, LOADING, script errors:
  // the server cannot do it now; the caller's retry or keep-alive policy decides.
  return std::make_exception_ptr(BackendUnavailable(message));
}

void unexpected_reply(const std::string& call) {
  throw BackendUnavailable("redis answered " + call + " with an unexpected reply");
}

long long integer_at(const redisReply* reply, std::size_t index) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements <= index) unexpected_reply("a script");
  const auto* element = reply->element[index];
  if (element->type == REDIS_REPLY_INTEGER) return element->integer;
  long long value = 0;
  if (element->type == REDIS_REPLY_STRING) {
    const auto [end, error] = std::from_chars(element->str, element->str + element->len, value);
    if (error == std::errc() && end == element->str + element->len) return value;
  }
  unexpected_reply("a script");
}

std::uint64_t token_at(const redisReply* reply, std::size_t index) {
  const auto value = integer_at(reply, index);
  if (value < 1 || value > kMaxToken) {
    throw BackendUnavailable("redis answered a script with an impossible fencing token " + std::to_string(value));
  }
  return static_cast<std::uint64_t>(value);
}

std::string string_at(const redisReply* reply, std::size_t index) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements <= index) return {};
  const auto* element = reply->element[index];
  return element->str ? std::string(element->str, element->len) : std::string();
}

long long integer_of(const Reply& reply) {
  if (!reply || reply->type != REDIS_REPLY_INTEGER) unexpected_reply("a script");
  return reply->integer;
}

Reply Result::take() {
  if (error) std::rethrow_exception(error);
  return std::move(reply);
}

bool append_command(std::string& out, const Command& command) {
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const auto& arg : command) {
    argv.push_back(arg.data());
    lengths.push_back(arg.size());
  }
  char* formatted = nullptr;
  const int length = redisFormatCommandArgv(&formatted, static_cast<int>(argv.size()), argv.data(), lengths.data());
  if (length < 0 || !formatted) return false;
  out.append(formatted, static_cast<std::size_t>(length));
  redisFreeCommand(formatted);
  return true;
}

bool write_pending(redisContext* context, std::string& out) {
  // Our own send(): hiredis' write() raises SIGPIPE on a connection the peer closed, which
  // would kill the process (turnstile leaves signal dispositions to the application).
  if (out.empty()) return true;
  const auto written = send(context->fd, out.data(), out.size(), MSG_NOSIGNAL);
  if (written < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
    set_error(context, REDIS_ERR_IO, std::strerror(errno));
    return false;
  }
  out.erase(0, static_cast<std::size_t>(written));
  return true;
}

bool read_available(redisContext* context) {
  const auto* reader = context->reader;
  if (reader->len - reader->pos > kMaxReplyBytes) {
    set_error(context, REDIS_ERR_OTHER, too_large());
    return false;
  }
  return redisBufferRead(context) == REDIS_OK;
}

bool next_reply(redisContext* context, Reply& reply) {
  void* raw = nullptr;
  if (redisGetReplyFromReader(context, &raw) != REDIS_OK) {
    if (auto* budget = budget_of(context); budget && budget->exceeded) set_error(context, REDIS_ERR_OTHER, too_large());
    return false;
  }
  reply.reset(static_cast<redisReply*>(raw));
  if (raw) {
    if (auto* budget = budget_of(context)) budget->used = 0;  // the next reply starts afresh
  }
  return true;
}

std::string exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies,
                     SteadyClock::time_point until, int cancel_fd, bool* sent) {
  if (sent) *sent = false;
  std::string out;
  for (const auto& command : commands) {
    if (!append_command(out, command)) return "out of memory";
  }
  std::string why;
  while (!out.empty()) {
    if (!wait_for(context->fd, POLLOUT, until, cancel_fd, why)) return why;
    const auto before = out.size();
    if (!write_pending(context, out)) return context->errstr;
    if (sent && out.size() < before) *sent = true;
  }
  replies.clear();
  while (replies.size() < commands.size()) {
    Reply reply;
    if (!next_reply(context, reply)) return context->errstr;
    if (reply) {
      replies.push_back(std::move(reply));
      continue;
    }
    if (!wait_for(context->fd, POLLIN, until, cancel_fd, why)) return why;
    if (!read_available(context)) return context->errstr;
  }
  return "";
}

std::string eviction_risk(const Settings& settings, const std::string& policy) {
  return "redis at " + settings.description + " has maxmemory-policy " + policy +
         ": it may evict lock state while it is held (another contender may then get in before "
         "the holder is told its hold is lost); use noeviction or volatile-*";
}

namespace {

// What a new connection sends at once, in one round trip: credentials, database, INFO (for the
// run_id) and, for a command connection, the scripts and the permission probes.
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

// Reads the replies to hello_commands into `opened`; throws AccessDenied for what the user may
// not do, BackendUnavailable for a server that does not answer like Redis.
void read_hello(const Settings& settings, const Hello& hello, const std::vector<Reply>& replies,
                const std::vector<const Script*>* scripts, Opened& opened) {
  const auto who = user_of(settings);
  const auto check = [&](std::size_t index, const std::string& needs) {
    const auto* reply = replies[index].get();
    if (auto error = reply_error(settings, hello.commands[index].front(), reply)) {
      try {
        std::rethrow_exception(error);
      } catch (const AccessDenied&) {
        throw AccessDenied("redis at " + settings.description + " does not let " + who + " " + needs + ": " +
                           redacted(settings, reply_view(reply)));
      }
    }
  };
  for (std::size_t i = 0; i < hello.info_at; ++i) {
    if (hello.commands[i].front() == "AUTH" && replies[i]->type == REDIS_REPLY_ERROR) {
      // WRONGPASS, or a password given to a server that has none: our credentials are wrong.
      throw AccessDenied("redis at " + settings.description + " refused " + who + ": " +
                         redacted(settings, reply_view(replies[i].get())));
    }
    check(i, "select database " + std::to_string(settings.db));
  }
  // INFO may be refused to a restricted user: the run_id is then unknown, which is no error.
  if (const auto* info_reply = replies[hello.info_at].get(); !is_error(info_reply, "NOPERM")) {
    check(hello.info_at, "run INFO");
    const auto info = reply_view(info_reply);
    const auto at = info.find("run_id:");
    if (info_reply->type != REDIS_REPLY_STRING || at == std::string::npos) {
      throw BackendUnavailable("the server at " + settings.description + " does not look like Redis (no run_id)");
    }
    opened.run_id = std::string(info.substr(at + 7, info.find_first_of("\r\n", at) - at - 7));
  }
  if (settings.sentinel()) {
    // The sentinels may name a server that has just been demoted (their view lags a failover):
    // only a primary will do.
    check(hello.role_at, "run ROLE");
    const auto* role = replies[hello.role_at].get();
    const auto first = role && role->type == REDIS_REPLY_ARRAY && role->elements > 0 ? reply_view(role->element[0])
                                                                                      : std::string_view();
    if (first != "master") {
      throw BackendUnavailable("redis at " + settings.description + ", named by the sentinels, is not a primary (ROLE: " +
                               redacted(settings, first) + ")");
    }
  }
  if (!scripts) return;
  if (hello.policy_at) check_policy(settings, replies[hello.policy_at].get());
  for (std::size_t i = hello.scripts_at; i < hello.scripts_at + scripts->size(); ++i) {
    check(i, "run scripts");
    if (replies[i]->type != REDIS_REPLY_STRING) {
      throw BackendUnavailable("the server at " + settings.description + " answered SCRIPT LOAD oddly");
    }
    opened.shas.emplace_back(reply_view(replies[i].get()));
  }
  const auto probes = hello.scripts_at + scripts->size();
  check(probes, "publish on turnstile's channels (turnstile:*)");
  check(probes + 1, "publish on PermitCounter's channels (redisson_sc:*)");
  // On a cluster node that does not serve the probe's slot, MOVED says the script was not run:
  // its permissions are checked by the node that serves it.
  if (!settings.cluster() || !(is_error(replies[probes + 2].get(), "MOVED") || is_error(replies[probes + 2].get(), "ASK"))) {
    check(probes + 2, "read and write turnstile's keys (turnstile:*) from scripts");
  }
  for (std::size_t i = probes + 3; i < probes + 7; ++i) {
    check(i, "subscribe to turnstile's channels (turnstile:*, redisson_sc:*)");
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

}  // namespace

HostPort ask_sentinels(const Settings& settings, SteadyClock::time_point until, int cancel_fd) {
  std::string failures;
  const auto count = settings.sentinels.size();
  for (std::size_t i = 0; i < count; ++i) {
    const auto& sentinel = settings.sentinels[i];
    const auto now = SteadyClock::now();
    if (now >= until) {
      failures += (failures.empty() ? "" : "; ") + std::string("no time left for the others");
      break;
    }
    const auto share = std::max<SteadyClock::duration>((until - now) / static_cast<long>(count - i), kSentinelShare);
    const auto by = std::min(until, now + share);
    Settings probe;  // messages and redaction for this sentinel
    probe.host = sentinel.host;
    probe.port = sentinel.port;
    probe.description = "sentinel " + sentinel.description;
    probe.password = settings.sentinel_password;
    probe.sentinel_password = settings.password;
    const auto failed = [&](const std::string& why) {
      failures += (failures.empty() ? "" : "; ") + sentinel.description + ": " + why;
    };
    try {
      const int fd = connect_socket(probe, by, cancel_fd);
      Context context(redisConnectFd(fd));
      if (!context) {
        close(fd);
        failed("out of memory");
        continue;
      }
      context->flags &= ~REDIS_BLOCK;
      bound_replies(context.get());
      std::vector<Command> commands;
      if (!settings.sentinel_password.empty()) commands.push_back({"AUTH", settings.sentinel_password});
      commands.push_back({"SENTINEL", "get-master-addr-by-name", settings.master_name});
      std::vector<Reply> replies;
      if (const auto why = exchange(context.get(), commands, replies, by, cancel_fd); !why.empty()) {
        if (why == "cancelled") throw BackendUnavailable("asking the sentinels was cancelled");
        failed(why);
        continue;
      }
      if (!settings.sentinel_password.empty() && replies.front()->type == REDIS_REPLY_ERROR) {
        throw AccessDenied("redis " + probe.description + " refused the sentinel password: " +
                           redacted(probe, reply_view(replies.front().get())));
      }
      const auto* reply = replies.back().get();
      if (reply->type == REDIS_REPLY_ERROR) {
        if (is_error(reply, "NOAUTH") || is_error(reply, "NOPERM") || is_error(reply, "WRONGPASS")) {
          throw AccessDenied("redis " + probe.description + " refused SENTINEL get-master-addr-by-name: " +
                             redacted(probe, reply_view(reply)) + " (sentinel_password=)");
        }
        failed(redacted(probe, reply_view(reply)));
        continue;
      }
      if (reply->type == REDIS_REPLY_NIL) {
        failed("knows no master named '" + redacted(settings, settings.master_name) + "'");
        continue;
      }
      int port = 0;
      if (reply->type == REDIS_REPLY_ARRAY && reply->elements == 2 && reply->element[0]->type == REDIS_REPLY_STRING &&
          reply->element[1]->type == REDIS_REPLY_STRING) {
        const auto text = reply_view(reply->element[1]);
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), port);
        if (error == std::errc() && end == text.data() + text.size() && port > 0 && port <= 65535 &&
            valid_host(reply_view(reply->element[0]))) {
          return {std::string(reply_view(reply->element[0])), port};
        }
      }
      failed("answered get-master-addr-by-name oddly");
    } catch (const AccessDenied&) {
      throw;
    } catch (const BackendUnavailable& error) {
      if (std::string_view(error.what()).ends_with("cancelled")) throw;
      failed(error.what());
    }
  }
  throw BackendUnavailable("no sentinel named the primary of '" + redacted(settings, settings.master_name) + "': " + failures);
}

Opened open_context(const Settings& given, const Wait& wait, const std::vector<const Script*>* scripts, int cancel_fd) {
  Opened opened;
  Settings found;
  if (given.sentinel()) {
    // Connection loss, a READONLY reply or a demotion all end up here: ask again every time.
    const auto primary = ask_sentinels(given, wait.connect_until(), cancel_fd);
    found = given;
    found.host = primary.host.starts_with('[') ? primary.host.substr(1, primary.host.size() - 2) : primary.host;
    found.port = primary.port;
    found.description = primary.host + ":" + std::to_string(primary.port) + " (the primary of '" + given.master_name + "')";
  }
  if (given.cluster() && given.host.empty()) {
    // Any node will do (the subscriber's: PUBLISH reaches every node). Each seed in turn, each
    // with its share of the time left.
    std::string failures;
    const auto until = wait.connect_until();
    for (std::size_t i = 0; i < given.cluster_seeds.size(); ++i) {
      const auto& seed = given.cluster_seeds[i];
      Settings node = given;
      node.host = seed.host;
      node.port = seed.port;
      node.description = seed.description;
      Wait share = wait;
      const auto now = SteadyClock::now();
      if (now >= until) break;
      share.until = std::min(until, now + std::max<SteadyClock::duration>((until - now) / static_cast<long>(given.cluster_seeds.size() - i),
                                                                       kSentinelShare));
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
  const Settings& settings = given.sentinel() ? found : given;
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
  std::vector<Reply> replies;
  if (const auto why = exchange(context, hello.commands, replies, wait.reply_until(), cancel_fd); !why.empty()) {
    if (context->err == REDIS_ERR_PROTOCOL) {
      throw BackendUnavailable("the server at " + settings.description + " does not speak the Redis protocol");
    }
    throw BackendUnavailable("redis at " + settings.description + " did not answer: " + why);
  }
  read_hello(settings, hello, replies, scripts, opened);
  opened.server = opened.address + " " + opened.run_id;
  return opened;
}

struct Connection::Link {
  Context context;
  std::string server;  // Opened::server
  std::uint64_t generation = 0;
  SteadyClock::time_point last_reply{};
  bool used = false;  // completed a call
};

namespace {

// True when an idle link's socket shows nothing: anything readable on a request/response
// connection between calls is an EOF (Redis' `timeout`, a restart), a reset, or garbage.
bool looks_alive(const redisContext* context) {
  pollfd pfd{context->fd, POLLIN | POLLRDHUP, 0};
  int ready;
  do {
    ready = poll(&pfd, 1, 0);
  } while (ready < 0 && errno == EINTR);
  return ready == 0;
}

}  // namespace

Connection::Connection(Settings settings, std::vector<const Script*> scripts,
                       std::function<void(const std::string&)> on_server_changed,
                       std::chrono::milliseconds max_backoff, bool connect_now)
    : settings_(std::move(settings)),
      scripts_(std::move(scripts)),
      on_server_changed_(std::move(on_server_changed)),
      max_backoff_(std::max(max_backoff, kFirstBackoff)) {
  if (!connect_now) return;
  // One attempt: Client::connect reports a bad URL, password or ACL at once.
  Wait wait(SteadyClock::now());
  if (settings_.connect_by) wait.until = *settings_.connect_by;
  ++links_;
  std::unique_ptr<Link> link;
  try {
    link = open_link(wait);
  } catch (...) {
    --links_;
    throw;
  }
  checkin(std::move(link));
}

Connection::~Connection() = default;

bool Connection::wait_returned(std::unique_lock<std::mutex>& lock, SteadyClock::time_point until,
                               const std::stop_token& stop) {
  const auto seen = returns_;
  const auto returned = [&] { return returns_ != seen; };
  if (until == SteadyClock::time_point::max()) return returned_.wait(lock, stop, returned);
  return returned_.wait_until(lock, stop, until, returned);
}

void Connection::notify_returned() {
  ++returns_;
  returned_.notify_all();
}

std::unique_ptr<Connection::Link> Connection::open_link(const Wait& wait) {
  auto opened = open_context(settings_, wait, &scripts_, wait.cancel_fd);
  auto link = std::make_unique<Link>();
  link->context = std::move(opened.context);
  link->server = opened.server;
  link->last_reply = SteadyClock::now();
  bool changed = false;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (shas_.empty()) shas_ = std::move(opened.shas);  // the first link's; SHA1s never change
    // Another boot of the server (run_id; unknown when INFO is refused), or with sentinels
    // another server altogether.
    if (!opened.run_id.empty() || settings_.sentinel()) {
      changed = !server_.empty() && opened.server != server_;
      server_ = opened.server;
    }
    if (changed) {
      ++generation_;
      // Idle links lead to the server we knew: gone.
      links_ -= static_cast<int>(idle_.size());
      stale.swap(idle_);
    }
    link->generation = generation_;
  }
  stale.clear();
  if (changed && on_server_changed_) on_server_changed_(link->server);
  return link;
}

std::unique_ptr<Connection::Link> Connection::checkout(const Wait& wait) {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (wait.stop.stop_requested()) {
      throw BackendUnavailable("the call to redis at " + settings_.description + " was cancelled (stop requested)");
    }
    if (!idle_.empty()) {
      auto link = std::move(idle_.back());  // the most recently used: the least likely to be stale
      idle_.pop_back();
      lock.unlock();
      if (looks_alive(link->context.get())) return link;
      link.reset();
      lock.lock();
      --links_;
      continue;
    }
    if (links_ < kMaxLinks) {
      if (SteadyClock::now() < next_attempt_) {
        if (wait.try_once || wait.until < next_attempt_) {
          throw BackendUnavailable("redis at " + settings_.description + " is unreachable (reconnecting)");
        }
        wait_returned(lock, next_attempt_, wait.stop);
        continue;
      }
      ++links_;
      lock.unlock();
      try {
        return open_link(wait);
      } catch (const AccessDenied&) {
        lock.lock();
        --links_;
        notify_returned();
        throw;
      } catch (const EvictingServer&) {
        lock.lock();
        --links_;
        notify_returned();
        throw;
      } catch (const BackendUnavailable&) {
        lock.lock();
        --links_;
        if (!wait.stop.stop_requested()) {  // a cancelled attempt says nothing of the server
          backoff_ = std::clamp(backoff_ * 2, kFirstBackoff, max_backoff_);
          next_attempt_ = SteadyClock::now() + backoff_;
        }
        notify_returned();
        if (wait.try_once || wait.until < next_attempt_ || wait.stop.stop_requested()) throw;
        continue;
      } catch (...) {
        lock.lock();
        --links_;
        notify_returned();
        throw;
      }
    }
    // Every link is busy with another call: wait for one, within our own deadline.
    if (!wait_returned(lock, wait.until, wait.stop) && !wait.stop.stop_requested() && idle_.empty() &&
        links_ >= kMaxLinks) {
      throw BackendUnavailable("every connection to redis at " + settings_.description + " stayed busy until the deadline");
    }
  }
}

void Connection::checkin(std::unique_ptr<Link> link) {
  std::lock_guard lock(mutex_);
  if (link->used) backoff_ = milliseconds(0);
  if (link->generation != generation_) {
    --links_;
  } else {
    idle_.push_back(std::move(link));
  }
  notify_returned();
}

void Connection::discard(std::unique_ptr<Link> link, bool fresh) {
  link.reset();
  std::lock_guard lock(mutex_);
  --links_;
  if (fresh) {
    // A connection that fails before completing a call counts as a failed attempt: no
    // reconnect storm against a server that accepts and then drops us.
    backoff_ = std::clamp(backoff_ * 2, kFirstBackoff, max_backoff_);
    next_attempt_ = SteadyClock::now() + backoff_;
  }
  notify_returned();
}

void Connection::follow(const std::string& server) {
  if (!settings_.sentinel()) return;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (server_.empty() || server_ == server) return;
    server_ = server;
    ++generation_;  // busy links are dropped when they come back
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
}

bool Connection::primary_moved(const std::string& address) {
  if (!settings_.sentinel()) return false;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (server_.empty() || server_.substr(0, server_.find(' ')) == address) return false;
    ++generation_;
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
  return true;
}

void Connection::forget_idle() {
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
}

std::vector<Reply> Connection::run(const std::vector<Command>& commands, const Wait& wait, bool retry,
                                   std::string* server, const FollowUp* follow_up, Reply* follow_reply, bool asking) {
  std::vector<Command> asked;
  if (asking) {
    asked.push_back({"ASKING"});
    asked.insert(asked.end(), commands.begin(), commands.end());
  }
  for (;;) {
    auto link = checkout(wait);  // throws once a stop is requested
    if (!retry && SteadyClock::now() - link->last_reply >= kIdleProbe) {
      // What must not be resent is written only to a connection just shown alive: one the
      // server closed (`timeout`) or a NAT dropped while idle fails this PING instead, and the
      // call goes out on a new connection rather than reporting an unknown outcome.
      std::vector<Reply> pong;
      if (const auto why = exchange(link->context.get(), std::vector<Command>{Command{"PING"}}, pong, wait.reply_until(),
                                    wait.cancel_fd);
          !why.empty()) {
        discard(std::move(link), false);
        if (wait.expired()) {
          throw BackendUnavailable("redis at " + settings_.description + " did not answer (" + why + "); nothing was sent");
        }
        continue;
      }
      link->last_reply = SteadyClock::now();
    }
    bool sent = false;
    std::vector<Reply> replies;
    const auto why = exchange(link->context.get(), asking ? asked : commands, replies, wait.reply_until(), wait.cancel_fd, &sent);
    if (why.empty() && asking) replies.erase(replies.begin());  // ASKING's OK
    if (why.empty()) {
      link->last_reply = SteadyClock::now();
      link->used = true;
      if (settings_.sentinel() &&
          std::any_of(replies.begin(), replies.end(), [](const Reply& reply) { return is_error(reply.get(), "READONLY"); })) {
        // The primary was demoted under us: nothing was written (a replica refuses every
        // write). The call goes out again to the primary the sentinels name now.
        discard(std::move(link), false);
        forget_idle();
        if (wait.expired() || wait.stop.stop_requested()) {
          throw BackendUnavailable("redis at " + settings_.description +
                                   " is no longer a primary (READONLY) and no new one answered in time");
        }
        continue;
      }
      if (server) *server = link->server;
      if (follow_up && *follow_up) {
        if (auto next = (*follow_up)(replies)) {
          std::vector<Reply> more;
          // Bounded by the follow-up's own timeout (WAIT's is below kConnectTimeout).
          if (exchange(link->context.get(), std::vector<Command>{*next}, more, SteadyClock::now() + kReplyTimeout,
                       wait.cancel_fd)
                  .empty()) {
            link->last_reply = SteadyClock::now();
            if (follow_reply) *follow_reply = std::move(more.front());
          } else {
            discard(std::move(link), false);
            return replies;
          }
        }
      }
      checkin(std::move(link));
      return replies;
    }
    const bool fresh = !link->used && !wait.stop.stop_requested();
    discard(std::move(link), fresh);
    if (sent && !retry) {
      throw BackendUnavailable("redis at " + settings_.description + " failed mid-request (" + why +
                               "); the outcome is unknown");
    }
    if (wait.expired() || wait.stop.stop_requested()) {
      throw BackendUnavailable("redis at " + settings_.description + " failed: " + why);
    }
  }
}

Command Connection::eval_command(const Script& script, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& args, bool by_sha) {
  const auto index = static_cast<std::size_t>(std::find(scripts_.begin(), scripts_.end(), &script) - scripts_.begin());
  std::string sha;
  if (by_sha) {
    // Known once a first link loaded the scripts (a cluster's node connects at its first call:
    // until then EVAL, which loads the script too).
    std::lock_guard lock(mutex_);
    if (index < shas_.size()) sha = shas_[index];
  }
  Command command{sha.empty() ? "EVAL" : "EVALSHA", sha.empty() ? script.body : sha, std::to_string(keys.size())};
  command.insert(command.end(), keys.begin(), keys.end());
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

std::vector<Result> Connection::run_scripts(const std::vector<ScriptCall>& calls, const Wait& wait, bool retry,
                                            std::string* server, const FollowUp* follow_up, Reply* follow_reply,
                                            bool asking) {
  std::string answered;
  if (!server) server = &answered;
  std::vector<Command> commands;
  for (const auto& [script, keys, args] : calls) commands.push_back(eval_command(*script, keys, args, true));
  // No follow-up after a NOSCRIPT: it goes after the EVAL that runs the script instead.
  FollowUp unless_noscript;
  if (follow_up && *follow_up) {
    unless_noscript = [follow_up](const std::vector<Reply>& replies) -> std::optional<Command> {
      for (const auto& reply : replies) {
        if (is_error(reply.get(), "NOSCRIPT")) return std::nullopt;
      }
      return (*follow_up)(replies);
    };
  }
  auto replies = run(commands, wait, retry, server, &unless_noscript, follow_reply, asking);
  // The server lost its script cache (restart, SCRIPT FLUSH): those scripts did not run; EVAL
  // sends and caches them, in one more round trip.
  std::vector<std::size_t> missing;
  commands.clear();
  for (std::size_t i = 0; i < replies.size(); ++i) {
    if (!is_error(replies[i].get(), "NOSCRIPT")) continue;
    const auto& [script, keys, args] = calls[i];
    missing.push_back(i);
    commands.push_back(eval_command(*script, keys, args, false));
  }
  if (!missing.empty()) {
    auto again = run(commands, wait, retry, server, follow_up, follow_reply, asking);
    for (std::size_t k = 0; k < missing.size(); ++k) replies[missing[k]] = std::move(again[k]);
  }
  std::vector<Result> results(calls.size());
  for (std::size_t i = 0; i < calls.size(); ++i) {
    results[i].error = reply_error(settings_, "script " + std::get<0>(calls[i])->name, replies[i].get());
    if (results[i].ok()) results[i].reply = std::move(replies[i]);
    results[i].server = *server;
  }
  return results;
}

Result Connection::eval_result(const Script& script, const std::vector<std::string>& keys,
                               const std::vector<std::string>& args, Deadline deadline, bool retry, std::string* server,
                               std::stop_token stop, const FollowUp* follow_up, Reply* follow_reply, bool asking) {
  const StopFd cancel(stop);
  return std::move(run_scripts({ScriptCall{&script, keys, args}}, Wait(deadline, std::move(stop), cancel.fd()), retry,
                               server, follow_up, follow_reply, asking)
                       .front());
}

std::vector<Result> Connection::eval_each(const std::vector<ScriptCall>& calls, Deadline deadline, std::string* server,
                                          std::stop_token stop) {
  const StopFd cancel(stop);
  return run_scripts(calls, Wait(deadline, std::move(stop), cancel.fd()), true, server);
}

std::vector<Reply> Connection::eval_pipelined(const std::vector<ScriptCall>& calls, Deadline deadline, std::string* server) {
  auto results = eval_each(calls, deadline, server);
  std::vector<Reply> replies;
  for (auto& result : results) replies.push_back(result.take());
  return replies;
}

bool Connection::watch_idle(SteadyClock::time_point until, int wake_fd) {
  const int fd = lend_idle();
  // Between calls nothing may arrive on a request/response connection: anything readable is an
  // EOF, a reset, or garbage (see looks_alive).
  pollfd fds[2] = {{wake_fd, POLLIN, 0}, {fd, POLLIN | POLLRDHUP, 0}};
  for (;;) {
    const int ready = poll(fds, fd >= 0 ? 2 : 1, poll_timeout(until));
    if (ready >= 0 || errno != EINTR) break;
  }
  return take_back_idle(fd >= 0 && fds[1].revents != 0);
}

int Connection::lend_idle() {
  std::lock_guard lock(mutex_);
  if (lent_ || idle_.empty()) return -1;
  lent_ = std::move(idle_.back());
  idle_.pop_back();
  return lent_->context->fd;
}

bool Connection::take_back_idle(bool readable) {
  std::unique_ptr<Link> link;
  {
    std::lock_guard lock(mutex_);
    link = std::move(lent_);
  }
  if (!link) return false;
  if (readable) {
    discard(std::move(link), false);
    return true;
  }
  checkin(std::move(link));
  return false;
}

Result Connection::command_result(const Command& command, Deadline deadline, std::stop_token stop, bool asking) {
  const StopFd cancel(stop);
  Result result;
  auto replies = run({command}, Wait(deadline, std::move(stop), cancel.fd()), true, &result.server, nullptr, nullptr,
                     asking);
  result.error = reply_error(settings_, command.front(), replies.front().get());
  if (result.ok()) result.reply = std::move(replies.front());
  return result;
}

}  // namespace turnstile::detail::redis
