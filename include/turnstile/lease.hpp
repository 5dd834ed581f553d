// SPDX-License-Identifier: Apache-2.0
// Lease: a hold that belongs to an object, not to a thread (Semaphore leases, async lock holds).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>

#include "turnstile/client.hpp"

namespace turnstile {

namespace detail {
class HoldRecord;
}  // namespace detail

// A hold owned by an object rather than a thread: n leases of one Semaphore, or a lock held
// through an async acquire (lock_async, lock_shared_async). Held until release() or destruction.
// Movable, not copyable; may be used and released from any thread.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;  // releases what this lease held first
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  // Releases; failures go to the client's error handler and are retried in the background.
  ~Lease();

  bool held() const noexcept { return record_ != nullptr; }
  explicit operator bool() const noexcept { return held(); }
  const std::string& name() const;      // throws NotHeld when empty
  std::int64_t permits() const;         // throws NotHeld when empty
  std::uint64_t fencing_token() const;  // throws NotHeld when empty
  std::stop_token lost_token() const;   // throws NotHeld when empty
  // See LockHandle::release_receipt(); throws NotHeld when empty.
  std::string release_receipt() const;
  HoldState hold_state() const;  // throws NotHeld when empty
  // Releases now and reports: NotHeld (empty or already released), BackendUnavailable
  // (the release is still retried in the background), HoldLost.
  void release();
  // Gives the lease up now but leaves it taken for `keep_for` more (ShedLock's lockAtLeastFor):
  // see LockHandle::release_after.
  void release_after(std::chrono::milliseconds keep_for);

  explicit Lease(std::shared_ptr<detail::HoldRecord> record);

 private:
  std::shared_ptr<detail::HoldRecord> record_;
};

}  // namespace turnstile
