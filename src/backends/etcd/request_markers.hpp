// SPDX-License-Identifier: Apache-2.0
// Request markers: why a copy of a write that arrives after its sender gave up changes nothing.
//
// gRPC resends a join after a per-attempt timeout or a reset, to the next endpoint, and a copy
// sent earlier may still reach etcd later (a paused member, a stalled connection) — after the
// client was answered, held, released or left. So every request that creates an entry, takes
// permits or changes a counter has a marker key on the client's lease,
// \x1fturnstile/requests/<lease hex>/<request, 16 hex digits>, and its Txn applies only while (a)
// its marker does not exist and (b) no floor key \x1fturnstile/requests-below/<lease hex>/<w>
// with w > request exists. A join puts its marker in both branches, so once any copy was
// answered every later copy fails; a take or a counter change (never resent) puts it when it
// applies; the clean-up of a request whose answer was lost puts it. The
// markers live on the lease: a copy that arrives after the lease ended fails anyway (its put
// names a lease etcd no longer knows).
//
// Markers do not pile up: once every request of the lease below w has been answered or
// cleaned up, a later request's Txn also puts the floor w and deletes the markers and floors
// below it (a sweep), which keeps every copy of those requests failing.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "backends/etcd/connection.hpp"

namespace turnstile::detail::etcd {

class RequestMarkers {
 public:
  RequestMarkers(std::int64_t lease, const std::string& lease_hex);

  // Counts `request` (a number no other request of the client has) as in flight.
  void begin(std::uint64_t request);
  // The request was answered, or its clean-up is done: no copy of it can apply any more.
  void resolved(std::uint64_t request);

  std::string marker(std::uint64_t request) const;
  // The compares only a copy of `request` that nothing retired yet passes.
  void guard(pb::TxnRequest& txn, std::uint64_t request) const;
  // Puts the marker of `request` (on the lease) in `ops`.
  void retire(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, std::uint64_t request,
              const std::string& value = "") const;
  // Adds a sweep to `ops` (a success branch guarded by guard()) when enough requests were
  // resolved since the last one; returns its floor, 0 for none. Pass it to swept() once the
  // Txn succeeded.
  std::uint64_t add_sweep(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops);
  void swept(std::uint64_t floor);

 private:
  std::string floor_key(std::uint64_t floor) const;

  const std::int64_t lease_;
  const std::string marker_prefix_;
  const std::string floor_prefix_;
  std::mutex mutex_;
  std::set<std::uint64_t> in_flight_;
  std::uint64_t last_begun_ = 0;
  std::uint64_t floor_ = 0;  // the last floor etcd confirmed
  std::uint64_t resolved_since_sweep_ = 0;
};

}  // namespace turnstile::detail::etcd
