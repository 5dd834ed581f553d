#include "backends/consul/refusals.hpp"

#include <algorithm>

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

}  // namespace turnstile::detail::consul
