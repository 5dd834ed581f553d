// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/layout.hpp"

#include <cstdlib>

#include <nlohmann/json.hpp>

#include "core/text_escape.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// A host name is whatever bytes its holder's kernel has (not always UTF-8, which JSON needs):
// bytes past ASCII and '%' are stored as %XX and read back exactly, for inspect to escape. So
// are a label and an election candidate's value.
bool kept_in_a_value(unsigned char c) { return c < 0x80 && c != '%'; }

std::string host_text(const std::string& host) { return percent_encode(host, kept_in_a_value); }

}  // namespace

std::string to_json(const EntryValue& value) {
  nlohmann::json json = {{"kind", to_string(value.kind)},
                         {"permits", value.permits},
                         {"limit", value.limit},
                         {"held", value.held},
                         {"pid", value.pid},
                         {"host", host_text(value.host)},
                         {"since", value.since_ms}};
  if (!value.sessions.empty()) json["sessions"] = value.sessions;
  if (!value.label.empty()) json["label"] = host_text(value.label);
  if (value.kept_until_ms != 0) json["kept_until"] = value.kept_until_ms;
  if (value.election) {
    json["election"] = true;
    json["value"] = host_text(value.proposal);  // any bytes, as JSON text
  }
  return json.dump();
}

EntryValue entry_value(const std::string& text) {
  EntryValue value;
  const auto json = nlohmann::json::parse(text, nullptr, false);
  if (!json.is_object()) return value;
  const auto kind = json.value("kind", std::string("exclusive"));
  value.kind = kind == "shared" ? EntryKind::shared : kind == "lease" ? EntryKind::lease : EntryKind::exclusive;
  try {
    value.permits = json.value("permits", std::int64_t{1});
    value.limit = json.value("limit", std::int64_t{0});
    value.held = json.value("held", false);
    value.pid = json.value("pid", std::int64_t{0});
    value.host = percent_decode_lenient(json.value("host", std::string()));
    value.since_ms = json.value("since", std::int64_t{0});
    value.label = percent_decode_lenient(json.value("label", std::string()));
    value.kept_until_ms = json.value("kept_until", std::int64_t{0});
    value.election = json.value("election", false);
    value.proposal = percent_decode_lenient(json.value("value", std::string()));
    if (const auto sessions = json.find("sessions"); sessions != json.end() && sessions->is_array()) {
      for (const auto& session : *sessions) {
        if (session.is_string()) value.sessions.push_back(session.get<std::string>());
      }
    }
  } catch (const nlohmann::json::exception&) {
    // A field of the wrong type keeps its default.
  }
  return value;
}

std::string to_json(const CounterValue& value) { return nlohmann::json{{"n", value.n}}.dump(); }

CounterValue counter_value_of(const std::string& text) {
  CounterValue value;
  const auto json = nlohmann::json::parse(text, nullptr, false);
  if (!json.is_object()) {
    value.n = std::strtoll(text.c_str(), nullptr, 10);
    return value;
  }
  if (const auto n = json.find("n"); n != json.end() && n->is_number_integer()) value.n = n->get<std::int64_t>();
  return value;
}

std::string to_json(const SemaphoreLock& lock) {
  nlohmann::json holders = nlohmann::json::object();
  for (const auto& [session, permits] : lock.holders) {
    if (permits == 1) holders[session] = true;
    else if (permits > 1) holders[session] = permits;
  }
  return nlohmann::json{{"Limit", lock.limit}, {"Holders", holders}}.dump();
}

SemaphoreLock semaphore_lock(const KvEntry& entry, const std::string& name) {
  const auto conflict = [&](const std::string& why) {
    return KindMismatch("'" + name + "': Consul key " + entry.key + " is not an api.Semaphore lock (" + why + ")");
  };
  if (entry.flags != kSemaphoreFlags) throw conflict("flags " + std::to_string(entry.flags));
  SemaphoreLock lock;
  lock.modify_index = entry.modify_index;
  const auto json = nlohmann::json::parse(entry.value, nullptr, false);
  if (!json.is_object() || !json.contains("Limit") || !json["Limit"].is_number_integer()) throw conflict("no Limit");
  lock.limit = json["Limit"].get<std::int64_t>();
  if (const auto holders = json.find("Holders"); holders != json.end() && holders->is_object()) {
    for (const auto& [session, held] : holders->items()) {
      // Anything else a peer might write counts as one permit: never fewer than it may hold.
      if (held.is_boolean()) lock.holders[session] = held.get<bool>() ? 1 : 0;
      else if (held.is_number_integer() && held.get<std::int64_t>() > 0)
        lock.holders[session] = held.get<std::int64_t>();
      else lock.holders[session] = 1;
    }
  }
  return lock;
}

}  // namespace turnstile::detail::consul
