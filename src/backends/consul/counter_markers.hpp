// SPDX-License-Identifier: Apache-2.0
// Request markers of PermitCounter changes (counter_changes.cpp, counter_markers.cpp).
//
// Every change (try_set, add, drain, a line's take) is one transaction: [check-not-exists M,
// cas on the counter, lock M on the client's main session, ...]. M = turnstile/x/<session>-<n>
// (marker_key of next_id: the key space of the line's join markers, never the same n). So:
// - a copy of it (a resend, a late delivery) applies only while M is absent; once the change
//   applied, or was declared void (M written "void" when its outcome was unknown), none can;
// - after the session ended, M is gone with it (Behavior delete), but a copy then fails its lock
//   (Consul's kvsLockTxn: 'invalid session'), so no copy applies after that either;
// - "was it applied?" is whether M exists and is not "void": independent of how many other
//   changes came between (the 32 receipts the counter's value once carried were not).
// Settled markers are removed in batches: one that applied at once (the counter's own index
// moved past what its CAS named, so no copy can pass the CAS again), a void one once the counter
// is seen to have moved past it. At most about kMarkerSweepBatch settled markers per client stay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/consul/sessions.hpp"

namespace turnstile::detail::consul {

class ConsulBackend;

struct ChangeMarker {
  std::string key;                   // turnstile/x/<session>-<n>
  std::shared_ptr<Session> session;  // the session M is (to be) locked by
};

// The value of a marker whose change never applied (and never will).
inline constexpr const char* kVoidMarker = "void";
// How many settled markers are removed in one transaction.
inline constexpr std::size_t kMarkerSweepBatch = 32;

struct SettledMarker {
  ChangeMarker marker;
  std::string counter;           // the counter key its change named
  std::uint64_t seen_index = 0;  // the counter's ModifyIndex its CAS named
  bool voided = false;           // it never applied: removable once the counter moved on
};

class SettledMarkers {
 public:
  // Counts `settled`; every kMarkerSweepBatch of them, the background (Cleanup) removes what
  // may be removed (the rest waits for a later round).
  void add(ConsulBackend& backend, SettledMarker settled);

 private:
  std::mutex mutex_;
  std::vector<SettledMarker> pending_;
  std::size_t added_since_sweep_ = 0;
};

}  // namespace turnstile::detail::consul
