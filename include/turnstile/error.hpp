// SPDX-License-Identifier: Apache-2.0
// Every failure turnstile reports is a turnstile::Error; the subclass names the kind.
#pragma once

#include <stdexcept>
#include <string>

namespace turnstile {

enum class ErrorCode {
  invalid_argument,     // bad name, limit, permit count or timeout: nothing was changed
  invalid_url,          // malformed backend URL or unknown scheme
  backend_not_built,    // the URL's scheme is known but its backend is not installed
  backend_unavailable,  // the backend cannot be reached or failed an I/O operation
  would_deadlock,       // re-locking a non-reentrant Mutex, or a reader asking to write
  not_held,             // releasing or querying a hold the caller does not have
  limit_mismatch,       // contenders disagree on a Semaphore's limit
  kind_mismatch,        // one name used both as a lock and as a Semaphore
  hold_lost,            // a hold may have been lost (session expired, state removed)
  queue_full,           // the backend cannot queue another contender on this name
  access_denied,        // the backend refused our credentials or our rights (password, ACL)
  not_replicated,       // an acquire's entry did not reach the replicas asked for in time
                        // (redis ?min_replicas=N): nothing was taken, the entry was removed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

#define TURNSTILE_ERROR_TYPE(Name, code_value)                                     \
  class Name : public Error {                                                      \
   public:                                                                         \
    explicit Name(const std::string& what) : Error(ErrorCode::code_value, what) {} \
  }

TURNSTILE_ERROR_TYPE(InvalidArgument, invalid_argument);
TURNSTILE_ERROR_TYPE(InvalidUrl, invalid_url);
TURNSTILE_ERROR_TYPE(BackendNotBuilt, backend_not_built);
TURNSTILE_ERROR_TYPE(BackendUnavailable, backend_unavailable);
TURNSTILE_ERROR_TYPE(WouldDeadlock, would_deadlock);
TURNSTILE_ERROR_TYPE(NotHeld, not_held);
TURNSTILE_ERROR_TYPE(LimitMismatch, limit_mismatch);
TURNSTILE_ERROR_TYPE(KindMismatch, kind_mismatch);
TURNSTILE_ERROR_TYPE(HoldLost, hold_lost);
TURNSTILE_ERROR_TYPE(QueueFull, queue_full);
TURNSTILE_ERROR_TYPE(AccessDenied, access_denied);
TURNSTILE_ERROR_TYPE(NotReplicated, not_replicated);

#undef TURNSTILE_ERROR_TYPE

}  // namespace turnstile
