// Why Consul refused a transaction (refusals.cpp): the one place where a 409's
// {"Errors":[{"OpIndex":i,"What":"..."}]} is read, by each failed operation's reason as Consul
// words it (agent/consul/state/txn.go, state/kvs.go, kvs_endpoint.go kvsPreApply), never by
// its position alone. A refusal no caller expects is a typed error, not a retry.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile::detail::consul {

enum class Refusal {
  stale,              // cas, delete-cas: "failed to ... key K, index is stale"
  lock_held,          // lock: "failed to lock key K, lock is already held"
  lock_delay,         // lock: "failed to lock key K due to lock delay"
  not_holder,         // unlock: "... lock isn't held, or is held by another session"
  check_failed,       // check-session, check-index: another session or index, or no key
  exists,             // check-not-exists: "key K exists"
  missing,            // get: "key K doesn't exist"
  invalid_session,    // lock: 'invalid session "ID"' (the session is gone on the server)
  permission_denied,  // the token may not: "Permission denied" (newer Consul adds details)
  other,              // anything else ("Must provide key", a commit error, ...)
};

Refusal refusal_of(std::string_view what);

struct RefusedOp {
  std::size_t op = 0;
  Refusal why = Refusal::other;
  std::string what;
};

// A refused transaction's failed operations.
class Refused {
 public:
  void clear() { ops_.clear(); }
  void add(RefusedOp op) { ops_.push_back(std::move(op)); }
  const std::vector<RefusedOp>& ops() const { return ops_; }
  // Operation `op` failed for `why`.
  bool at(std::size_t op, Refusal why) const;
  // Some operation failed for `why`.
  bool any(Refusal why) const;
  // Every failure is one of `op` failing for `why` (and there is one).
  bool only(std::size_t op, Refusal why) const;
  // Every failure is for `why` (and there is one).
  bool all(Refusal why) const;
  // The failures as Consul worded them, for an error message.
  std::string describe() const;

 private:
  std::vector<RefusedOp> ops_;
};

}  // namespace turnstile::detail::consul
