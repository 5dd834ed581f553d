// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/refusals.hpp"

#include <algorithm>

#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

bool starts(std::string_view text, std::string_view part) { return text.substr(0, part.size()) == part; }
bool ends(std::string_view text, std::string_view part) {
  return text.size() >= part.size() && text.substr(text.size() - part.size()) == part;
}

}  // namespace

Refusal refusal_of(std::string_view what) {
  // acl.ErrPermissionDenied is "Permission denied"; newer Consul words it "Permission denied:
  // token with AccessorID ... lacks permission ...". Both begin the same.
  if (starts(what, "Permission denied")) return Refusal::permission_denied;
  if (starts(what, "invalid session ")) return Refusal::invalid_session;
  if (ends(what, ", index is stale")) return Refusal::stale;
  if (starts(what, "failed to lock key ")) {
    if (ends(what, "due to lock delay")) return Refusal::lock_delay;
    if (ends(what, ", lock is already held")) return Refusal::lock_held;
  }
  if (starts(what, "failed to unlock key ")) return Refusal::not_holder;
  if (starts(what, "failed to check session, key ") || starts(what, "failed session check for key ") ||
      starts(what, "failed to check index, key ") || starts(what, "failed index check for key ")) {
    return Refusal::check_failed;
  }
  if (starts(what, "key ") && ends(what, "\" exists")) return Refusal::exists;
  if (starts(what, "key ") && ends(what, "\" doesn't exist")) return Refusal::missing;
  return Refusal::other;
}

bool Refused::at(std::size_t op, Refusal why) const {
  return std::any_of(ops_.begin(), ops_.end(), [&](const RefusedOp& r) { return r.op == op && r.why == why; });
}

bool Refused::any(Refusal why) const {
  return std::any_of(ops_.begin(), ops_.end(), [&](const RefusedOp& r) { return r.why == why; });
}

bool Refused::only(std::size_t op, Refusal why) const {
  return !ops_.empty() &&
         std::all_of(ops_.begin(), ops_.end(), [&](const RefusedOp& r) { return r.op == op && r.why == why; });
}

bool Refused::all(Refusal why) const {
  return !ops_.empty() && std::all_of(ops_.begin(), ops_.end(), [&](const RefusedOp& r) { return r.why == why; });
}

std::string Refused::describe() const {
  std::string text;
  for (const auto& refused : ops_) {
    if (!text.empty()) text += "; ";
    text += "operation " + std::to_string(refused.op) + ": " + refused.what.substr(0, 200);
  }
  return text.empty() ? "no reason given" : text;
}

void throw_error(const std::string& context, const Reply& reply, const Endpoint& endpoint) {
  std::string text = reply.body.substr(0, 200);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const auto what = context + " at " + endpoint.shown + ": HTTP " + std::to_string(reply.status) + " " + text;
  if (reply.status == 403) throw AccessDenied(what);
  if (reply.status == 400 || reply.status == 413) throw InvalidArgument(what);
  throw BackendUnavailable(what);
}

namespace {

// The operations that failed, as the 409's body lists them (those without an index skipped).
Refused failed_operations(const std::string& body) {
  Refused refused;
  const auto answer = nlohmann::json::parse(body, nullptr, false);
  const auto errors = answer.is_object() ? answer.find("Errors") : answer.end();
  if (!answer.is_object() || errors == answer.end() || !errors->is_array()) return refused;
  for (const auto& error : *errors) {
    if (!error.is_object() || !error.contains("OpIndex") || !error["OpIndex"].is_number_unsigned()) continue;
    const auto what = error.value("What", std::string());
    refused.add({error["OpIndex"].get<std::size_t>(), refusal_of(what), what});
  }
  return refused;
}

}  // namespace

Refused read_refusal(const Reply& reply, const nlohmann::json& ops, const std::string& context,
                     const Endpoint& endpoint) {
  auto refused = failed_operations(reply.body);
  for (const auto& op : refused.ops()) {
    if (op.why != Refusal::permission_denied) continue;
    const auto kv = op.op < ops.size() ? ops[op.op].value("KV", nlohmann::json::object()) : nlohmann::json::object();
    throw AccessDenied(context + " at " + endpoint.shown + ": Consul refused it: " + op.what.substr(0, 200) +
                       " (the ACL token may not " + kv.value("Verb", std::string("use")) + " key '" +
                       kv.value("Key", std::string()) + "')");
  }
  // No caller expects these: nothing was applied, and trying again would change nothing.
  if (refused.ops().empty() || refused.any(Refusal::other)) {
    throw BackendUnavailable(context + " at " + endpoint.shown +
                             ": Consul refused the transaction: " + refused.describe());
  }
  return refused;
}

bool refused_session_ttl(const Reply& reply) {
  return reply.status == 500 && reply.body.find("Invalid Session TTL") != std::string::npos;
}

bool refused_for_invalid_session(const Reply& reply) {
  return reply.status == 500 && refusal_of(reply.body) == Refusal::invalid_session;
}

}  // namespace turnstile::detail::consul
