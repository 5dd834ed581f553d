// SPDX-License-Identifier: Apache-2.0
// Consul's answers as turnstile errors (refusals.cpp), the backend's one translation point: an
// HTTP status, and why Consul refused a transaction: a 409's
// {"Errors":[{"OpIndex":i,"What":"..."}]} is read by each failed operation's reason as Consul
// words it (agent/consul/state/txn.go, state/kvs.go, kvs_endpoint.go kvsPreApply), never by
// its position alone. A refusal no caller expects is a typed error, not a retry.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/consul/http.hpp"

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

// An answer that is not 2xx: 403 AccessDenied, 400/413 InvalidArgument, anything else
// BackendUnavailable. `context` says what was tried; the token never appears.
[[noreturn]] void throw_error(const std::string& context, const Reply& reply, const Endpoint& endpoint);

// A 409 of /v1/txn on `ops`: its failed operations, by reason. A refusal of the ACL throws
// AccessDenied (naming the verb and key); one with a reason nobody expects, or none, throws
// BackendUnavailable: nothing was applied, and the same transaction would be refused again.
Refused read_refusal(const Reply& reply, const nlohmann::json& ops, const std::string& context,
                     const Endpoint& endpoint);

// A KV write answered 500 'invalid session "ID"' (kvsLockTxn): the session is gone on the
// server; its caller reads it as refused, like a lock held by another.
bool refused_for_invalid_session(const Reply& reply);

// A session create answered 500 "Invalid Session TTL": a TTL outside the server's
// session_ttl_min..24h (the caller's setting, not an outage).
bool refused_session_ttl(const Reply& reply);

}  // namespace turnstile::detail::consul
