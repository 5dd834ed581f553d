#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

#include <sstream>

namespace turnstile::detail::redis {
namespace {

// The holder label an entry's text ends with, after the space that follows its since.
std::string label_after(std::istringstream& text) {
  std::string rest;
  std::getline(text, rest);
  return rest.size() > 1 && rest[0] == ' ' ? rest.substr(1) : std::string();
}

// The queue's entries, from inspect.lua's reply.
void read_queue(const redisReply* queue, Inspection& result) {
  for (std::size_t i = 0; i < queue->elements; ++i) {
    const auto* item = queue->element[i];
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(integer_at(item, 0));
    // "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>[ <label>]"
    std::istringstream text(string_at(item, 1));
    std::string state, request;
    std::int64_t limit = 0;
    long long until_ms = 0, since_ms = 0;
    text >> state >> info.permits >> limit >> request >> until_ms >> info.pid >> info.host >> since_ms;
    info.label = label_after(text);
    const char kind = state.empty() ? 'x' : state[0];
    info.kind = kind == 's' ? "shared" : kind == 'l' ? "lease" : "exclusive";
    info.holding = state.size() > 1 && state[1] == '1';
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    if (i == 0) {
      result.mode = kind == 'l' ? "semaphore" : "lock";
      result.limit = kind == 'l' ? limit : 0;
    }
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
}

// The counter's permits and waiter line, from counter_inspect.lua's reply.
void read_counter(const redisReply* permits, Inspection& result) {
  if (permits->elements > 0 && permits->element[0]->type == REDIS_REPLY_STRING) {
    try {
      result.permits = std::stoll(string_at(permits, 0));
    } catch (const std::exception&) {
    }
  }
  for (std::size_t i = 1; i < permits->elements; ++i) {
    EntryInfo info;
    info.kind = "permits";
    info.fencing_token = static_cast<std::uint64_t>(integer_at(permits->element[i], 0));
    std::istringstream text(string_at(permits->element[i], 1));
    long long since_ms = 0;
    text >> info.pid >> info.host >> since_ms;
    info.label = label_after(text);
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
}

}  // namespace

Inspection RedisBackend::inspect(const std::string& name, Deadline deadline) {
  const auto keys = keys_of(name);
  std::vector<ScriptCall> calls{{&scripts::inspect, keys.keys, {keys.channel}}};
  bool counter = true;
  try {
    const auto counter_keys_of_name = counter_keys(name, settings_.cluster());
    calls.emplace_back(&scripts::counter_inspect, counter_keys_of_name.keys,
                       std::vector<std::string>{counter_keys_of_name.channel});
  } catch (const InvalidArgument&) {
    counter = false;  // a lock name that no counter may use
  }
  auto replies = connection_.eval_pipelined(calls, CallBudget(deadline).for_call(kRedisTimes.call));
  for (const auto& reply : replies) {
    if (reply->type != REDIS_REPLY_ARRAY) unexpected_reply("inspect");
  }
  Inspection result;
  result.name = name;
  read_queue(replies[0].get(), result);
  if (counter) read_counter(replies[1].get(), result);
  return result;
}

}  // namespace turnstile::detail::redis
