// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/replies.hpp"

#include <algorithm>
#include <charconv>

namespace turnstile::detail::redis {

std::string_view reply_view(const redisReply* reply) {
  return reply && reply->str ? std::string_view(reply->str, reply->len) : std::string_view();
}

bool is_error(const redisReply* reply, std::string_view code) {
  if (!reply || reply->type != REDIS_REPLY_ERROR) return false;
  const auto text = reply_view(reply);
  return text.substr(0, code.size()) == code && (text.size() == code.size() || text[code.size()] == ' ');
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

std::string user_of(const Settings& settings) {
  return settings.user.empty() ? std::string("the default user") : "user '" + redacted(settings, settings.user) + "'";
}

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
  if ((is_error(reply, "MOVED") || is_error(reply, "ASK")) && !settings.cluster()) {
    // redis:// naming a node of a cluster: the names its slots serve work, the others are
    // redirected, which a plain redis:// connection does not follow.
    return std::make_exception_ptr(BackendUnavailable(message + " (" + settings.description +
                                                      " is a node of a Redis Cluster: use redis+cluster://)"));
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

std::exception_ptr credentials_refused(const Settings& settings, const redisReply* reply) {
  if (!reply || reply->type != REDIS_REPLY_ERROR) return nullptr;
  // WRONGPASS, or a password given to a server that has none: our credentials are wrong.
  return std::make_exception_ptr(AccessDenied("redis at " + settings.description + " refused " + user_of(settings) +
                                              ": " + redacted(settings, reply_view(reply))));
}

std::exception_ptr sentinel_refused(const Settings& probe, const std::string& what, const redisReply* reply) {
  if (!reply || reply->type != REDIS_REPLY_ERROR) return nullptr;
  const auto text = redacted(probe, reply_view(reply));
  if (what == "the sentinel password") {
    return std::make_exception_ptr(
        AccessDenied("redis " + probe.description + " refused the sentinel password: " + text));
  }
  if (is_error(reply, "NOAUTH") || is_error(reply, "NOPERM") || is_error(reply, "WRONGPASS")) {
    return std::make_exception_ptr(
        AccessDenied("redis " + probe.description + " refused " + what + ": " + text + " (sentinel_password=)"));
  }
  return nullptr;
}

std::exception_ptr not_replicated(const Settings& settings, const redisReply* reply) {
  const auto need = std::to_string(settings.min_replicas);
  std::string why;
  if (!reply) {
    why = ": no answer to WAIT " + need + " (min_replicas)";
  } else if (reply->type == REDIS_REPLY_INTEGER && reply->integer >= settings.min_replicas) {
    return nullptr;
  } else if (reply->type == REDIS_REPLY_INTEGER) {
    why = ": the entry reached " + std::to_string(reply->integer) + " replica(s) in time, min_replicas=" + need +
          " asked for " + need;
  } else {
    why = " refused WAIT " + need + " (min_replicas): " + redacted(settings, reply_view(reply));
  }
  return std::make_exception_ptr(NotReplicated("redis at " + settings.description + why + "; nothing was taken"));
}

std::string eviction_risk(const Settings& settings, const std::string& policy) {
  return "redis at " + settings.description + " has maxmemory-policy " + policy +
         ": it may evict lock state while it is held (another contender may then get in before "
         "the holder is told its hold is lost); use noeviction or volatile-*";
}
}  // namespace turnstile::detail::redis
