// SPDX-License-Identifier: Apache-2.0
// PermitCounter's changes outside an acquire: set, add, get, drain.
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

namespace turnstile::detail::redis {

Reply RedisBackend::counter_change(const QueueKeys& keys, const Script& script,
                                   const std::function<std::vector<std::string>(const std::string&)>& args_with) {
  const auto& key = keys.keys.back();
  const auto n = request_ids_.open(key);
  const auto marked = request_ids_.marked(key, n);
  try {
    auto reply = connection_.eval(script, keys.keys, args_with(marked),
                                  {.budget = CallBudget().for_call(kRedisTimes.call), .idempotent = true});
    request_ids_.settle(key, n);
    return reply;
  } catch (const BackendUnavailable&) {
    retire_later({&scripts::counter_retire, keys.keys, {keys.channel, marked, "0"}, key, {n}});
    throw;
  } catch (...) {
    request_ids_.settle(key, n);  // an error reply: nothing was changed
    throw;
  }
}

// Counter changes are applied at most once (see common_prelude.lua): the connection may resend
// one whose reply was lost, and a copy delivered after its sender settled or gave it up changes
// nothing.
bool RedisBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto keys = counter_keys(name, settings_.cluster());
  auto reply = counter_change(keys, scripts::counter_try_set, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, std::to_string(permits), marked};
  });
  return integer_of(reply) == 1;
}

std::int64_t RedisBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto keys = counter_keys(name, settings_.cluster());
  auto reply = counter_change(keys, scripts::counter_add, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, std::to_string(delta), marked, std::to_string(max_permits)};
  });
  if (integer_at(reply.get(), 0) == 0) {
    throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) +
                          " would take the count beyond ±" + std::to_string(max_permits) + " (the count is " +
                          redacted(settings_, string_at(reply.get(), 1)) + "); nothing changed");
  }
  return integer_at(reply.get(), 1);
}

std::optional<std::int64_t> RedisBackend::counter_get(const std::string& name) {
  check_counter_name(name);
  auto reply = connection_.command({"GET", name}, CallBudget().for_call(kRedisTimes.call), name);
  if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
  try {
    if (reply->type == REDIS_REPLY_STRING) return std::stoll(std::string(reply->str, reply->len));
  } catch (const std::exception&) {
  }
  throw BackendUnavailable("the PermitCounter key '" + name + "' does not hold a number");
}

std::int64_t RedisBackend::counter_drain(const std::string& name) {
  const auto keys = counter_keys(name, settings_.cluster());
  return integer_of(counter_change(keys, scripts::counter_drain, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, marked};
  }));
}
}  // namespace turnstile::detail::redis
