// SPDX-License-Identifier: Apache-2.0
// What a server answers becomes a turnstile exception here and only here: the backend's one
// error translation point.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "backends/redis/settings.hpp"
#include "backends/redis/wire.hpp"

namespace turnstile::detail::redis {

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

// The handshake's own refusals, by reason; null when `reply` refuses nothing:
// AUTH refused (AccessDenied naming the user);
std::exception_ptr credentials_refused(const Settings& settings, const redisReply* reply);
// a sentinel refusing `what` ("the sentinel password", or a command refused for want of it);
std::exception_ptr sentinel_refused(const Settings& probe, const std::string& what, const redisReply* reply);
// ?min_replicas=N: WAIT's answer (null: no answer) counting fewer than N replicas (NotReplicated).
std::exception_ptr not_replicated(const Settings& settings, const redisReply* reply);

// The text of a reply ("" when it has none).
std::string_view reply_view(const redisReply* reply);
// Whether `reply` is an error reply with this code ("NOSCRIPT", "READONLY", ...).
bool is_error(const redisReply* reply, std::string_view code);
// "the default user" or "user 'NAME'", for AccessDenied messages.
std::string user_of(const Settings& settings);

}  // namespace turnstile::detail::redis
