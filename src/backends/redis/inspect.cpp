// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

#include <sstream>

#include "core/text_escape.hpp"

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
    // An election candidate's value comes third (its 'v<seq>' field).
    const bool candidate = item->elements > 2 && item->element[2]->type == REDIS_REPLY_STRING;
    if (candidate) info.value = string_at(item, 2);
    const char kind = state.empty() ? 'x' : state[0];
    info.kind = kind == 's' ? "shared" : kind == 'l' ? "lease" : "exclusive";
    info.holding = state.size() > 1 && state[1] == '1';
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    // release.lua's mark of an entry kept after its release (release_after): ends at its until.
    if (request == "kept") info.kept_until = std::chrono::system_clock::time_point(milliseconds(until_ms));
    if (i == 0) {
      result.mode = kind == 'l' ? "semaphore" : candidate ? "election" : "lock";
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

// SCAN's MATCH is a glob: the characters it gives a meaning are escaped in a literal part.
std::string glob_literal(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// Keys SCAN looks at per call: enough for few round trips, small enough that a call on a large
// keyspace stays short (SCAN's COUNT is a hint of work, not of keys returned).
constexpr int kScanCount = 1000;

}  // namespace

// SCAN (never KEYS, which blocks the server) over every primary for the queue hashes of names
// with the prefix: "turnstile:{<name, %-encoded>}:q" (keys.cpp); a name's encoding starts with
// its prefix's.
QueueNames RedisBackend::queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) {
  const auto start = queue_tag("");  // "turnstile:{}:" without its "}:"
  const auto head = start.substr(0, start.size() - 2);
  const auto tag = queue_tag(prefix);
  const auto pattern = glob_literal(tag.substr(0, tag.size() - 2)) + "*}:q";
  const CallBudget budget(deadline);
  QueueNames result;
  for (const auto& primary : connection_.primaries(budget)) {
    std::string cursor = "0";
    do {
      const auto reply = connection_.command_at(
          primary, {"SCAN", cursor, "MATCH", pattern, "COUNT", std::to_string(kScanCount)}, budget);
      if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 || reply->element[1]->type != REDIS_REPLY_ARRAY) {
        unexpected_reply("SCAN");
      }
      cursor = string_at(reply.get(), 0);
      const auto* keys = reply->element[1];
      for (std::size_t i = 0; i < keys->elements; ++i) {
        const std::string key(reply_view(keys->element[i]));
        if (!key.starts_with(head) || !key.ends_with("}:q")) continue;
        auto name = percent_decode(std::string_view(key).substr(head.size(), key.size() - head.size() - 3));
        if (!name) continue;  // not a key of ours
        if (!result.add(std::move(*name), max_names)) return result;
      }
    } while (cursor != "0");
  }
  return result;
}

Inspection RedisBackend::inspect(const std::string& name, Deadline deadline) {
  return std::move(inspect_each({name}, deadline).front());
}

// Every name's inspect.lua and counter_inspect.lua in one pipeline (one round trip per node).
std::vector<Inspection> RedisBackend::inspect_each(const std::vector<std::string>& names, Deadline deadline) {
  std::vector<ScriptCall> calls;
  std::vector<bool> counters;  // per name: whether its counter was asked about too
  for (const auto& name : names) {
    const auto keys = keys_of(name);
    calls.emplace_back(&scripts::inspect, keys.keys, std::vector<std::string>{keys.channel});
    try {
      const auto counter_keys_of_name = counter_keys(name, settings_.cluster());
      calls.emplace_back(&scripts::counter_inspect, counter_keys_of_name.keys,
                         std::vector<std::string>{counter_keys_of_name.channel});
      counters.push_back(true);
    } catch (const InvalidArgument&) {
      counters.push_back(false);  // a lock name that no counter may use
    }
  }
  auto replies = connection_.eval_pipelined(calls, CallBudget(deadline).for_call(kRedisTimes.call));
  for (const auto& reply : replies) {
    if (reply->type != REDIS_REPLY_ARRAY) unexpected_reply("inspect");
  }
  std::vector<Inspection> results(names.size());
  for (std::size_t i = 0, next = 0; i < names.size(); ++i) {
    results[i].name = names[i];
    read_queue(replies[next++].get(), results[i]);
    if (counters[i]) read_counter(replies[next++].get(), results[i]);
  }
  return results;
}

}  // namespace turnstile::detail::redis
