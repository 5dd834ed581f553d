// SPDX-License-Identifier: Apache-2.0
// What `inspect` shows of a name in Consul: turnstile's queue and line, and the holders only
// Consul's own clients know of (an api.Lock session, api.Semaphore holders).
#include <algorithm>
#include <cctype>
#include <optional>

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/election.hpp"

namespace turnstile::detail::consul {
namespace {

// A holder turnstile's queue does not have: its session and how many permits it holds; a
// peer leader's value and (informational: it restarts if the key is deleted) its key's index.
struct ForeignHolder {
  std::string session;
  std::int64_t permits = 1;
  std::string value{};
  std::uint64_t token = 0;
};

EntryInfo info_of(const KvEntry& entry, const EntryValue& value, bool holding) {
  EntryInfo info;
  info.fencing_token = holding ? entry.modify_index : entry.create_index;
  info.kind = to_string(value.kind);
  info.permits = value.permits;
  info.holding = holding;
  info.pid = value.pid;
  info.host = value.host;
  info.since = std::chrono::system_clock::time_point(milliseconds(value.since_ms));
  info.label = value.label;
  info.value = value.proposal;
  if (value.kept_until_ms != 0)
    info.kept_until = std::chrono::system_clock::time_point(milliseconds(value.kept_until_ms));
  return info;
}

std::optional<std::int64_t> counter_value(const std::vector<KvEntry>& entries) {
  if (entries.empty()) return std::nullopt;
  return counter_value_of(entries.front().value).n;
}

// Our queue's entries as holders and waiters. An exclusive hold leaves its entry as it was
// written (places.cpp, hold): it holds when it heads the queue and its session holds the
// api.Lock key, whose ModifyIndex is its token. An election's leader marks its entry held in
// that transaction (its token, which a proclaim keeps) and its value is NAME's.
void add_queue(Inspection& result, const std::vector<KvEntry>& queue, const std::vector<KvEntry>& lock_keys) {
  std::optional<KvEntry> held_key;
  if (!lock_keys.empty() && lock_keys.front().flags == kLockFlags && !lock_keys.front().session.empty()) {
    held_key = lock_keys.front();
  }
  for (const auto& entry : queue) {
    const auto value = entry_value(entry.value);
    if (result.mode.empty()) {
      result.mode = value.election ? "election" : value.kind == EntryKind::lease ? "semaphore" : "lock";
      result.limit = value.limit;
    }
    // A writer keeps the key through a downgrade (its entry then marked held, shared): its
    // token stays the key's ModifyIndex, as its hold's fencing_token() says.
    const bool has_key = &entry == &queue.front() && held_key && held_key->session == entry.session;
    const bool heads_with_key = has_key && !value.held && value.kind == EntryKind::exclusive;
    auto info = info_of(entry, value, value.held || heads_with_key);
    if (has_key && info.holding && !value.election) info.fencing_token = held_key->modify_index;
    if (has_key && info.holding && value.election) info.value = held_key->value;
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
}

// Holders only Consul's own clients know of: an api.Lock session on the name's key, and
// api.Semaphore holders in `.lock` whose contender key is alive (api.Semaphore prunes the others).
std::vector<ForeignHolder> foreign_holders(Inspection& result, const std::string& name,
                                           const std::vector<KvEntry>& queue, const std::vector<KvEntry>& lock_keys,
                                           const std::vector<KvEntry>& under) {
  std::vector<ForeignHolder> foreign;
  const auto ours = [&](const std::string& session) {
    return std::any_of(queue.begin(), queue.end(), [&](const KvEntry& mine) {
      const auto sessions = entry_value(mine.value).sessions;
      return mine.session == session || std::find(sessions.begin(), sessions.end(), session) != sessions.end();
    });
  };
  for (const auto& entry : lock_keys) {
    const auto mode = peer_key_mode(entry);
    if (mode.empty() || entry.session.empty()) continue;
    if (!ours(entry.session))
      foreign.push_back({entry.session, 1, entry.value, mode == "election" ? entry.modify_index : 0});
    if (result.mode.empty()) result.mode = mode;
  }
  const auto key = encode_name(name);
  for (const auto& entry : under) {
    if (entry.key != key + "/.lock" || entry.flags != kSemaphoreFlags) continue;
    const auto lock = semaphore_lock(entry, name);
    for (const auto& [session, permits] : lock.holders) {
      const auto has_session = [&](const KvEntry& e) { return e.session == session; };
      const bool alive = std::any_of(under.begin(), under.end(), has_session);
      if (permits <= 0 || !alive) continue;
      if (result.mode.empty()) {
        result.mode = "semaphore";
        result.limit = lock.limit;
      }
      if (!ours(session)) foreign.push_back({session, permits});
    }
  }
  return foreign;
}

// A foreign holder as inspect shows it, named by its session's node and name when Consul says.
EntryInfo foreign_info(Http& http, const ForeignHolder& holder, const std::string& mode, milliseconds timeout) {
  EntryInfo info;
  info.kind = mode == "semaphore" ? "lease" : "exclusive";
  info.permits = holder.permits;
  info.holding = true;
  info.value = holder.value;
  info.fencing_token = holder.token;
  info.foreign = "consul session " + holder.session;
  const auto reply = http.call("GET", "/v1/session/info/" + holder.session, "", timeout);
  const auto json = nlohmann::json::parse(reply.body, nullptr, false);
  if (reply.status == 200 && json.is_array() && !json.empty() && json[0].is_object()) {
    info.foreign +=
        " (node " + json[0].value("Node", std::string()) + ", name \"" + json[0].value("Name", std::string()) + "\")";
  }
  return info;
}

// The name a key made by encode_name stands for (its ",XX" escapes undone); none for a key no
// name maps to.
std::optional<std::string> decoded_name(std::string_view key) {
  std::string out;
  for (std::size_t i = 0; i < key.size(); ++i) {
    if (key[i] != ',') {
      out += key[i];
      continue;
    }
    if (i + 2 >= key.size() || !std::isxdigit(static_cast<unsigned char>(key[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(key[i + 2]))) {
      return std::nullopt;
    }
    out += static_cast<char>(std::stoi(std::string(key.substr(i + 1, 2)), nullptr, 16));
    i += 2;
  }
  return out;
}

// The part of a name prefix that every name with it encodes the same way: its whole segments
// (a segment's encoding depends on what follows it only when it is the last) up to the first
// character encode_name might escape.
std::string encoded_the_same(const std::string& prefix) {
  const auto plain = [](unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '/'; };
  std::string out = prefix.substr(0, prefix.rfind('/') == std::string::npos ? 0 : prefix.rfind('/') + 1);
  const auto end = std::find_if_not(out.begin(), out.end(), [&](char c) {
    return plain(static_cast<unsigned char>(c)) && static_cast<unsigned char>(c) < 0x80;
  });
  out.erase(end, out.end());
  return out;
}

}  // namespace

// Every name whose queue has an entry has its occupancy key turnstile/o/<key> (keys.hpp): one
// ?keys listing under the prefix's fixed part. (A name held only by Consul's own clients, with
// no turnstile entry, has none and is not listed.)
QueueNames ConsulBackend::queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) {
  const std::string base = "turnstile/o/";
  const auto path = "/v1/kv/" + url_escape(base + encoded_the_same(prefix)) + "?keys";
  const auto reply = http_.call("GET", path, "", CallBudget(deadline).call_timeout(kConsulTimes.call));
  QueueNames result;
  if (reply.status == 404) return result;
  if (reply.status != 200) throw_error("listing " + base, reply, http_.endpoint());
  const auto keys = nlohmann::json::parse(reply.body, nullptr, false);
  if (!keys.is_array()) throw BackendUnavailable("Consul answered a ?keys listing with something else than a list");
  for (const auto& key : keys) {
    if (!key.is_string()) continue;
    const auto text = key.get<std::string>();
    if (!text.starts_with(base)) continue;
    auto name = decoded_name(std::string_view(text).substr(base.size()));
    if (!name || !name->starts_with(prefix)) continue;
    if (!result.add(std::move(*name), max_names)) break;
  }
  return result;
}

Inspection ConsulBackend::inspect(const std::string& name, Deadline deadline) {
  // Each read gets what is left of the deadline (none left: not sent).
  const auto timeout = [&] { return CallBudget(deadline).call_timeout(kConsulTimes.call); };
  Inspection result;
  result.name = name;
  const auto key = encode_name(name);
  const auto queue = children(read(queue_prefix(name), true, timeout()), queue_prefix(name));
  const auto lock_keys = read(key, false, timeout());
  add_queue(result, queue, lock_keys);
  const auto under = read(key + "/", true, timeout());
  for (const auto& holder : foreign_holders(result, name, queue, lock_keys, under)) {
    result.holders.insert(result.holders.begin(), foreign_info(http_, holder, result.mode, timeout()));
  }
  result.permits = counter_value(read(counter_key(name), false, timeout()));
  for (const auto& entry : children(read(line_prefix(name), true, timeout()), line_prefix(name))) {
    auto info = info_of(entry, entry_value(entry.value), false);
    info.kind = "permits";
    result.waiters.push_back(info);
  }
  return result;
}

}  // namespace turnstile::detail::consul
