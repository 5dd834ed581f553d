// SPDX-License-Identifier: Apache-2.0
#include "backends/etcd/request_markers.hpp"

#include <algorithm>

#include "core/text_escape.hpp"

namespace turnstile::detail::etcd {
namespace {

// A sweep every this many resolved requests: one more put and two range deletes in a Txn that
// is sent anyway, and at most this many markers (plus those in flight) per lease.
constexpr std::uint64_t kResolvedPerSweep = 32;

// Fixed width, so that the keys sort as the numbers do and a range of keys is a range of numbers.
std::string number_key(std::uint64_t number) { return hex_number(number, 16, HexCase::lower); }

}  // namespace

RequestMarkers::RequestMarkers(std::int64_t lease, const std::string& lease_hex)
    : lease_(lease), marker_prefix_("\x1fturnstile/requests/" + lease_hex + "/"),
      floor_prefix_("\x1fturnstile/requests-below/" + lease_hex + "/") {}

void RequestMarkers::begin(std::uint64_t request) {
  std::lock_guard lock(mutex_);
  in_flight_.insert(request);
  last_begun_ = std::max(last_begun_, request);
}

void RequestMarkers::resolved(std::uint64_t request) {
  std::lock_guard lock(mutex_);
  if (in_flight_.erase(request) > 0) ++resolved_since_sweep_;
}

std::string RequestMarkers::marker(std::uint64_t request) const { return marker_prefix_ + number_key(request); }

std::string RequestMarkers::floor_key(std::uint64_t floor) const { return floor_prefix_ + number_key(floor); }

void RequestMarkers::guard(pb::TxnRequest& txn, std::uint64_t request) const {
  auto* unmarked = txn.add_compare();
  unmarked->set_key(marker(request));
  unmarked->set_result(pb::Compare::EQUAL);
  unmarked->set_target(pb::Compare::CREATE);
  unmarked->set_create_revision(0);
  // No floor above the request: a range compare over no keys holds (etcd compares an absent
  // key's create revision as 0).
  auto* below_every_floor = txn.add_compare();
  below_every_floor->set_key(floor_key(request + 1));
  below_every_floor->set_range_end(prefix_end(floor_prefix_));
  below_every_floor->set_result(pb::Compare::EQUAL);
  below_every_floor->set_target(pb::Compare::CREATE);
  below_every_floor->set_create_revision(0);
}

void RequestMarkers::retire(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, std::uint64_t request,
                            const std::string& value) const {
  auto* put = ops->Add()->mutable_request_put();
  put->set_key(marker(request));
  put->set_value(value);
  put->set_lease(lease_);
}

std::uint64_t RequestMarkers::add_sweep(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops) {
  std::uint64_t floor = 0;
  {
    std::lock_guard lock(mutex_);
    if (resolved_since_sweep_ < kResolvedPerSweep) return 0;
    // Below every request still in flight, and every later one (numbers only grow).
    floor = in_flight_.empty() ? last_begun_ + 1 : *in_flight_.begin();
    if (floor <= floor_) return 0;
  }
  auto* put = ops->Add()->mutable_request_put();
  put->set_key(floor_key(floor));
  put->set_lease(lease_);
  auto* old_floors = ops->Add()->mutable_request_delete_range();
  old_floors->set_key(floor_prefix_);
  old_floors->set_range_end(floor_key(floor));
  auto* old_markers = ops->Add()->mutable_request_delete_range();
  old_markers->set_key(marker_prefix_);
  old_markers->set_range_end(marker(floor));
  return floor;
}

void RequestMarkers::swept(std::uint64_t floor) {
  if (floor == 0) return;
  std::lock_guard lock(mutex_);
  if (floor > floor_) {
    floor_ = floor;
    resolved_since_sweep_ = 0;
  }
}

}  // namespace turnstile::detail::etcd
